//! Our CPU kernels' shared pieces, and the choice between them and the
//! device-generic path.
//!
//! Every custom op (the `gemm`-based `nn::Linear`, the sharded head's
//! cross-entropy, the fused optimizers) has two paths:
//!
//! | path | where | how |
//! |------|-------|-----|
//! | fast | CPU tensors | hand-written kernels on the `gemm` crate and our own GEMMs (`sgemm`, `dot`, `bf16`), gradients accumulated in place |
//! | generic | any device (`cuda:i`, `metal:i`), or the CPU with `SHARDNET_KERNELS=generic` | candle tensor ops on `Param::tracked` values; gradients into the `Param`s in backward, as the kernels' |
//!
//! [`fast`] picks one per device. `SHARDNET_KERNELS=generic` forces the
//! generic path on the CPU, so the path a GPU takes is tested on a machine
//! without one (CI runs the whole test suite once each way, and
//! `tests/generic.rs` forces that path in any run). On the generic path a
//! rank with an empty shard keeps it in the graph through `zero_of` (candle
//! prunes `t · 0` and returns empty results without a graph). Both paths
//! leave nothing in candle's `GradStore` for a layer's parameters.
//!
//! What is here: `matmul_strided`, the one strided GEMM call (the `gemm`
//! crate, which picks its AVX-512 or AVX2 kernels at run time; any
//! destination layout); our GEMMs, `sgemm` (f32), `dot` (A · Bᵀ along the
//! sum), `bf16` (bf16 inputs, f32 sums: AMX tiles where the CPU and Linux
//! allow and `SHARDNET_AMX` is not `0`, else AVX-512 BF16, else the f32
//! GEMM); `dispatch!` (an element-wise pass compiled for the
//! CPU's widest vectors, chosen at run time by [`simd_level`]; the same bits
//! at every level) and its users `vector` (the head's rows, a polynomial
//! `exp`); `sum` (long sums in blocks); `transpose` and `avx512` (register
//! transposes, lane masks); [`fma_peak`], the roof `bench gemm` and `bench
//! conv` read rates against; `threads`, `serial` and `split_work` (the
//! thread count, read once per process; a parallel task's GEMMs on its own
//! thread; whether an element-wise pass splits, with the same values either
//! way); `view` and `with_f32s` (a CPU tensor's elements read in place);
//! `sized` and `sized_aligned` (a kept work buffer's first n elements, grown
//! and zeroed only past its length; the second from a 64-byte boundary, so
//! no load or store splits a cache line); `unfilled` (an output a kernel
//! writes whole, not zeroed; NaN-poisoned in unit tests and debug builds).
//!
//! **Threads per rank.** candle's CPU kernels use `RAYON_NUM_THREADS`
//! threads; the `shardnet` command gives each rank its share of the cores
//! (cores / ranks on the node) before any pool starts, so ranks do not
//! oversubscribe, and parks candle's own pool's spinning workers
//! (`tune_candle_pool`). A program that uses the library directly should
//! set `RAYON_NUM_THREADS` before its first step: candle's own ops (the
//! generic path's matmuls) otherwise look the count up on every call.

// The modules are the crates above's own API: their docs may name
// what they keep to themselves.
#![allow(rustdoc::private_intra_doc_links)]

#[doc(hidden)]
pub mod attention;
#[doc(hidden)]
pub mod avx512;
#[doc(hidden)]
pub mod batch_norm;
#[doc(hidden)]
pub mod bf16;
mod buffers;
pub mod caches;
#[doc(hidden)]
pub mod conv_taps;
#[doc(hidden)]
pub mod dot;
mod peak;
#[doc(hidden)]
pub mod pool;
#[doc(hidden)]
pub mod sgemm;
#[doc(hidden)]
pub mod sum;
#[cfg(any(test, feature = "test-util"))]
mod test_util;
#[doc(hidden)]
pub mod transpose;
#[doc(hidden)]
pub mod vector;
#[doc(hidden)]
pub mod winograd;

