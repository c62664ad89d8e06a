//! Layers and containers built from differentiable communication.
//!
//! - [`MultiNodeChainList`]: ChainerMN's container for model-parallel networks; components on this rank,
//!   wired to other ranks by `rank_in` / `rank_out`.
//! - [`ShardedClassifier`]: the memory-balanced classifier head sharded by classes,
//!   with softmax cross-entropy, [`Margin`]s and Partial FC.
//! - [`ColumnParallelLinear`], [`RowParallelLinear`],
//!   [`VocabParallelEmbedding`]: Megatron-LM's tensor-parallel layers.

mod multi_node_chain_list;
mod sharded_classifier;
mod tensor_parallel;

pub use crate::functions::Margin;
pub use multi_node_chain_list::{ChainLink, ChainOutput, MultiNodeChainList};
pub use sharded_classifier::{HeadOutput, ShardedClassifier};
pub use tensor_parallel::{ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};
