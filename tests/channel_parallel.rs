//! The channel-parallel convolutions, multi-node batch normalisation and max
//! pooling on the local backend (1–4 thread ranks): every case of
//! `conformance::channel_parallel` against one device.

mod common;
use shardnet_conformance::channel_parallel::cases;

fn main() {
    common::conformance_suite(cases, 4, &[]);
}
