//! Layers whose parameter gradients accumulate in place.
//!
//! candle's backward adds every gradient contribution into a fresh zeroed
//! tensor (`zeros_like` + `add`): for a 4096 × 4096 weight that is 64 MB
//! allocated, zeroed and added per contribution, more than the matmul that
//! produced it, and once per micro-batch when pipelining. A [`Param`] instead
//! owns a gradient buffer that its layers' backward writes into with the
//! matmul itself (GEMM with accumulate), the way PyTorch's `.grad` works;
//! optimizers read it and mark it consumed.
//!
//! - [`Param`]: a value (a candle `Var`, so graphs that use it are tracked)
//!   and its gradient buffer.
//! - [`Linear`]: y = x Wᵀ + b on the `gemm` crate, forward and backward.
//! - [`Conv2d`]: a 2-D convolution: Winograd F(2×2, 3×3) for 3×3 stride-1
//!   kernels in f32, im2col GEMMs otherwise.
//! - [`causal_attention`] and [`causal_self_attention`] (from a fused q,
//!   k, v projection), never holding a head's T × T scores on the CPU.
//! - [`add_residual`]: x + y + b in one pass, db into the bias's buffer.
//! - [`BatchNorm2d`] (also across ranks: ChainerMN's
//!   `MultiNodeBatchNormalization`), [`max_pool2d`], [`dropout`] (and [`dropout_rows`], keyed by each
//!   row's global index), [`relu`].
//! - [`ParamStore`]: a rank's parameters by name, layers built from it,
//!   gradients gathered from every path, the state dict.
//! - [`StateTensor`]: one tensor of a rank's training state (parameter,
//!   optimizer moment, running statistic), read and written in place by
//!   checkpoints.
//! - [`Whole`], [`gather_shard`], [`gather_grad`]: a sharded layer's whole
//!   weight, bias and gradients, gathered from the ranks' shards.
//! - [`Linear::fully_sharded`], [`Conv2d::fully_sharded`] (and their
//!   `gradient_sharded`): a layer whose weight is shared out over
//!   data-parallel replicas, gathered for its passes and its gradient
//!   reduce-scattered (ZeRO stages 3 and 2; `replicas.rs`).
//! - [`defer_weight_grads`]: a backward whose weight-gradient GEMMs wait
//!   for a later pass (zero-bubble pipelines).
//! - [`init`]: the seeded initialisers (by seed and what is initialised,
//!   never by rank).
//!
//! On the CPU `BatchNorm2d` trains as one fused op (`batch_norm/op.rs`),
//! with ReLU fused by `forward_relu` and ReLU plus the max pooling after it
//! by `forward_relu_pool`, which never writes the activation before the
//! pooling. Across ranks the same fused passes run with the per-channel sums
//! allreduced in f64 between them, on the tape (`functions::communicating`).
//! On the generic path a rank without images still makes every allreduce:
//! its empty output is broadcast from a zero that keeps μ, σ², γ and β in
//! the graph (candle drops an operand of a binary op with an empty result).
//! `pool_plane` is the one home of max pooling's winner rule (the fused
//! pooling uses it too); `pool2_affine` runs that pooling's 2 × 2 windows 16
//! at a time on AVX-512, the same values and winners to the bit (tested).
//! `Conv2d` keeps its work buffers per thread.

mod attention;
mod batch_norm;
mod conv;
mod deferred;
mod dropout;
mod gelu;
pub mod init;
mod layer_norm;
mod linear;
mod module;
mod param;
mod pool;
mod relu;
mod replicas;
mod residual;
mod self_attention;
mod sharded;
mod state;
mod store;
mod whole;

pub use attention::{causal_attention, BLOCK as ATTENTION_BLOCK};
pub use batch_norm::BatchNorm2d;
#[doc(hidden)]
pub use conv::set_dense;
pub use conv::{set_winograd, winograd_enabled, Conv2d, ConvBackward};
pub(crate) use conv::{MAX_COL_BYTES, MIN_COLUMNS, WINOGRAD_MIN_CHANNELS};
pub use deferred::{defer_weight_grads, WeightGrads};
pub use dropout::{dropout, dropout_rows};
pub use gelu::gelu;
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub(crate) use module::candle_module;
pub use param::{Param, Shard};
pub use pool::max_pool2d;
pub use relu::relu;
pub use replicas::BLOCK_BYTES as GATHER_BLOCK;
pub use residual::add_residual;
pub use self_attention::causal_self_attention;
pub use sharded::{Init, ShardedParam, WeightsFrom};
pub use state::{Half, Slot, StateTensor, BUFFER_PREFIX};
pub use store::{ParamStore, StateEntry};
pub(crate) use whole::check_bias;
pub use whole::{gather_grad, gather_shard, Whole};
