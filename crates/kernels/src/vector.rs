//! Element-wise passes over rows of logits, vectorised: compiled once for
//! the baseline x86-64 and once with AVX2 and FMA, chosen at run time (the
//! crate is built for any x86-64, so without this these loops would run 4
//! lanes wide at most, and `exp` would be a libm call per element).
//!
//! | function | per element of the row | returns |
//! |---|---|---|
//! | [`scale`] | v ← v·s | |
//! | [`scale_each`] | v ← (v·a_c)·s | |
//! | [`max`] | | the largest v, NaN ignored (−∞ if none) |
//! | [`exp_sub_sum`] | v ← exp(v − m) | Σ v |
//! | [`exp_sub_bf16_sum`] | v ← bf16(exp(v − m)) (as f32) | Σ v |
//! | [`to_bf16`], [`from_bf16`] | bf16 bits ↔ f32, round to nearest even | |
//! | [`gelu`] | y = x·σ(2u), u = √(2/π)(x + 0.044715x³) (GPT-2's tanh form) | |
//! | [`gelu_grad`] | dx = g·(σ + 2x·σ(1 − σ)·u′) | |
//!
//! [`exp`] is a polynomial (Cephes' single-precision form: 2ⁿ·p(r) on
//! r = x − n·ln 2): within 2 ulp of the exact value on [−87, 88], 0 below
//! −87.3, NaN for NaN.

/// Lanes of the reductions' accumulators (two AVX2 registers).
const LANES: usize = 16;

/// e^x (see the module doc for its accuracy).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so n·ln 2 is exact for |n| < 2¹⁰.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // max/min, not clamp: a NaN becomes −88 here (a finite n) and is
    // given back below.
    #[allow(clippy::manual_clamp)] // NaN must not stay NaN here (see above)
    let c = x.max(-88.0).min(88.0);
    let n = (c * LOG2E + 0.5).floor();
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ from its exponent bits, n ∈ [−127, 127] (−127 gives 0). n is read
    // as an integer by adding 1.5·2²³ (its value lands in the low mantissa
    // bits): bit operations only, so the loop stays vectorised (a float to
    // int cast saturates, which compilers do element by element).
    let int_n = (n + 12_582_912.0).to_bits() as i32 - 0x4B40_0000;
    let two_n = f32::from_bits(((int_n + 127) << 23) as u32);
    if x.is_nan() {
        x
    } else {
        y * two_n
    }
}

use super::dispatch;

/// v ← v·s.
pub fn scale(row: &mut [f32], s: f32) {
    dispatch!(|| {
        #[inline(always)]
        fn go(row: &mut [f32], s: f32) {
            row.iter_mut().for_each(|v| *v *= s);
        }
        go(row, s)
    })
}

/// v_c ← (v_c·a_c)·s.
pub fn scale_each(row: &mut [f32], a: &[f32], s: f32) {
    dispatch!(|| {
        #[inline(always)]
        fn go(row: &mut [f32], a: &[f32], s: f32) {
            row.iter_mut().zip(a).for_each(|(v, a)| *v = *v * a * s);
        }
        go(row, a, s)
    })
}

/// The largest element, NaN ignored; −∞ for an empty or all-NaN row.
pub fn max(row: &[f32]) -> f32 {
    dispatch!(|| {
        #[inline(always)]
        fn go(row: &[f32]) -> f32 {
            let mut acc = [f32::NEG_INFINITY; LANES];
            let mut chunks = row.chunks_exact(LANES);
            for c in &mut chunks {
                for (a, v) in acc.iter_mut().zip(c) {
                    *a = if *v > *a { *v } else { *a };
                }
            }
            let mut m =
                chunks
                    .remainder()
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
            for a in acc {
                m = if a > m { a } else { m };
            }
            m
        }
        go(row)
    })
}

