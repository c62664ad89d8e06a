//! # shardnet
//!
//! Model-parallel and data-parallel training in Rust on candle. A network that
//! does not fit one device is split across *ranks* (threads of one process,
//! or processes under MPI), and communication between the pieces is part of
//! autograd.
//!
//! - [`comm`]: communicators, the only way ranks talk to each other.
//! - [`functions`]: differentiable communication, inside autograd.
//! - [`links`]: `MultiNodeChainList` and parallel layers.
//! - [`data`]: datasets (MNIST), iterators across ranks.
//! - [`nn`]: `Param`, `ParamStore`, the seeded initialisers, `Linear`.
//! - [`optim`]: Adam, data-parallel gradients, loss scaling.
//! - [`heap`]: the heap counted (live bytes and their peak).
//! - [`output`]: output files checked before the first step and written
//!   atomically.
//! - [`kernels`]: the CPU kernels' switch (`SHARDNET_KERNELS=generic` runs
//!   the device-generic path, as a GPU does).
//!
//! [`comm`] and [`kernels`] are the crates `shardnet-comm` and
//! `shardnet-kernels`, re-exported; the conformance suites
//! (`shardnet-conformance`) and the command (`shardnet-cli`: `train`,
//! `plan`, `bench`, `plot`, `selftest`) sit above this crate.

#![warn(missing_docs)]

pub use shardnet_comm as comm;
pub mod data;
pub mod functions;
pub use shardnet_comm::heap;
pub use shardnet_kernels as kernels;
pub mod links;
pub mod models;
pub mod nn;
pub mod optim;
pub mod output;
pub mod train;

use shardnet_comm::{error, rng};

pub use comm::{create_communicator, launch, Communicator, ReduceOp};
pub use error::{Error, Result};

/// The spin limit candle's own thread pool gets unless
/// `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set: its workers park as soon as an
/// op is done.
const CANDLE_POOL_SPIN_LIMIT: &str = "1";

/// Let candle's own thread pool (its element-wise ops over 64 Ki elements,
/// on `RAYON_NUM_THREADS` − 1 workers of its own, beside rayon's pool that
/// our kernels run on) park its workers as soon as an op is done, unless
/// `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set. candle 0.11's workers spin
/// 25 000 times first, about 0.4 ms on a core our kernels' threads were
/// about to use, after every such op: every node's gradient in backward is
/// one (candle adds it to zeros). Measured on two Zen 5 cores, one process
/// on 2 threads: VGG16 at batch 32 215–230 → 245–250
/// images/s, at 128 even; `bench conv`'s 3 → 64 @ 32 forward + backward
/// 2.8–3.4 → 2.2–2.3 ms. One thread per process has no such workers. Call
/// once at start-up, before candle's first op and any thread; the
/// `shardnet` command does.
pub fn tune_candle_pool() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", CANDLE_POOL_SPIN_LIMIT);
    }
}

/// Keep freed memory in the process for reuse (glibc: no `mmap` for large
/// blocks, no trimming). Every collective returns a fresh tensor; without
/// this, each large one costs a fresh mapping and a page fault per 4 KiB
/// page, which halves bandwidth from 1 MB up. Call once at start-up, before
/// any thread; the `shardnet` command does. A no-op on other platforms.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(
                param: std::os::raw::c_int,
                value: std::os::raw::c_int,
            ) -> std::os::raw::c_int;
        }
        const M_TRIM_THRESHOLD: std::os::raw::c_int = -1;
        const M_MMAP_MAX: std::os::raw::c_int = -4;
        const M_ARENA_MAX: std::os::raw::c_int = -8;
        // SAFETY: mallopt only changes allocator parameters.
        unsafe {
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, -1);
            // Rank threads would get per-thread arenas, which cannot hold
            // blocks over 64 MiB without mmap; one arena keeps them reusable.
            mallopt(M_ARENA_MAX, 1);
        }
    }
}

/// README.md's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
