//! # shardnet
//!
//! Model-parallel and data-parallel training in Rust on candle. A network that
//! does not fit one device is split across *ranks* (threads of one process,
//! or processes under MPI), and communication between the pieces is part of
//! autograd.
//!
//! - [`comm`]: communicators, the only way ranks talk to each other.
//! - [`bench`]: the measurements behind BENCHMARKS.md.

pub mod bench;
pub mod comm;
pub mod conformance;
mod error;

pub use comm::{create_communicator, launch, Communicator, ReduceOp};
pub use error::{Error, Result};