/// v ← r(exp(v − m)) for each element; returns Σ v: the one loop of
/// [`exp_sub_sum`] (r the identity) and [`exp_sub_bf16_sum`].
#[inline(always)]
fn exp_sub_sum_rounded(row: &mut [f32], m: f32, r: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = r(exp(*v - m));
            *a += *v;
        }
    }
    let mut sum = 0f32;
    for v in chunks.into_remainder() {
        *v = r(exp(*v - m));
        sum += *v;
    }
    acc.iter().sum::<f32>() + sum
}

/// v ← exp(v − m) for each element; returns Σ v.
pub fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
    dispatch!(|| exp_sub_sum_rounded(row, m, |v| v))
}

/// v ← bf16(exp(v − m)), kept as f32; returns Σ v of the rounded values.
pub fn exp_sub_bf16_sum(row: &mut [f32], m: f32) -> f32 {
    dispatch!(|| exp_sub_sum_rounded(row, m, round_bf16))
}

/// The bf16 bits of `v`, rounded to nearest even (as `half::bf16::from_f32`;
/// a NaN stays a quiet NaN).
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    if v.is_nan() {
        (b >> 16) as u16 | 0x0040
    } else {
        rounded
    }
}

/// `v` rounded to bf16, as an f32.
#[inline(always)]
fn round_bf16(v: f32) -> f32 {
    f32::from_bits(u32::from(bf16_bits(v)) << 16)
}

/// dst ← the bf16 bits of src (one length).
pub fn to_bf16(src: &[f32], dst: &mut [u16]) {
    dispatch!(|| {
        #[inline(always)]
        fn go(src: &[f32], dst: &mut [u16]) {
            dst.iter_mut()
                .zip(src)
                .for_each(|(d, v)| *d = bf16_bits(*v));
        }
        go(src, dst)
    })
}

/// dst ← src's bf16 bits as f32 (one length; exact).
pub fn from_bf16(src: &[u16], dst: &mut [f32]) {
    dispatch!(|| {
        #[inline(always)]
        fn go(src: &[u16], dst: &mut [f32]) {
            dst.iter_mut()
                .zip(src)
                .for_each(|(d, b)| *d = f32::from_bits(u32::from(*b) << 16));
        }
        go(src, dst)
    })
}

/// √(2/π), GELU's scale.
const GELU_K: f32 = 0.797_884_6;
/// GELU's cubic coefficient.
const GELU_C: f32 = 0.044_715;

/// σ(2u(x)) = ½(1 + tanh u(x)) and u′(x) for GELU's tanh form.
#[inline(always)]
fn gelu_sigma(x: f32) -> (f32, f32) {
    let u = GELU_K * (x + GELU_C * x * x * x);
    let s = 1.0 / (1.0 + exp(-2.0 * u));
    (s, GELU_K * (1.0 + 3.0 * GELU_C * x * x))
}

/// y = GELU(x) (tanh form, as the logistic σ(2u): no cancellation where
/// tanh u nears −1), element by element; `x` and `y` of one length.
pub fn gelu(x: &[f32], y: &mut [f32]) {
    dispatch!(|| {
        #[inline(always)]
        fn go(x: &[f32], y: &mut [f32]) {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x * gelu_sigma(x).0;
            }
        }
        go(x, y)
    })
}

