//! Optimizers over [`crate::nn::Param`]s.
//!
//! - [`Adam`]: one fused pass per parameter (value, moments and gradient
//!   read once, written once), in place.
//! - [`allreduce_grads`]: the multi-node optimizer's gradient allreduce for
//!   data-parallel parameters (sum or mean, and when each is right).
//! - [`LossScaler`]: dynamic loss scaling for half-precision training.

mod adam;
mod multi_node;

pub use adam::Adam;
pub use multi_node::{allreduce_grads, LossScaler};
