//! Differentiable communication on the local backend (1–4 thread ranks):
//! the autograd conformance suite, and the failures designed out.

use shardnet::comm::launch_with_timeout;
use shardnet::functions::Context;
use shardnet::Error;
use shardnet_conformance::autograd::{cases, unconsumed_delegate};
use shardnet_conformance::run_local;
use std::time::Duration;

#[test]
fn every_case_on_one_to_four_ranks() {
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn an_unconsumed_delegate_is_an_error_not_a_hang() {
    for n in [2, 3] {
        // A hang would end at the 20 s limit as a timeout, not this error.
        let r = launch_with_timeout(n, Duration::from_secs(20), |c| {
            unconsumed_delegate(&Context::new(&c))
        });
        match r {
            Err(Error::PeerFailed {
                rank: 1, message, ..
            }) => {
                assert!(message.contains("send #1 on rank 1"), "{message}");
                assert!(message.contains("never reached"), "{message}");
            }
            other => panic!("{n} ranks: launch returned {:?}", other.map(|_| ())),
        }
    }
}

/// An allgather along channels whose other dimensions differ between ranks
/// — even with the same element count per channel, (2, ·, 4) against
/// (4, ·, 2) — is a mismatch error on every rank, never a wrong reshape.
#[test]
fn allgather_along_a_dimension_refuses_other_shapes() {
    use candle_core::{DType, Tensor};
    let r = launch_with_timeout(2, Duration::from_secs(20), |c| {
        let ctx = Context::new(&c);
        let shape = if c.rank() == 0 { (2, 3, 4) } else { (4, 3, 2) };
        let x = Tensor::zeros(shape, DType::F32, c.device())?;
        match shardnet::functions::allgather(&ctx, &x, 1) {
            Err(Error::Mismatch { details, .. }) => {
                assert!(details.contains("rank 1: (4, ·, 2)"), "{details}");
                Ok(())
            }
            other => panic!("rank {}: {:?}", c.rank(), other.map(|t| t.dims().to_vec())),
        }
    });
    assert!(r.is_ok(), "{:?}", r.err());
}
