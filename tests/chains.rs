//! The sharded layers chained as users combine them (two and three in a
//! row, with plain layers before and between): every case of
//! `conformance::chains` on 1–4 thread ranks against one device, each rank
//! comparing its own dL/dx and parameter gradients. The same cases run on
//! the generic path in `tests/generic.rs` and in `shardnet selftest`.

use shardnet::conformance::chains::cases;
use shardnet::conformance::run_local;
use std::time::Duration;

#[test]
fn every_chain_on_one_to_four_ranks() {
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
