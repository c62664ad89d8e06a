//! Not an example to copy: the program `tests/mpi.rs` starts under mpiexec
//! to check that a failing rank ends the whole job, with its name, in time.
//! It runs the conformance suite as `shardnet selftest` does, then makes
//! rank 1 fail on purpose (fault injection is kept out of the `shardnet`
//! command and the library):
//!
//!     mpiexec -n 2 target/release/examples/fault_injection panic|error|hang|unconsumed
//!
//! or on N thread ranks of the local backend (`tests/cli.rs`):
//!
//!     target/release/examples/fault_injection hang --local 3

use shardnet::comm::{self, Communicator};
use shardnet::{Error, Result};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let fault = args.first().cloned().unwrap_or_default();
    let local = match args.get(1..) {
        Some([flag, n]) if flag == "--local" => n.parse::<usize>().ok(),
        Some([]) => None,
        _ => Some(0),
    };
    if !["panic", "error", "hang", "unconsumed"].contains(&fault.as_str()) || local == Some(0) {
        eprintln!("usage: fault_injection panic|error|hang|unconsumed [--local N]");
        std::process::exit(2);
    }
    let (backend, n) = match local {
        Some(n) => ("local", n),
        None => ("mpi", 1),
    };
    if let Err(e) = comm::run(backend, n, |c| inject(&c, &fault)) {
        eprintln!("fault_injection: {e}");
        std::process::exit(1);
    }
}

fn inject(c: &Communicator, fault: &str) -> Result<()> {
    let tally = shardnet_conformance::run_all(c)?;
    if c.rank() == 0 {
        println!("{} passed, {} failed", tally.passed, tally.failed.len());
    }
    match (fault, c.rank()) {
        ("panic", 1) => panic!("injected panic"),
        ("error", 1) => return Err(Error::Usage("injected error".into())),
        ("unconsumed", _) => shardnet_conformance::autograd::unconsumed_delegate(
            &shardnet::functions::Context::new(c),
        )?,
        ("hang", 0) => {
            // Rank 1 never sends: the wait must end at the timeout.
            c.recv(1)?;
        }
        ("hang", _) => {
            // Busy elsewhere (not in a call) for far longer than the timeout
            // plus the grace, so that rank 0's wait is the one that ends the
            // job, and a launch that waited for this thread is told apart
            // from one that did not by seconds, not by a loaded machine's
            // scheduling.
            std::thread::sleep(comm::timeout()? * 5);
            // Only a launch that waited for this thread prints this.
            eprintln!("busy rank woke");
        }
        _ => {}
    }
    c.barrier()
}
