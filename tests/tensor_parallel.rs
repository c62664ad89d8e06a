//! The tensor-parallel layers on the local backend (1–4 thread ranks): every
//! case of `conformance::tensor_parallel` against the one-device layers.

use shardnet::conformance::run_local;
use shardnet::conformance::tensor_parallel::cases;
use std::time::Duration;

#[test]
fn every_case_on_one_to_four_ranks() {
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
