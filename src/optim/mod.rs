//! Optimizers over [`crate::nn::Param`]s.
//!
//! - [`Adam`]: one fused pass per parameter (value, moments and gradient
//!   read once, written once), in place.

mod adam;

pub use adam::Adam;
