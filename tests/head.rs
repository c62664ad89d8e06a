//! The sharded classifier on the local backend (1–4 thread ranks): every
//! case of `conformance::head` against the one-device head.

use shardnet::comm::launch_with_timeout;
use shardnet::conformance::head::cases;
use std::time::Duration;

#[test]
fn every_case_on_one_to_four_ranks() {
    let mut failures = Vec::new();
    for n in 1..=4 {
        for (name, body) in cases() {
            if let Err(e) = launch_with_timeout(n, Duration::from_secs(20), |c| {
                body(&shardnet::functions::Context::new(&c))
            }) {
                failures.push(format!("{name} on {n} ranks: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
