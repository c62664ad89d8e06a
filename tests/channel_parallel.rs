//! The channel-parallel convolutions, multi-node batch normalisation and max
//! pooling on the local backend (1–4 thread ranks): every case of
//! `conformance::channel_parallel` against one device.

use shardnet::conformance::channel_parallel::cases;
use shardnet::conformance::run_local;
use std::time::Duration;

#[test]
fn every_case_on_one_to_four_ranks() {
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
