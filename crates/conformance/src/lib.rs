//! The communicator conformance suite: every operation against its definition.
//!
//! The same bodies run on the local backend (`tests/comm.rs`, 1–4 thread
//! ranks) and on MPI (`shardnet selftest` under `mpiexec -n 2` and `-n 3`,
//! driven by `tests/mpi.rs`). Every rank generates every other rank's input
//! from (rank, salt), so it can compute the expected result on its own.
//! Inputs are small integers, exact in every dtype, so sums compare exactly
//! except for means (relative tolerance: 1e-6 for f32/f64, 1e-2 for f16/bf16).
//! u8 inputs lie in 0..=15, so that sums over up to [`MAX_RANKS`] ranks stay
//! in range.
//!
//! **Ranks stay in step.** A failed expectation is recorded ([`expect_eq`],
//! [`check`], the suites' tolerance checks), not returned, so a rank whose
//! result is wrong goes on making the same calls as the others. After each
//! case every rank exchanges its outcome ([`run_case`]): all ranks report
//! the same failures, naming the ranks, and start the next case together.
//! An agreement that meets a rank still inside the case is retried, so a
//! rank's early error never puts the ranks out of step.
//!
//! The runner is in `harness`, the communicator suite's cases in
//! `communicator`; the other suites have their own modules.

pub mod autograd;
pub mod chains;
pub mod channel_parallel;
pub mod head;
pub mod tensor_parallel;

mod communicator;
mod harness;

pub use autograd::seeded;
pub use communicator::{cases, data, Body, Case, DTYPES, MAX_RANKS};
pub(crate) use harness::within;
pub use harness::{
    check, expect_eq, max_rel, miss, run_case, run_case_local, run_local, Outcome, Tally,
};

use harness::fail;
use shardnet::comm::Communicator;
use shardnet::Result;

/// Run every case of this suite, of [`autograd`], [`head`], the tensor- and
/// channel-parallel suites and [`chains`] on `comm`,
/// every rank agreeing on each case's outcome. An error: the ranks fell out
/// of step, and the suite stopped.
pub fn run_all(comm: &Communicator) -> Result<Tally> {
    let mut tally = Tally::default();
    for (name, f) in cases() {
        tally.run(comm, name, || f(comm))?;
    }
    autograd::run_all(comm, &mut tally)?;
    head::run_all(comm, &mut tally)?;
    for (name, body) in tensor_parallel::cases()
        .into_iter()
        .chain(channel_parallel::cases())
        .chain(chains::cases())
    {
        // A fresh tape per case: a failed case's pending ops stay behind.
        let cx = &shardnet::functions::Context::new(comm);
        tally.run(comm, &name, || body(cx))?;
    }
    Ok(tally)
}
