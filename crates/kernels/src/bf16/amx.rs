//! The bf16 GEMM on AMX tiles (Intel's Advanced Matrix Extensions,
//! `tdpbf16ps`), where the CPU has them and Linux grants them to the
//! process: the same arithmetic as [`super::avx512`]'s AVX-512 BF16 kernel
//! (inputs rounded to bf16, pair products summed in f32), on the matrix
//! unit.
//!
//! | level | size | holds |
//! |---|---|---|
//! | tile | 16 rows × 64 bytes | C: 16 × 16 f32; A: 16 rows × 16 k pairs; B: 16 k pairs × 16 columns (pairs) |
//! | microkernel | 32 × 32 of C | tmm0–3 accumulate C, tmm4–5 two A tiles, tmm6–7 two B tiles: per 32 k, 4 loads and 4 `tdpbf16ps` |
//! | A panel | every row × [`KC`] k | bf16 pairs, row-major within strips of 32 rows (a tile row reads 16 consecutive pairs) |
//! | B panel | [`KC`] k × [`NC`] columns | bf16 pairs, k pair-major within strips of 32 columns ([`super::pack`]'s packing) |
//!
//! k is padded with zero pairs to a multiple of 32 in each panel; a strip
//! beyond the matrix's last row or column is zero. A tile at the edge of C
//! is computed into a local 32 × 32 block and added from there.
//!
//! The tile registers are configured ([`CONFIG`]: palette 1, eight tiles of
//! 16 × 64 bytes) at the start of each GEMM call on the calling thread and
//! released at its end, so a thread holds AMX state only while it
//! multiplies. The process asks Linux once for the permission to use the
//! tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`); where it is
//! refused, or the CPU lacks AMX-BF16, the AVX-512 BF16 kernel runs.
//!
//! One thread on a Sapphire Rapids core: `tdpbf16ps` alone runs at about
//! 2.8 TFLOP/s; the GEMMs at the sharded head's shapes are bound by
//! packing (reading and converting W), see `shardnet bench gemm`.

#[cfg(target_arch = "x86_64")]
use super::blocked::{blocked, Tiles};
use super::input::Input;
use super::pack::GROUP;
use crate::Operand;
use std::sync::atomic::{AtomicBool, Ordering};

/// Rows and columns of the microkernel's block of C (2 × 2 tiles).
const MR: usize = 32;
const NR: usize = 32;
/// k per panel (a multiple of 32), rows per A block, columns per B panel.
const KC: usize = 512;
const MC: usize = 256;
const NC: usize = 256;
const _: () = assert!(KC.is_multiple_of(32) && MC.is_multiple_of(MR) && NC.is_multiple_of(NR));

static FORCE_OFF: AtomicBool = AtomicBool::new(false);

/// Whether bf16 GEMMs run on AMX tiles: the CPU has AMX-TILE and AMX-BF16,
/// Linux granted the tile data to this process (asked once) and
/// `SHARDNET_AMX` is not `0`; false under [`set_force_off`].
pub fn has_amx_bf16() -> bool {
    !FORCE_OFF.load(Ordering::Relaxed) && granted()
}

/// Take the AVX-512 BF16 kernel (or the fallback) even where AMX exists
/// (tests and benchmarks compare them).
pub fn set_force_off(on: bool) {
    FORCE_OFF.store(on, Ordering::Relaxed);
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn granted() -> bool {
    use std::sync::OnceLock;
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        if std::env::var("SHARDNET_AMX").is_ok_and(|v| v == "0") {
            return false;
        }
        // CPUID leaf 7, sub-leaf 0: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        let cpu = leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0;
        // SAFETY: arch_prctl only reads its two integer arguments.
        cpu && unsafe { request_tile_data() } == 0
    })
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn granted() -> bool {
    false
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 when granted
/// (Linux 5.16 and later), a negative errno otherwise.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
unsafe fn request_tile_data() -> i64 {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call; the kernel clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret
}

/// The tile configuration (`ldtilecfg`'s 64 bytes): palette 1, tiles 0–7
/// of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
        c[48 + t] = 16; // rows
        t += 1;
    }
    Config(c)
};

