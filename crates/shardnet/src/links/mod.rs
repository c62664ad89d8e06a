//! Layers and containers built from differentiable communication.
//!
//! - [`MultiNodeChainList`]: ChainerMN's container for model-parallel networks; components on this rank,
//!   wired to other ranks by `rank_in` / `rank_out`.
//! - [`Pipeline`]: a chain of layers in chunks over the ranks, trained by a
//!   [`Schedule`] (GPipe, 1F1B, interleaved, zero-bubble); [`balance`] cuts
//!   stages into chunks by cost.
//! - [`ShardedClassifier`]: the memory-balanced classifier head sharded by classes,
//!   with softmax cross-entropy, [`Margin`](crate::functions::Margin)s and Partial FC.
//! - [`DeviceMesh`]: one model spanning the ranks' devices written as one
//!   program (Chainer's `to_gpu` / `F.copy` style), copies inserted.
//! - [`ColumnParallelLinear`], [`RowParallelLinear`],
//!   [`VocabParallelEmbedding`]: Megatron-LM's tensor-parallel layers;
//!   [`GptBlock`] ([`ParallelAttention`] by heads, [`ParallelMlp`]): a
//!   transformer block split the same way; [`enter_linear`] and
//!   [`exit_linear`]: a region's communication fused with its first and
//!   last GEMM (what Megatron keeps for backward).
//! - [`ParallelConvolution2D`] (ChainerMN's channel-wise parallel convolution, grouped),
//!   [`OutputParallelConv2d`], [`InputParallelConv2d`] (exact), and [`ChannelConv2d`] choosing
//!   among them by a [`ChannelSplit`].
//!
//! Every tensor- and channel-parallel layer can also be made `from_weights`
//! (a user's whole weights) and, as the `ShardedClassifier`, gives its
//! `whole(root)` (the weights and gradients gathered from the shards).

mod channel_parallel;
mod device_mesh;
mod multi_node_chain_list;
mod pipeline;
mod region;
mod sharded_classifier;
mod tensor_parallel;
mod transformer;

pub use channel_parallel::{
    ChannelConv2d, ChannelSplit, ConvConfig, InputParallelConv2d, KernelSize, OutputParallelConv2d,
    ParallelConvolution2D,
};
pub use device_mesh::{DeviceMesh, Placed};
pub use multi_node_chain_list::{ChainLink, ChainOutput, MultiNodeChainList};
pub use pipeline::{
    balance, Action, Balance, Costs, Message, Pass, Pipeline, Plan, Schedule, Timeline,
};
pub use region::{enter_linear, exit_linear};
pub use sharded_classifier::{HeadOutput, ShardedClassifier};
pub use tensor_parallel::{
    ColumnParallelLinear, Features, LinearConfig, RowParallelLinear, VocabParallelEmbedding,
};
pub use transformer::{
    BlockConfig, BlockDropout, GptBlock, ParallelAttention, ParallelMlp, INIT_STD, LN_EPS,
};
