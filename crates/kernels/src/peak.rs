//! The core's f32 FMA peak, measured: the roof every GEMM rate is read
//! against (`shardnet bench gemm`, `bench conv`).
//!
//! | CPU has | measured with | FLOP per round |
//! |---------|---------------|----------------|
//! | AVX-512F | 12 independent 16-wide FMAs (zmm) | 12 · 16 · 2 |
//! | AVX2 + FMA | 12 independent 8-wide FMAs (ymm) | 12 · 8 · 2 |
//! | neither | — (reported as 0) | |
//!
//! Twelve chains cover an FMA latency of 4–6 cycles on two pipes. The loop
//! is assembly, registers zeroed first (no denormals), so the compiler can
//! neither fold it nor spill; best of three runs of 20 M rounds.

/// One thread's f32 FMA peak (FLOP/s) and the vector width it used
/// (`"avx512"`, `"avx2"`, or `"none"` with 0).
pub fn fma_peak() -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = is_x86_feature_detected!("avx512f");
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if avx512 || avx2 {
            let rounds = 20_000_000u64;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t = std::time::Instant::now();
                // SAFETY: the features each loop needs were detected.
                let left = unsafe {
                    if avx512 {
                        chains_avx512(rounds)
                    } else {
                        chains_avx2(rounds)
                    }
                };
                std::hint::black_box(left);
                best = best.min(t.elapsed().as_secs_f64());
            }
            let lanes = if avx512 { 16 } else { 8 };
            let name = if avx512 { "avx512" } else { "avx2" };
            return ((rounds * 12 * lanes * 2) as f64 / best, name);
        }
    }
    (0.0, "none")
}

/// `rounds` rounds of 12 independent 8-wide FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains_avx2(rounds: u64) -> u64 {
    let mut n = rounds;
    std::arch::asm!(
        "vxorps ymm0, ymm0, ymm0", "vxorps ymm1, ymm1, ymm1", "vxorps ymm2, ymm2, ymm2",
        "vxorps ymm3, ymm3, ymm3", "vxorps ymm4, ymm4, ymm4", "vxorps ymm5, ymm5, ymm5",
        "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7", "vxorps ymm8, ymm8, ymm8",
        "vxorps ymm9, ymm9, ymm9", "vxorps ymm10, ymm10, ymm10", "vxorps ymm11, ymm11, ymm11",
        "vxorps ymm12, ymm12, ymm12", "vxorps ymm13, ymm13, ymm13",
        "2:",
        "vfmadd231ps ymm0, ymm12, ymm13", "vfmadd231ps ymm1, ymm12, ymm13",
        "vfmadd231ps ymm2, ymm12, ymm13", "vfmadd231ps ymm3, ymm12, ymm13",
        "vfmadd231ps ymm4, ymm12, ymm13", "vfmadd231ps ymm5, ymm12, ymm13",
        "vfmadd231ps ymm6, ymm12, ymm13", "vfmadd231ps ymm7, ymm12, ymm13",
        "vfmadd231ps ymm8, ymm12, ymm13", "vfmadd231ps ymm9, ymm12, ymm13",
        "vfmadd231ps ymm10, ymm12, ymm13", "vfmadd231ps ymm11, ymm12, ymm13",
        "dec {n}",
        "jnz 2b",
        "vzeroupper",
        n = inout(reg) n,
        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
        out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
        out("ymm10") _, out("ymm11") _, out("ymm12") _, out("ymm13") _,
        options(nostack, nomem),
    );
    n
}

/// `rounds` rounds of 12 independent 16-wide FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chains_avx512(rounds: u64) -> u64 {
    let mut n = rounds;
    std::arch::asm!(
        "vxorps zmm0, zmm0, zmm0", "vxorps zmm1, zmm1, zmm1", "vxorps zmm2, zmm2, zmm2",
        "vxorps zmm3, zmm3, zmm3", "vxorps zmm4, zmm4, zmm4", "vxorps zmm5, zmm5, zmm5",
        "vxorps zmm6, zmm6, zmm6", "vxorps zmm7, zmm7, zmm7", "vxorps zmm8, zmm8, zmm8",
        "vxorps zmm9, zmm9, zmm9", "vxorps zmm10, zmm10, zmm10", "vxorps zmm11, zmm11, zmm11",
        "vxorps zmm12, zmm12, zmm12", "vxorps zmm13, zmm13, zmm13",
        "2:",
        "vfmadd231ps zmm0, zmm12, zmm13", "vfmadd231ps zmm1, zmm12, zmm13",
        "vfmadd231ps zmm2, zmm12, zmm13", "vfmadd231ps zmm3, zmm12, zmm13",
        "vfmadd231ps zmm4, zmm12, zmm13", "vfmadd231ps zmm5, zmm12, zmm13",
        "vfmadd231ps zmm6, zmm12, zmm13", "vfmadd231ps zmm7, zmm12, zmm13",
        "vfmadd231ps zmm8, zmm12, zmm13", "vfmadd231ps zmm9, zmm12, zmm13",
        "vfmadd231ps zmm10, zmm12, zmm13", "vfmadd231ps zmm11, zmm12, zmm13",
        "dec {n}",
        "jnz 2b",
        "vzeroupper",
        n = inout(reg) n,
        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
        out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
        out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
        options(nostack, nomem),
    );
    n
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_is_measured_where_the_cpu_has_fma() {
        let (peak, isa) = super::fma_peak();
        if isa == "none" {
            assert_eq!(peak, 0.0);
            println!("skipped: no AVX2 + FMA on this CPU");
            return;
        }
        // A core of any x86 CPU with FMA: well above 1 GFLOP/s, below 1 TFLOP/s.
        assert!((1e9..1e12).contains(&peak), "{isa} peak {peak}");
    }
}