/// dst (m, n) (+)= a (m, k) · b (k, n) on AMX tiles (the caller checked
/// [`has_amx_bf16`] and k > 0); the contract of
/// [`super::matmul_bf16`].
#[cfg(target_arch = "x86_64")]
pub(super) fn gemm<A: Input, B: Input>(
    mnk: (usize, usize, usize),
    dst: (&mut [f32], usize, usize),
    accumulate: bool,
    a: Operand<'_, A>,
    b: Operand<'_, B>,
) {
    // SAFETY: the caller checked the CPU and the permission; the tiles are
    // released before returning.
    unsafe { load_config() };
    blocked::<Amx, _, _>(mnk, dst, accumulate, a, b);
    // SAFETY: as above.
    unsafe { release() };
}

/// The AMX kernel's tiles, for [`blocked`].
#[cfg(target_arch = "x86_64")]
struct Amx;

#[cfg(target_arch = "x86_64")]
impl Tiles for Amx {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = KC;
    const MC: usize = MC;
    const NC: usize = NC;
    /// Padded to whole tiles (16 pairs).
    fn pairs(kc: usize) -> usize {
        kc.div_ceil(32) * 16
    }
    fn pack_a<E: Input>(
        a: Operand<'_, E>,
        m: usize,
        k: (usize, usize, usize),
        out: &mut [u32],
        tmp: &mut Vec<u16>,
    ) {
        pack_rows(a, m, k, out, tmp);
    }
    unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool) {
        // SAFETY: the caller's contract (Tiles::micro); `gemm` configured
        // the tiles on this thread.
        unsafe { micro(kps, a, b, c, rs, add) }
    }
}

