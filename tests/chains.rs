//! The sharded layers chained as users combine them (two and three in a
//! row, with plain layers before and between): every case of
//! `conformance::chains` on 1–4 thread ranks against one device, each rank
//! comparing its own dL/dx and parameter gradients. The same cases run on
//! the generic path in `tests/generic.rs` and in `shardnet selftest`.

mod common;
use shardnet_conformance::chains::cases;

fn main() {
    common::conformance_suite(cases, 4, &[]);
}
