//! The models `shardnet train <model>` trains, one file each: its
//! configuration, network, data, the [`TrainModel`](crate::train::TrainModel)
//! the shared loop drives, and its memory estimate for the planner.
//!
//! - [`mnist_mlp`]: ChainerMN's model-parallel MLP on MNIST.
//! - [`mnist_parallel`]: MLPs split within their layers: Chainer's
//!   `MnistMLPParallel` and the exact tensor-parallel MLP.
//! - [`sharded_head`]: the memory-balanced sharded classifier behind a
//!   data-parallel backbone (`face-head`, `mnist-arcface`).
//! - [`vgg16`]: VGG16 with channel-parallel convolutions (ChainerMN's
//!   channel-wise parallel example) on a grid of channel × data parallelism.
//! - [`gpt`]: a GPT on text (Debian's fortunes), tensor × data parallel.
//! - `digits`: MNIST or Fashion-MNIST read on rank 0, shared by the MLPs.
//! - `shares`: a model's layers shared out over data-parallel replicas.

mod digits;
pub mod gpt;
pub mod mnist_mlp;
pub mod mnist_parallel;
pub mod sharded_head;
mod shares;
pub mod vgg16;

pub use digits::Digits;
