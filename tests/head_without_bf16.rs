//! The sharded classifier as it runs on a CPU without AVX-512 BF16 (forced
//! here, in a test binary of its own: the switch is process-wide): bf16
//! logits with the f32 GEMMs, every case of `conformance::head` on 1–4
//! thread ranks, bf16 within 2e-3 as before.

use shardnet::kernels::{has_avx512_bf16, set_force_fallback};
use shardnet_conformance::head::cases;
use shardnet_conformance::run_local;
use std::time::Duration;

#[test]
fn every_case_with_f32_gemms_for_bf16_logits() {
    set_force_fallback(true);
    assert!(!has_avx512_bf16());
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
