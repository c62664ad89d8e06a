//! Not an example to copy: the program `tests/mpi.rs` starts under mpiexec
//! to check that a failing rank ends the whole job, with its name, in time.
//! It runs the conformance suite as `shardnet selftest` does, then makes
//! rank 1 fail on purpose (fault injection is kept out of the `shardnet`
//! command and the library):
//!
//!     mpiexec -n 2 target/release/examples/fault_injection panic|error|hang|unconsumed

use shardnet::comm::{self, Communicator};
use shardnet::{Error, Result};

fn main() {
    let fault = std::env::args().nth(1).unwrap_or_default();
    if !["panic", "error", "hang", "unconsumed"].contains(&fault.as_str()) {
        eprintln!("usage: fault_injection panic|error|hang|unconsumed");
        std::process::exit(2);
    }
    if let Err(e) = comm::run("mpi", 1, |c| inject(&c, &fault)) {
        eprintln!("fault_injection: {e}");
        std::process::exit(1);
    }
}

fn inject(c: &Communicator, fault: &str) -> Result<()> {
    let tally = shardnet::conformance::run_all(c)?;
    if c.rank() == 0 {
        println!("{} passed, {} failed", tally.passed, tally.failed.len());
    }
    match (fault, c.rank()) {
        ("panic", 1) => panic!("injected panic"),
        ("error", 1) => return Err(Error::Usage("injected error".into())),
        ("unconsumed", _) => shardnet::conformance::autograd::unconsumed_delegate(
            &shardnet::functions::Context::new(c),
        )?,
        ("hang", 0) => {
            // Rank 1 never sends: the wait must end at the timeout.
            c.recv(1)?;
        }
        ("hang", _) => {
            // Busy elsewhere (not in a call) for longer than the timeout, so
            // that rank 0's wait is the one that ends the job.
            std::thread::sleep(comm::timeout()? * 3);
        }
        _ => {}
    }
    c.barrier()
}