pub use buffers::{aligned, sized, sized_aligned, unfilled};
pub use peak::fma_peak;
use shardnet_comm::{Error, Result};
#[cfg(any(test, feature = "test-util"))]
pub use test_util::{assert_same_at_every_level, level_lock, test_values};

pub use bf16::amx::has_amx_bf16;
/// Test hook: run the bf16 GEMMs on AVX-512 BF16 (or the fallback) even
/// where AMX exists (tests compare the two).
#[doc(hidden)]
pub use bf16::amx::set_force_off as set_force_no_amx;
pub use bf16::has_avx512_bf16;
/// Test hook: run the bf16 GEMMs through the fallback path even where
/// AVX-512 BF16 exists (tests compare the two).
#[doc(hidden)]
pub use bf16::set_force_fallback;

use candle_core::Device;
use std::sync::atomic::{AtomicU8, Ordering};

/// Which kernels run on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// Hand-written CPU kernels where they exist (the default).
    Fast,
    /// candle tensor ops everywhere, as on a GPU.
    Generic,
}

const UNSET: u8 = 0;
const FAST: u8 = 1;
const GENERIC: u8 = 2;
static CHOICE: AtomicU8 = AtomicU8::new(UNSET);

/// The CPU kernels in use: `SHARDNET_KERNELS` (`fast` or `generic`; read
/// once) unless [`set_kernels`] chose.
pub fn kernels() -> Kernels {
    match CHOICE.load(Ordering::Acquire) {
        FAST => Kernels::Fast,
        GENERIC => Kernels::Generic,
        _ => {
            let generic = std::env::var("SHARDNET_KERNELS").is_ok_and(|v| v == "generic");
            let code = if generic { GENERIC } else { FAST };
            // A concurrent first read decides the same way.
            let _ = CHOICE.compare_exchange(UNSET, code, Ordering::AcqRel, Ordering::Acquire);
            kernels()
        }
    }
}

/// `SHARDNET_WINOGRAD`: 3 × 3 stride-1 f32 convolutions by Winograd's
/// F(2×2, 3×3) (unset or `1`, the default) or on im2col GEMMs (`0`);
/// [`check_env`] refuses anything else.
pub fn winograd_from_env() -> bool {
    std::env::var("SHARDNET_WINOGRAD").map_or(true, |v| v != "0")
}

/// `SHARDNET_KERNELS` checked: unset, `fast` or `generic`;
/// `SHARDNET_AMX` and `SHARDNET_WINOGRAD`: unset, `0` or `1`; anything
/// else is an error naming the variable (never silently the default).
pub fn check_env() -> crate::Result<()> {
    check_var(
        "SHARDNET_WINOGRAD",
        &["0", "1"],
        "give 1 (3×3 stride-1 f32 convolutions by Winograd's algorithm, the default) or 0 \
         (im2col GEMMs), or leave it unset",
    )?;
    check_var(
        "SHARDNET_AMX",
        &["0", "1"],
        "give 0 (bf16 GEMMs on AVX-512 BF16 even where the CPU has AMX tiles) or 1 (AMX where \
         the CPU has it, the default), or leave it unset",
    )?;
    check_var(
        "SHARDNET_KERNELS",
        &["fast", "generic"],
        "give fast (the CPU kernels) or generic (candle's ops, the path a GPU takes), or leave \
         it unset",
    )
}

/// Environment variable `name` unset or one of `allowed`; else a usage
/// error naming it and its value, then `hint`.
fn check_var(name: &str, allowed: &[&str], hint: &str) -> crate::Result<()> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(()),
        Ok(v) if allowed.contains(&v.as_str()) => Ok(()),
        Ok(v) => Err(crate::Error::Usage(format!("{name}={v:?}: {hint}"))),
        Err(e) => Err(crate::Error::Usage(format!("{name}: {e}"))),
    }
}