/// Load [`CONFIG`] into this thread's tile configuration.
#[cfg(target_arch = "x86_64")]
unsafe fn load_config() {
    // SAFETY: CONFIG is 64 aligned bytes; the caller checked AMX.
    unsafe {
        std::arch::asm!("ldtilecfg [{c}]", c = in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
    }
}

/// Return the tiles to their initial state (no AMX state to save).
#[cfg(target_arch = "x86_64")]
unsafe fn release() {
    // SAFETY: the caller checked AMX.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// Pack rows 0..m of A (element (r, kk) at r·rs + kk·ks), k `k0 .. k0 +
/// kc`, into strips of [`MR`] rows, row-major: strip s, row r, pair p at
/// `out[s·MR·kps + r·kps + p]` (bf16 of k0 + 2p low, k0 + 2p + 1 high);
/// zero beyond m rows and beyond kc.
#[cfg(target_arch = "x86_64")]
fn pack_rows<E: Input>(
    (src, rs, ks): Operand<'_, E>,
    m: usize,
    (k0, kc, kps): (usize, usize, usize),
    out: &mut [u32],
    tmp: &mut Vec<u16>,
) {
    let kp = kc.div_ceil(2);
    let out = &mut out[..m.div_ceil(MR) * MR * kps];
    if ks == 1 {
        // Rows contiguous along k: convert each row straight into its
        // place (on x86, little-endian, a word's low half is its first
        // bf16: the pairs are the row's bf16 in order).
        for (r, row) in out.chunks_exact_mut(kps).enumerate() {
            if r >= m {
                row.fill(0);
                continue;
            }
            // SAFETY: the same memory as 2·kps u16 (u32 is at least as
            // aligned), borrowed mutably once.
            let halves: &mut [u16] =
                unsafe { std::slice::from_raw_parts_mut(row.as_mut_ptr().cast(), 2 * kps) };
            let start = r * rs + k0;
            E::convert(&src[start..start + kc], &mut halves[..kc]);
            halves[kc..].fill(0);
        }
    } else if rs == 1 {
        // k rows contiguous across the rows (A transposed): convert 32 k
        // rows (16 pairs) at a time, then turn each 16 × 16 block of pairs
        // into 16 rows of the strip (AVX-512), the edges one by one.
        out[m * kps..].fill(0);
        tmp.resize(2 * GROUP * m, 0);
        for p0 in (0..kp).step_by(GROUP) {
            let np = GROUP.min(kp - p0);
            for j in 0..2 * np {
                let (kk, t) = (2 * p0 + j, &mut tmp[j * m..(j + 1) * m]);
                if kk < kc {
                    E::convert(&src[(k0 + kk) * ks..][..m], t);
                } else {
                    t.fill(0);
                }
            }
            let whole = if np == GROUP && crate::simd_level() == crate::SimdLevel::Avx512 {
                m / GROUP * GROUP
            } else {
                0
            };
            for r0 in (0..whole).step_by(GROUP) {
                // SAFETY: the CPU has AVX-512 F and BW (simd_level); tmp
                // holds 32 rows of m, out m rows of kps ≥ p0 + 16 words.
                unsafe { pairs_block(tmp, m, r0, &mut out[r0 * kps + p0..], kps) };
            }
            for r in whole..m {
                for q in 0..np {
                    let (lo, hi) = (tmp[2 * q * m + r], tmp[(2 * q + 1) * m + r]);
                    out[r * kps + p0 + q] = u32::from(lo) | (u32::from(hi) << 16);
                }
            }
        }
        for row in out[..m * kps].chunks_exact_mut(kps) {
            row[kp..].fill(0);
        }
    } else {
        out.fill(0);
        for r in 0..m {
            for p in 0..kp {
                let bits = |kk: usize| src[r * rs + (k0 + kk) * ks].bits();
                let hi = if 2 * p + 1 < kc { bits(2 * p + 1) } else { 0 };
                out[r * kps + p] = u32::from(bits(2 * p)) | (u32::from(hi) << 16);
            }
        }
    }
}

/// The 16 × 16 block of pairs at rows `r0 ..` of a transposed A: `tmp`
/// holds 32 k rows of `m` bf16 (k rows 2q and 2q + 1 make pair q); row r's
/// 16 pairs go to `out[(r − r0)·kps ..][..16]`.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `tmp` holds 32·m elements, r0 + 16 ≤ m,
/// and `out` holds 15·kps + 16 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pairs_block(tmp: &[u16], m: usize, r0: usize, out: &mut [u32], kps: usize) {
    use std::arch::x86_64::*;
    assert!(tmp.len() >= 2 * GROUP * m && r0 + GROUP <= m && out.len() >= 15 * kps + GROUP);
    // v[q]: pair q of rows r0 .. r0 + 16.
    let mut v = [_mm512_setzero_si512(); GROUP];
    for (q, v) in v.iter_mut().enumerate() {
        // SAFETY: rows 2q and 2q + 1 of tmp, 16 elements from r0 (asserted).
        unsafe {
            let lo = _mm256_loadu_si256(tmp.as_ptr().add(2 * q * m + r0).cast());
            let hi = _mm256_loadu_si256(tmp.as_ptr().add((2 * q + 1) * m + r0).cast());
            let (lo, hi) = (_mm512_cvtepu16_epi32(lo), _mm512_cvtepu16_epi32(hi));
            *v = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
        }
    }
    // SAFETY: the CPU has AVX-512 F (the caller's contract).
    unsafe { crate::transpose::transpose16_words(&mut v) };
    for (r, v) in v.iter().enumerate() {
        // SAFETY: r·kps + 16 ≤ out.len() (asserted).
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(r * kps).cast(), *v) };
    }
}

