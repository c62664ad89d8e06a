//! Long sums in blocks, as a blocked BLAS sums: terms in blocks of at
//! most [`BLOCK`], each block summed in order, the blocks' sums added in
//! order. Summed one after another, n positive terms of one size drift by
//! up to n·u of their total (u = 2⁻²⁴ in f32: 60,000 copies of 0.1 come
//! out 5.8e-4 short); in blocks the bound is (BLOCK + n/BLOCK)·u, 3.0e-5
//! at n = 60,000, and the rounding seen is a tenth of that. The GEMMs' k
//! loops are blocked the same way (`sgemm` and the dot kernel at
//! kc = 512 on current cores (`sgemm::blocking`), the `gemm` crate at 512 or more); batch
//! normalisation's plane sums run in f64.
//!
//! | sum | where | terms |
//! |---|---|---|
//! | [`sum`] | a convolution's bias gradient over the images | one plane's sum per image |
//! | [`rows`] | a `Linear`'s bias gradient over the batch | rows of the output gradient |
//!
//! The order is fixed by n alone: the same bits on every run, at every
//! vector width and for any thread count.

use super::Float;

/// Terms per block.
pub const BLOCK: usize = 256;

/// Σ_{i < n} term(i), in blocks.
pub fn sum<T: Float>(n: usize, term: impl Fn(usize) -> T) -> T {
    let mut total = T::ZERO;
    for b0 in (0..n).step_by(BLOCK) {
        let block = (b0..n.min(b0 + BLOCK)).fold(T::ZERO, |s, i| s + term(i));
        total = total + block;
    }
    total
}

/// out (+)= the column sums of `m`, rows of `out.len()` (`accumulate`:
/// added to `out`, else written over it), the rows in blocks. Compiled
/// for the CPU's widest vectors: the same operations at every width.
pub fn rows<T: Float>(out: &mut [T], m: &[T], accumulate: bool) {
    #[inline(always)]
    fn go<T: Float>(out: &mut [T], m: &[T], accumulate: bool) {
        let d = out.len();
        if !accumulate {
            out.fill(T::ZERO);
        }
        if d == 0 {
            return;
        }
        let mut block = vec![T::ZERO; d];
        for rows in m.chunks(BLOCK * d) {
            let mut r = rows.chunks_exact(d);
            // The block's first row starts its sums (no add to zero).
            if let Some(first) = r.next() {
                block.copy_from_slice(first);
            }
            for row in r {
                for (s, v) in block.iter_mut().zip(row) {
                    *s = *s + *v;
                }
            }
            for (o, s) in out.iter_mut().zip(&block) {
                *o = *o + *s;
            }
        }
    }
    super::dispatch!(|| go(out, m, accumulate))
}

/// n terms near 0.1, positive: summed one after another, every add
/// rounds the same way for long stretches (the worst case of an unblocked
/// sum).
#[cfg(test)]
pub fn drifting(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 * (1.0 + 1e-3 * ((i * 37 % 101) as f32 / 101.0)))
        .collect()
}

/// The bound on a sum of n terms in blocks of `block`, relative to the
/// sum of the terms' magnitudes: (block + n/block)·u.
#[cfg(test)]
pub fn blocked_bound(n: usize, block: usize) -> f64 {
    (block + n.div_ceil(block)) as f64 * f64::from(f32::EPSILON) / 2.0
}

/// The f32 sum `got` of [`drifting`]`(n)`: its error relative to the f64 sum.
#[cfg(test)]
pub fn drift(n: usize, got: f32) -> f64 {
    let want: f64 = drifting(n).iter().map(|&x| f64::from(x)).sum();
    (f64::from(got) - want).abs() / want
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(n: usize) -> f64 {
        blocked_bound(n, BLOCK)
    }

    /// 60,000 terms: within the blocked bound, where the same terms summed
    /// one after another are ten times past it (the bound can fail).
    #[test]
    fn long_sums_stay_within_a_blocked_bound() {
        let n = 60_000;
        let v = drifting(n);
        let in_order = drift(n, v.iter().fold(0.0, |s, x| s + x));
        assert!(in_order > 10.0 * bound(n), "in order: {in_order:e}");
        let blocked = drift(n, sum(n, |i| v[i]));
        assert!(blocked < bound(n), "sum: {blocked:e} > {:e}", bound(n));
        for d in [1, 3, 17] {
            // d columns of the same terms; every column's sum.
            let m: Vec<f32> = v.iter().flat_map(|&x| std::iter::repeat_n(x, d)).collect();
            let mut out = vec![0.0; d];
            rows(&mut out, &m, false);
            assert!(out.iter().all(|&s| s == out[0]), "columns differ");
            let got = drift(n, out[0]);
            assert!(got < bound(n), "rows, d = {d}: {got:e}");
        }
    }

    /// Accumulating adds each block's sums to what `out` held; an empty
    /// matrix sums to zero; every vector level gives the same bits (two
    /// blocks and a partial one).
    #[test]
    fn rows_accumulate_and_agree_at_every_level() {
        let m = crate::test_values(7, 9 * (2 * BLOCK + 5));
        let blocks: Vec<&[f32]> = m.chunks(9 * BLOCK).collect();
        let mut out = vec![1.0f32; 9];
        rows(&mut out, &m, true);
        let mut want = vec![1.0f32; 9];
        for block in &blocks {
            let mut s = vec![0.0f32; 9];
            rows(&mut s, block, false);
            for (w, s) in want.iter_mut().zip(&s) {
                *w += *s;
            }
        }
        assert_eq!(out, want);
        let mut empty = vec![2.0f32; 3];
        rows(&mut empty, &[], false);
        assert_eq!(empty, [0.0; 3]);
        crate::assert_same_at_every_level(
            "rows",
            || {
                let mut o = vec![0.0f32; 9];
                rows(&mut o, &m, false);
                o
            },
            |o| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        );
    }
}