/// Choose the CPU kernels for this process (tests run the generic path this
/// way without touching the environment). Choose before building a model:
/// layers pick their path when they run.
pub fn set_kernels(k: Kernels) {
    let code = match k {
        Kernels::Fast => FAST,
        Kernels::Generic => GENERIC,
    };
    CHOICE.store(code, Ordering::Release);
}

/// Whether the hand-written CPU kernels serve tensors on `device`.
pub fn fast(device: &Device) -> bool {
    device.is_cpu() && kernels() == Kernels::Fast
}

thread_local! {
    /// Set while this thread runs one of several parallel tasks: its GEMMs
    /// then run on it alone.
    static SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The `gemm` crate's threading: candle's thread count, or this thread
/// alone inside [`serial`].
pub fn parallelism() -> gemm::Parallelism {
    match threads_here() {
        n if n > 1 => gemm::Parallelism::Rayon(n),
        _ => gemm::Parallelism::None,
    }
}

/// Runs `$body` (a closure taking no arguments, whose work sits in an
/// `#[inline(always)]` function it calls) compiled for the widest vectors
/// this CPU has: AVX-512 (F/BW/DQ/VL) or AVX2 + FMA ([`simd_level`],
/// chosen at run time), as baseline code elsewhere. The crate is built for
/// any x86-64, so without this the element-wise passes (batch norm, the
/// optimizers, the logits' rows) run 4 lanes wide at most. Not every pass
/// gains: col2im's short rows ran slower wide, and stay baseline.
/// It must be a function's last expression (it returns from it). Results
/// do not depend on the level: the same operations in the same order, each
/// lane on its own (no contraction into FMAs without a `mul_add`).
#[macro_export]
macro_rules! dispatch {
    // `$body` is expanded once per level: each level gets a closure of its
    // own, called from one place, which LLVM then inlines into that
    // level's `wide` (one closure called from three places was left
    // outlined, at baseline width).
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            match $crate::simd_level() {
                $crate::SimdLevel::Avx512 => {
                    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                    unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
                        f()
                    }
                    let body = $body;
                    // SAFETY: the CPU has these features (simd_level).
                    return unsafe { wide(body) };
                }
                $crate::SimdLevel::Avx2 => {
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
                        f()
                    }
                    let body = $body;
                    // SAFETY: the CPU has AVX2 and FMA (simd_level).
                    return unsafe { wide(body) };
                }
                $crate::SimdLevel::Baseline => {}
            }
        }
        ($body)()
    }};
}

/// The vector width our element-wise passes (batch norm, the optimizers,
/// the head's rows) are compiled for, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// What the crate is built for (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA.
    Avx2,
    /// AVX-512 F, BW, DQ and VL.
    Avx512,
}

/// The cap [`set_simd_level`] put (0: none).
static SIMD_CAP: AtomicU8 = AtomicU8::new(0);

/// The level our element-wise passes run at: this CPU's widest, under the cap
/// of [`set_simd_level`].
pub fn simd_level() -> SimdLevel {
    static DETECTED: std::sync::OnceLock<SimdLevel> = std::sync::OnceLock::new();
    let cpu = *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
                return SimdLevel::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Baseline
    });
    match SIMD_CAP.load(Ordering::Relaxed) {
        1 => cpu.min(SimdLevel::Baseline),
        2 => cpu.min(SimdLevel::Avx2),
        _ => cpu,
    }
}

/// Test hook: run the element-wise passes at most at `level` from now
/// on (tests compare the levels).
#[doc(hidden)]
pub fn set_simd_level(level: SimdLevel) {
    let code = match level {
        SimdLevel::Baseline => 1,
        SimdLevel::Avx2 => 2,
        SimdLevel::Avx512 => 0,
    };
    SIMD_CAP.store(code, Ordering::Relaxed);
}

