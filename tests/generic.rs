//! The device-generic path (what a GPU runs), forced on the CPU: the
//! exactness suites again, with every custom op in candle's tensor ops
//! (`SHARDNET_KERNELS=generic`, set here through `kernels::set_kernels` so
//! the process environment is left alone).

use candle_core::{DType, Tensor, Var};
use shardnet::comm::launch_with_timeout;
use shardnet::functions::Context;
use shardnet::kernels::{set_kernels, Kernels};
use shardnet::nn::{Linear, Param};
use shardnet::optim::Adam;
use shardnet::Error;
use std::time::Duration;

fn generic() {
    set_kernels(Kernels::Generic);
}

#[test]
fn autograd_suite_on_the_generic_path() {
    generic();
    let mut failures = Vec::new();
    for n in 1..=4 {
        for (name, body) in shardnet::conformance::autograd::cases() {
            let res = launch_with_timeout(n, Duration::from_secs(20), |c| {
                let c = Context::new(&c);
                body(&c)?;
                match c.pending_backward() {
                    0 => Ok(()),
                    k => Err(Error::Usage(format!("{k} ops left on the tape"))),
                }
            });
            if let Err(e) = res {
                failures.push(format!("{name} on {n} ranks: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sharded_head_suite_on_the_generic_path() {
    generic();
    let mut failures = Vec::new();
    for n in 1..=4 {
        for (name, body) in shardnet::conformance::head::cases() {
            if let Err(e) = launch_with_timeout(n, Duration::from_secs(20), |c| {
                body(&Context::new(&c))
            }) {
                failures.push(format!("{name} on {n} ranks: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