/// One MR × NR block of C at `c` (row stride `rs` floats) over `kps` k
/// pairs (a multiple of 16): C (+)= A strip · B strip.
///
/// # Safety
/// AMX is configured with [`CONFIG`] on this thread; `a` holds MR·kps and
/// `b` kps·NR words; MR rows of NR floats at `c`, `rs` apart, are writable.
#[cfg(target_arch = "x86_64")]
unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool) {
    assert!(
        kps.is_multiple_of(16) && kps > 0 && a.len() >= MR * kps && b.len() >= kps * NR,
        "AMX GEMM: short panel"
    );
    let a_stride = kps * 4; // bytes between A rows
    let c_stride = rs * 4;
    let a0 = a.as_ptr();
    // SAFETY: 16 rows further down the strip, inside `a` (asserted).
    let a1 = unsafe { a0.add(16 * kps) };
    // SAFETY: the caller's contract on c; 16 rows down is inside it.
    let c1 = unsafe { c.add(16 * rs) };
    // SAFETY: every address below lies in a, b or the caller's block of c
    // (16 rows of 64 bytes per tile, `kps / 16` steps of 64 bytes along A
    // and of 16 pair rows (2048 bytes) along B).
    unsafe {
        std::arch::asm!(
            "test {add:e}, {add:e}",
            "jz 3f",
            "tileloadd tmm0, [{c0} + {cs}*1]",
            "tileloadd tmm1, [{c0} + {cs}*1 + 64]",
            "tileloadd tmm2, [{c1} + {cs}*1]",
            "tileloadd tmm3, [{c1} + {cs}*1 + 64]",
            "jmp 4f",
            "3:",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "4:",
            "tileloadd tmm4, [{a0} + {as_}*1]",
            "tileloadd tmm5, [{a1} + {as_}*1]",
            "tileloadd tmm6, [{b} + {bs}*1]",
            "tileloadd tmm7, [{b} + {bs}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, 2048",
            "dec {steps}",
            "jnz 4b",
            "tilestored [{c0} + {cs}*1], tmm0",
            "tilestored [{c0} + {cs}*1 + 64], tmm1",
            "tilestored [{c1} + {cs}*1], tmm2",
            "tilestored [{c1} + {cs}*1 + 64], tmm3",
            add = in(reg) u32::from(add),
            c0 = in(reg) c,
            c1 = in(reg) c1,
            cs = in(reg) c_stride,
            a0 = inout(reg) a0 => _,
            a1 = inout(reg) a1 => _,
            as_ = in(reg) a_stride,
            b = inout(reg) b.as_ptr() => _,
            bs = in(reg) NR * 4,
            steps = inout(reg) kps / 16 => _,
            options(nostack)
        );
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use half::bf16;

    /// The transposed packing gives the same words at every vector width
    /// (16 × 16 blocks on AVX-512, one by one elsewhere): rows a multiple
    /// of 16 and not, k whole groups of 32 and not, from f32 and bf16, at
    /// an offset into k.
    #[test]
    fn transposed_packing_is_the_same_at_every_level() {
        for (m, k, k0, kc) in [
            (16, 32, 0, 32),
            (48, 100, 3, 96),
            (37, 70, 1, 69),
            (5, 40, 0, 40),
        ] {
            let kps = Amx::pairs(kc);
            let f = crate::test_values(11, m * k);
            let h: Vec<bf16> = f.iter().map(|v| bf16::from_f32(*v)).collect();
            let words = m.div_ceil(MR) * MR * kps;
            crate::assert_same_at_every_level(
                &format!("pack_rows {m} × {k} from {k0}, {kc}"),
                || {
                    let (mut o1, mut o2) = (vec![7u32; words], vec![7u32; words]);
                    let mut tmp = Vec::new();
                    pack_rows((&f[..], 1, m), m, (k0, kc, kps), &mut o1, &mut tmp);
                    pack_rows((&h[..], 1, m), m, (k0, kc, kps), &mut o2, &mut tmp);
                    (o1, o2)
                },
                |(o1, o2)| {
                    // Row r's pair p: k0 + 2p and k0 + 2p + 1 of row r.
                    let bits = |r: usize, kk: usize| {
                        if r < m && kk < kc {
                            u32::from(h[(k0 + kk) * m + r].to_bits())
                        } else {
                            0
                        }
                    };
                    for r in 0..m.div_ceil(MR) * MR {
                        for p in 0..kps {
                            let want = bits(r, 2 * p) | (bits(r, 2 * p + 1) << 16);
                            assert_eq!(o1[r * kps + p], want, "f32, row {r}, pair {p}");
                        }
                    }
                    assert_eq!(o1, o2, "f32 and bf16 sources");
                    o1.clone()
                },
            );
        }
    }
}
