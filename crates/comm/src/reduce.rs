//! Shared arithmetic of the collectives: how reductions combine parts (the same
//! order on every backend, so every rank gets bit-identical results) and how a
//! first dimension is split into per-rank chunks.

use super::ReduceOp;
use crate::{Error, Result};
use candle_core::Tensor;

/// Sizes of `n` items split over `parts` ranks: `n / parts` each, plus one for
/// the first `n % parts` ranks (the split of the sharded classifier's classes).
///
/// ```
/// assert_eq!(shardnet_comm::chunk_sizes(10, 4), vec![3, 3, 2, 2]);
/// ```
pub fn chunk_sizes(n: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|r| n / parts + usize::from(r < n % parts))
        .collect()
}

/// Chunk `index` of [`chunk_sizes`]`(n, parts)` as a range of `0..n`: the
/// rows, classes or stages rank `index` of `parts` holds.
///
/// ```
/// assert_eq!(shardnet_comm::chunk_range(10, 4, 2), 6..8);
/// ```
pub fn chunk_range(n: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let (q, rem) = (n / parts, n % parts);
    let start = index * q + index.min(rem);
    start..start + q + usize::from(index < rem)
}

/// Rank `index`'s share of a buffer of `len` elements in rows of `unit`:
/// the elements of its rows [`chunk_range`]`(len / unit, parts, index)`
/// (what [`crate::Communicator::reduce_scatter_slices`] and
/// [`crate::Communicator::allgather_slices`] give each rank).
///
/// ```
/// // 5 rows of 3 over 2 ranks: rows 0..3 and 3..5.
/// assert_eq!(shardnet_comm::row_share(15, 3, 2, 1), 9..15);
/// ```
pub fn row_share(len: usize, unit: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let rows = chunk_range(len / unit.max(1), parts, index);
    rows.start * unit..rows.end * unit
}

/// Offsets of the chunks of [`chunk_sizes`].
pub fn chunk_offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect()
}

/// `t` cut along dimension 0 into consecutive pieces of `sizes` rows (views).
pub fn split_rows(t: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
    sizes
        .iter()
        .zip(chunk_offsets(sizes))
        .map(|(s, o)| Ok(t.narrow(0, o, *s)?))
        .collect()
}

/// Reject reductions the dtype cannot do.
pub(crate) fn check_op(op_name: &str, t: &Tensor, op: ReduceOp) -> Result<()> {
    super::desc::dtype_code(t.dtype())?;
    if op == ReduceOp::Mean && !t.dtype().is_float() {
        return Err(Error::Usage(format!(
            "{op_name}: mean needs a float dtype, got {}",
            t.dtype().as_str()
        )));
    }
    Ok(())
}

/// Combine `parts` (one per rank, equal shapes) in rank order.
pub fn fold(parts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => acc.add(p)?,
            ReduceOp::Max => acc.maximum(p)?,
            ReduceOp::Min => acc.minimum(p)?,
        };
    }
    if parts.len() == 1 {
        // A fresh tensor: the result never aliases the caller's input.
        acc = acc.copy()?;
    }
    finish_mean(acc, op, parts.len())
}

/// Divide a sum by the number of ranks when the op is a mean.
pub(crate) fn finish_mean(t: Tensor, op: ReduceOp, n: usize) -> Result<Tensor> {
    if op == ReduceOp::Mean {
        Ok((t / n as f64)?)
    } else {
        Ok(t)
    }
}

/// A tensor that keeps its value whatever the caller does next: variables
/// (whose storage an optimizer updates in place) are copied, anything else is
/// immutable and shared. The autograd graph is never shared.
pub(crate) fn snapshot(t: &Tensor) -> Result<Tensor> {
    if t.is_variable() {
        let _staging = crate::heap::counting_as(crate::heap::Part::Communication);
        Ok(t.copy()?.detach())
    } else {
        Ok(t.detach())
    }
}

/// A sum over `n` ranks turned into their mean in place, as the copy
/// path's division does (candle's affine: times (1/n) as f32, plus 0).
pub(crate) fn sum_to_mean(v: &mut [f32], n: usize) {
    let scale = (1.0 / n as f64) as f32;
    v.iter_mut().for_each(|x| *x = *x * scale + 0.0);
}

/// `parts` (one length) combined: their element-wise sum in rank order
/// (with `mean_over: Some(n)`, then [`sum_to_mean`]), a block at a time,
/// each block read once from every rank and written once into every part
/// (`into: None`, an allreduce's share) or into `parts[k]` alone (`into:
/// Some(k)`, a reduce-scatter's). The sums are the same bits either way.
pub(crate) fn combine_into(
    parts: &mut [&mut [f32]],
    mean_over: Option<usize>,
    into: Option<usize>,
) {
    const BLOCK: usize = 2048;
    let len = parts.first().map_or(0, |p| p.len());
    let mut acc = [0f32; BLOCK];
    for start in (0..len).step_by(BLOCK) {
        let end = (start + BLOCK).min(len);
        let acc = &mut acc[..end - start];
        acc.copy_from_slice(&parts[0][start..end]);
        for p in &parts[1..] {
            acc.iter_mut()
                .zip(&p[start..end])
                .for_each(|(a, x)| *a += x);
        }
        if let Some(n) = mean_over {
            sum_to_mean(acc, n);
        }
        for (k, p) in parts.iter_mut().enumerate() {
            if into.is_none_or(|i| i == k) {
                p[start..end].copy_from_slice(acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_and_balance() {
        for n in 0..20 {
            for p in 1..6 {
                let s = chunk_sizes(n, p);
                assert_eq!(s.iter().sum::<usize>(), n);
                assert!(s.iter().max().unwrap() - s.iter().min().unwrap() <= 1);
                assert_eq!(chunk_offsets(&s)[p - 1] + s[p - 1], n);
            }
        }
    }
}
