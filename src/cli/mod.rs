//! The `shardnet` command's own modules (the binary's, not the library's):
//! flags, and how each command maps them onto the library.
//!
//! - `args`: clap definitions of the model subcommands and their flags.
//! - `train`: `shardnet train <model>` (flags → configuration → the
//!   library's runner → outputs).
//! - `plan`: `shardnet plan <model>`.
//! - `sample`: `shardnet sample MODEL --prompt …` (a GPT's text).
//! - `tools`: cores per rank, `demo`, `selftest`.
//!
//! `shardnet train` has one subcommand per model (`mnist-mlp`,
//! `mnist-mlp-parallel`, `face-head`, `mnist-arcface`, `vgg16`), each with
//! exactly its flags: the shared ones (ranks, epochs, batch size, learning
//! rate, seed, metrics, …) are one flattened struct, and a flag of another
//! model is an error. `train` maps them to a model's configuration once,
//! for `train` and `plan` alike.

pub(crate) mod args;
pub(crate) mod plan;
pub(crate) mod sample;
pub(crate) mod tools;
pub(crate) mod train;
