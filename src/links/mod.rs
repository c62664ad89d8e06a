//! Layers and containers built from differentiable communication.
//!
//! - [`MultiNodeChainList`]: ChainerMN's container for model-parallel networks; components on this rank,
//!   wired to other ranks by `rank_in` / `rank_out`.
//! - [`ShardedClassifier`]: the memory-balanced classifier head sharded by classes,
//!   with softmax cross-entropy, [`Margin`]s and Partial FC.

mod multi_node_chain_list;
mod sharded_classifier;

pub use crate::functions::Margin;
pub use multi_node_chain_list::{ChainLink, ChainOutput, MultiNodeChainList};
pub use sharded_classifier::{HeadOutput, ShardedClassifier};