/// dx = g · GELU′(x), element by element; all of one length.
pub fn gelu_grad(g: &[f32], x: &[f32], dx: &mut [f32]) {
    dispatch!(|| {
        #[inline(always)]
        fn go(g: &[f32], x: &[f32], dx: &mut [f32]) {
            for ((d, &g), &x) in dx.iter_mut().zip(g).zip(x) {
                let (s, du) = gelu_sigma(x);
                *d = g * (s + 2.0 * x * s * (1.0 - s) * du);
            }
        }
        go(g, x, dx)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ulps between two finite f32 of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_and_handles_the_ends() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (f64::from(x)).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            x += 0.000_731;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Every row pass gives the same bits at every vector width (AVX-512,
    /// AVX2, baseline), odd lengths and a NaN included.
    #[test]
    fn row_passes_are_the_same_at_every_simd_level() {
        let mut row: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        row[5] = f32::NAN;
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let each = |what: &str, f: &dyn Fn(&mut Vec<f32>) -> f32| {
            crate::assert_same_at_every_level(
                what,
                || {
                    let mut r = row.clone();
                    let s = f(&mut r);
                    r.push(s);
                    r
                },
                bits,
            )
        };
        each("scale", &|r| {
            scale(r, 0.3);
            0.0
        });
        let a: Vec<f32> = (0..row.len()).map(|i| i as f32 * 0.01).collect();
        each("scale_each", &|r| {
            scale_each(r, &a, 0.7);
            0.0
        });
        each("max", &|r| max(r));
        each("exp_sub_sum", &|r| exp_sub_sum(r, 13.0));
        each("exp_sub_bf16_sum", &|r| exp_sub_bf16_sum(r, 13.0));
        each("to and from bf16", &|r| {
            let mut h = vec![0u16; r.len()];
            to_bf16(r, &mut h);
            from_bf16(&h, r);
            0.0
        });
        each("gelu", &|r| {
            let x = r.clone();
            gelu(&x, r);
            0.0
        });
        each("gelu_grad", &|r| {
            let x = r.clone();
            gelu_grad(&a, &x, r);
            0.0
        });
    }

    #[test]
    fn row_passes_match_their_scalar_definitions() {
        let row: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        assert_eq!(max(&row), m);
        let mut with_nan = row.clone();
        with_nan[3] = f32::NAN;
        assert_eq!(max(&with_nan), m);
        assert_eq!(max(&[]), f32::NEG_INFINITY);

        let mut r = row.clone();
        let sum = exp_sub_sum(&mut r, m);
        let want: f64 = row.iter().map(|&v| (f64::from(v - m)).exp()).sum();
        assert!((f64::from(sum) - want).abs() <= 1e-6 * want, "{sum} {want}");
        for (got, v) in r.iter().zip(&row) {
            let want = (f64::from(v - m)).exp();
            assert!(
                (f64::from(*got) - want).abs() <= 3e-7 * want.max(1e-30),
                "{got} {want}"
            );
        }

        // bf16: the bits half's conversion gives, NaN and the ends included.
        let mut ends = row.clone();
        ends.extend([
            f32::NAN,
            f32::INFINITY,
            f32::MAX,
            -0.0,
            1e-40,
            3.389_531_4e38,
        ]);
        let mut bits = vec![0u16; ends.len()];
        to_bf16(&ends, &mut bits);
        for (b, v) in bits.iter().zip(&ends) {
            let want = half::bf16::from_f32(*v);
            assert!(
                *b == want.to_bits() || (v.is_nan() && half::bf16::from_bits(*b).is_nan()),
                "{v}: {b:#x} vs {:#x}",
                want.to_bits()
            );
        }
        let mut back = vec![0f32; bits.len()];
        from_bf16(&bits, &mut back);
        for (b, w) in back.iter().zip(&bits) {
            let want = half::bf16::from_bits(*w).to_f32();
            assert!(b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()));
        }
        let mut rb = row.clone();
        let sum = exp_sub_bf16_sum(&mut rb, m);
        let want: f64 = r
            .iter()
            .map(|&e| f64::from(half::bf16::from_f32(e).to_f32()))
            .sum();
        assert!((f64::from(sum) - want).abs() <= 1e-6 * want);

        let mut s = row.clone();
        scale_each(&mut s, &row, 2.0);
        assert!(s.iter().zip(&row).all(|(a, b)| *a == b * b * 2.0));
        scale(&mut s, 0.5);
        assert!(s.iter().zip(&row).all(|(a, b)| *a == b * b));
    }
}
