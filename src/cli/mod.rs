//! The `shardnet` command's own modules (the binary's, not the library's):
//! flags, and how each command maps them onto the library.
//!
//! - `args`: clap definitions of the model subcommands and their flags.
//! - `train`: `shardnet train <model>` (flags → configuration → the
//!   library's runner → outputs).
//! - `plan`: `shardnet plan <model>`.
//! - `tools`: cores per rank, `demo`, `selftest`.

pub(crate) mod args;
pub(crate) mod plan;
pub(crate) mod tools;
pub(crate) mod train;
