//! Channel-parallel convolutions: one convolution's channels split over the
//! ranks of a communicator. Each drops in wherever a [`Conv2d`](crate::nn::Conv2d) stands:
//! every rank passes the same (replicated) input x (B, C, H, W) and gets the
//! same output y (B, O, Ho, Wo) — except the sharded forms at the end of the
//! table, which take or give a rank's own channels.
//!
//! Rank r of n holds chunk r of a channel count N: N/n channels, one more on
//! the first N mod n ranks ([`chunk_range`](crate::comm::chunk_range); ChainerMN's `_channel_size`).
//! A rank may hold none (fewer channels than ranks).
//!
//! | layer | rank r holds | forward | backward | bytes per rank, fwd / bwd |
//! |-------|--------------|---------|----------|---------------------------|
//! | [`ParallelConvolution2D`] (ChainerMN's, grouped) | input channels r, r+n, r+2n, …; output chunk O_r | conv(x[:, r::n]) on its channels only, allgather along channels | reduce-scatter of dy (sum of every rank's), dx only on its input channels | ≈ y·(n−1)/n / ≈ y·(n−1)/n |
//! | [`ParallelConvolution2D::replicated`] | as above | copy-to(x), then as above, gather-from | dy_r: its slice; dx: allreduce of the ranks' parts (the whole dL/dx on every rank) | ≈ y·(n−1)/n / ≈ 2x·(n−1)/n |
//! | [`OutputParallelConv2d`] (exact) | all input channels; output chunk O_r of W and b | copy-to(x), conv, gather-from along channels | dy_r: its slice, no communication; dx: allreduce | ≈ y·(n−1)/n / ≈ 2x·(n−1)/n |
//! | [`InputParallelConv2d`] (exact) | input chunk C_r of W; b whole | scatter-to(x) along channels, conv without bias, reduce-from, + b | dx_r = conv input gradient, allgather of the slices | ≈ 2y·(n−1)/n / ≈ x·(n−1)/n |
//!
//! | [`OutputParallelConv2d::sharded_output`] | as above | copy-to(x), conv: y_r, its output channels only | dx: allreduce | 0 / ≈ 2x·(n−1)/n |
//! | [`InputParallelConv2d::new_sharded`] | input chunk C_r of W, output chunk of b | conv(x_r) on its channels, reduce-scatter along channels: y_r (the whole-sized partial sums freed at once: backward keeps x_r alone, [`reduce_scatter_of`](crate::functions::reduce_scatter_of)) | allgather of dy | ≈ y·(n−1)/n / ≈ y·(n−1)/n |
//!
//! (x, y: the bytes of the input and output on one rank; ring algorithms.)
//! The sharded forms keep activations split by channels, so per-channel
//! layers after them (batch normalisation, ReLU, pooling) run on 1/n of the
//! channels; `shardnet train vgg16` uses them for `output` (gathered after
//! each block, after its pooling) and `input` (never gathered until the
//! classifier: C_r out of one layer is C_r into the next).
//! Region ops as in [`crate::links::ColumnParallelLinear`]: copy-to =
//! [`copy_to_shards`](crate::functions::copy_to_shards), gather-from =
//! [`allgather_replicated`](crate::functions::allgather_replicated), scatter-to =
//! [`split_to_shards`](crate::functions::split_to_shards), reduce-from =
//! [`allreduce_replicated`](crate::functions::allreduce_replicated).
//!
//! **What each computes.** The two exact layers equal the one-device
//! convolution (to rounding) in values and every gradient, for any split.
//! [`ParallelConvolution2D`] is ChainerMN's layer as written: each rank
//! convolves only its interleaved subset of input channels, so the whole is
//! a *grouped* convolution (n groups, group r = input channels ≡ r mod n →
//! output chunk r), not the full convolution; it has 1/n of the
//! multiply-adds and parameters. Its allgather's backward sums every rank's
//! gradient (reduce-scatter), which is right when each rank computes its
//! own loss from y; when every rank computes the same loss (the rest of the
//! network replicated, as in ChainerMN's VGG16), the gradients reaching
//! its weights are n times those of the one-device grouped convolution —
//! ChainerMN's behaviour, kept; [`ParallelConvolution2D::replicated`] gives
//! the split backward instead.
//!
//! Weights are initialised from the *global* tensor (O, C·kh·kw) of each
//! layer's seed ([`init::uniform_block`](crate::nn::init::uniform_block) of
//! [`init::layer_seed`](crate::nn::init::layer_seed)), bound
//! 1/√fan_in, so the exact layers train the same model on any number of
//! ranks.
//!
//! ```
//! use candle_core::{DType, Tensor};
//! use shardnet::functions::Context;
//! use shardnet::links::{ChannelConv2d, ChannelSplit, ConvConfig};
//! use shardnet::nn::ParamStore;
//!
//! let outs = shardnet::comm::launch(3, |comm| {
//!     let ctx = Context::new(&comm);
//!     let store = ParamStore::new(comm.device(), 7);
//!     // 3 → 5 channels, 3×3, padding 1: rank 0 and 1 hold 2 output channels, rank 2 one.
//!     let conv = ChannelConv2d::new(&ctx, &store.pp("conv"), ChannelSplit::Output, (3, 5), ConvConfig::new())?;
//!     let x = Tensor::ones((2, 3, 8, 8), DType::F32, comm.device())?;
//!     let y = conv.forward(&x)?; // the whole (2, 5, 8, 8) on every rank
//!     y.sum_all()?.backward()?;
//!     // The gradients are in the parameters, on either path.
//!     assert!(conv.params().iter().all(|p| p.grad().is_some()));
//!     Ok(y.dims().to_vec())
//! })?;
//! assert!(outs.iter().all(|d| d == &[2, 5, 8, 8]));
//! # Ok::<(), shardnet::Error>(())
//! ```
//!
//! The files: `config` (the split and the kernel size), `grouped`,
//! `output`, `input` (one layer each), `choice` (the layer a model holds),
//! `common` (what the layers share).

mod choice;
mod common;
mod config;
mod grouped;
mod input;
mod output;

pub use choice::ChannelConv2d;
pub use config::{ChannelSplit, ConvConfig, KernelSize};
pub use grouped::ParallelConvolution2D;
pub use input::InputParallelConv2d;
pub use output::OutputParallelConv2d;