/// Eight partial sums (lane l summed elements l, l + 8, …) combined in the
/// one fixed order every 8-lane sum uses: the same result on every run and
/// at every vector width.
#[inline(always)]
pub fn tree8<T: Copy + std::ops::Add<Output = T>>(a: [T; 8]) -> T {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Whether a pass over `len` values should split over the threads: more
/// than one thread, outside a [`serial`] task, and enough work to pay for
/// the hand-off. Passes that split must give the same values either way.
pub fn split_work(len: usize) -> bool {
    len >= 1 << 15 && threads_here() > 1
}

/// f(a\[i\], b\[i\]) for every i, split over the threads when [`split_work`]
/// says so (the same values either way): an element-wise op's pass.
pub fn zip_map<T: Copy + Send + Sync>(
    a: &[T],
    b: &[T],
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Vec<T> {
    use rayon::prelude::*;
    if split_work(a.len()) {
        a.par_iter().zip(b).map(|(x, y)| f(*x, *y)).collect()
    } else {
        a.iter().zip(b).map(|(x, y)| f(*x, *y)).collect()
    }
}

/// `f(i, chunk)` for each chunk i of `chunk` elements of `v` (the last may
/// be shorter), over the threads when [`split_work`] says so: a pass whose
/// chunks are independent (the same values either way).
pub fn for_chunks_mut<T: Send>(
    v: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    use rayon::prelude::*;
    let chunk = chunk.max(1);
    if split_work(v.len()) {
        v.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        v.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// Candle's thread count (`RAYON_NUM_THREADS`, else the physical cores),
/// read once per process, as rayon's global pool reads its own once: set
/// the variable before the first kernel runs (the CLI does). candle 0.11's
/// `utils::get_num_threads` reads the variable again on every call and,
/// where it is unset, parses `/proc/cpuinfo` each time: about 25 µs, more
/// than a Winograd chunk's GEMM takes (measured on the Zen 5 core, 64 × 64
/// × 256 in 9.5 µs; 37 µs with the lookup), and paid by every GEMM of a
/// program that uses the library without the variable.
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| candle_core::utils::get_num_threads().max(1))
}

/// The threads a pass on this thread may split over: [`threads`], or 1
/// inside a [`serial`] task. At 1 a pass must run on the
/// caller: a rayon iterator would still hand its work to the pool's one
/// worker and wait, and thread ranks of one core each (one pool between
/// them) would queue behind each other there.
pub fn threads_here() -> usize {
    if SERIAL.with(|s| s.get()) {
        1
    } else {
        threads()
    }
}

/// Run `f` with this thread's GEMMs single-threaded: for a task that is one
/// of several running in parallel (the threads are already busy).
pub fn serial<R>(f: impl FnOnce() -> R) -> R {
    /// Restores the flag however `f` ends (a panic included).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SERIAL.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SERIAL.with(|s| s.replace(true)));
    f()
}

/// Where a contiguous layout's elements lie in its storage; an error
/// naming `op` otherwise. An empty layout is the empty range at 0: its
/// offset may lie past the storage's end (the rows of an empty narrow
/// beyond the last). The one home of this check for our CPU kernels.
fn extent(l: &candle_core::Layout, op: &str) -> candle_core::Result<std::ops::Range<usize>> {
    if !l.is_contiguous() {
        candle_core::bail!("shardnet {op}: expected a contiguous tensor");
    }
    let n = l.shape().elem_count();
    Ok(if n == 0 {
        0..0
    } else {
        l.start_offset()..l.start_offset() + n
    })
}

/// The elements of a contiguous layout of `s` ([`extent`]).
pub fn view<'a, T>(s: &'a [T], l: &candle_core::Layout, op: &str) -> candle_core::Result<&'a [T]> {
    Ok(&s[extent(l, op)?])
}

