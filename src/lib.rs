//! The `shardnet` command's library half: what the command draws (`plot`)
//! and measures (`bench`), kept apart from the training library so that a
//! program depending on `shardnet` compiles neither clap nor plotters.

#![warn(missing_docs)]

#[doc(hidden)]
pub mod bench;
pub mod plot;