/// `f` on the f32 elements of a contiguous CPU tensor, read in place (in
/// an op's backward, where the tensors are candle's); an error naming `op`
/// where `t` is not f32 on the CPU.
pub fn with_f32s<R, E: From<candle_core::Error>>(
    t: &candle_core::Tensor,
    op: &str,
    f: impl FnOnce(&[f32]) -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else {
        return Err(candle_core::Error::Msg(format!(
            "shardnet {op}: expected an f32 tensor on the CPU"
        ))
        .into());
    };
    f(view(v, layout, op)?)
}

/// [`view`], mutable.
pub fn view_mut<'a, T>(
    s: &'a mut [T],
    l: &candle_core::Layout,
    op: &str,
) -> candle_core::Result<&'a mut [T]> {
    Ok(&mut s[extent(l, op)?])
}

/// One operand of [`matmul`]: its elements, row stride and column stride.
pub type Operand<'a, T> = (&'a [T], usize, usize);

/// dst (m, n) (+)= a (m, k) · b (k, n), dst row-major; `accumulate` adds to
/// dst instead of overwriting it.
pub fn matmul<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    accumulate: bool,
    a: Operand<'_, T>,
    b: Operand<'_, T>,
) {
    matmul_strided(m, n, k, (dst, n, 1), accumulate, a, b)
}

/// dst (m, n) (+)= a (m, k) · b (k, n) with dst's own strides (row, column):
/// (n, 1) is row-major, (1, m) column-major, i.e. the transpose of a
/// row-major (n, m). The one home of the strided GEMM call.
pub fn matmul_strided<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    (dst, drs, dcs): (&mut [T], usize, usize),
    accumulate: bool,
    a: Operand<'_, T>,
    b: Operand<'_, T>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[r * drs + c * dcs] = T::ZERO;
                }
            }
        }
        return;
    }
    assert!(
        dst.len() > (m - 1) * drs + (n - 1) * dcs,
        "matmul: destination too small"
    );
    assert!(
        a.0.len() > (m - 1) * a.1 + (k - 1) * a.2,
        "matmul: lhs too small"
    );
    assert!(
        b.0.len() > (k - 1) * b.1 + (n - 1) * b.2,
        "matmul: rhs too small"
    );
    // SAFETY: the asserts above keep every access in bounds; dst is a
    // distinct &mut slice, so it aliases neither source.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dcs as isize,
            drs as isize,
            accumulate,
            a.0.as_ptr(),
            a.2 as isize,
            a.1 as isize,
            b.0.as_ptr(),
            b.2 as isize,
            b.1 as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism(),
        );
    }
}

/// The element types [`matmul`] takes: f32 and f64.
pub trait Float: Copy + 'static + std::ops::Add<Output = Self> {
    const ONE: Self;
    const ZERO: Self;
    /// What [`unfilled`] outputs start as in tests.
    const NAN: Self;
    /// The value in f64 (what sums are taken in).
    fn to_f64(self) -> f64;
    /// The f64 `v`, rounded to this type.
    fn from_f64(v: f64) -> Self;
    /// C (m × n, rows `ldc` apart) (+)= A · Bᵀ, both operands contiguous
    /// along k ([`dot::Abt`]): the GEMM crate here, [`dot::matmul_abt`]
    /// for f32.
    fn matmul_abt(p: dot::Abt<Self>, c: &mut [Self], ldc: usize, accumulate: bool) {
        dot::gemm_abt(p, c, ldc, accumulate)
    }
}
impl Float for f32 {
    const ONE: Self = 1.0;
    const ZERO: Self = 0.0;
    const NAN: Self = f32::NAN;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn matmul_abt(p: dot::Abt<f32>, c: &mut [f32], ldc: usize, accumulate: bool) {
        dot::matmul_abt(p, c, ldc, accumulate)
    }
}
impl Float for f64 {
    const ONE: Self = 1.0;
    const ZERO: Self = 0.0;
    const NAN: Self = f64::NAN;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}
