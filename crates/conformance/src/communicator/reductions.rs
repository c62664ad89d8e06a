//! The reductions against their definition (every rank's tensor combined
//! in f64, then cast): allreduce, its in-place forms on slices and rows,
//! reduce-scatter over uneven parts.

use super::super::harness::{check, expect_eq};
use super::misuse::expect_mismatch;
use super::{data, DTYPES, MAX_RANKS};
use candle_core::{DType, Tensor};
use shardnet::comm::{chunk_sizes, Communicator, ReduceOp};
use shardnet::Result;

/// The definition: combine every rank's tensor in f64, then cast.
fn reference(parts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let dt = parts[0].dtype();
    let f = parts
        .iter()
        .map(|p| p.to_dtype(DType::F64))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut acc = f[0].clone();
    for p in &f[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => (acc + p)?,
            ReduceOp::Max => acc.maximum(p)?,
            ReduceOp::Min => acc.minimum(p)?,
        };
    }
    if op == ReduceOp::Mean {
        acc = (acc / parts.len() as f64)?;
    }
    Ok(acc.to_dtype(dt)?)
}

/// A u8 sum over more than [`MAX_RANKS`] ranks may not fit in u8: such a
/// case has no definition and is left out.
fn u8_sum_overflows(dt: DType, op: ReduceOp, n: usize) -> bool {
    dt == DType::U8 && op == ReduceOp::Sum && n > MAX_RANKS
}

pub(super) fn allreduce(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    for (salt, dt) in DTYPES.iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean] {
            if u8_sum_overflows(*dt, op, n) {
                continue;
            }
            if op == ReduceOp::Mean && !dt.is_float() {
                check(c.allreduce(&data(r, 1, 1, *dt, 0)?, op).is_err(), || {
                    "integer mean accepted".into()
                })?;
                continue;
            }
            let parts = (0..n)
                .map(|s| data(s, 5, 3, *dt, salt))
                .collect::<Result<Vec<_>>>()?;
            let got = c.allreduce(&parts[r], op)?;
            expect_eq(
                &format!("allreduce {} {dt:?}", op.name()),
                &got,
                &reference(&parts, op)?,
            )?;
        }
    }
    Ok(())
}

/// Buffers reduced in place (the local backend's zero-copy path, the copy
/// path elsewhere) equal, bit for bit, each buffer allreduced alone: sizes
/// 0, 1, under and over the ranks, uneven shares; values in 1/64 steps
/// (exact sums, whatever order MPI's algorithm adds them in); then totals,
/// or one total split differently, that differ across the ranks fail on
/// every rank.
pub(super) fn allreduce_slices(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let lens = [1, 0, 2 * n + 1, 3 * n - 1, 1000];
    let value = |rank: usize, b: usize, i: usize| {
        let x = (rank * 7919 + b * 104_729 + i * 31) % 1013;
        (x as f32 - 506.0) / 64.0
    };
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        let mut bufs: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(b, &l)| (0..l).map(|i| value(r, b, i)).collect())
            .collect();
        let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        c.allreduce_slices(&mut views, op)?;
        for (b, got) in bufs.iter().enumerate() {
            let mine: Vec<f32> = (0..lens[b]).map(|i| value(r, b, i)).collect();
            let want = c.allreduce(&Tensor::from_vec(mine, lens[b], c.device())?, op)?;
            let got = Tensor::from_vec(got.clone(), lens[b], c.device())?;
            expect_eq(
                &format!("allreduce_slices {} buffer {b}", op.name()),
                &got,
                &want,
            )?;
        }
    }
    // No buffers at all: nothing to do, on every backend.
    c.allreduce_slices(&mut [], ReduceOp::Sum)?;
    if n > 1 {
        let mut buf = vec![1f32; 3 + usize::from(r == 0)];
        let res = c.allreduce_slices(&mut [&mut buf[..]], ReduceOp::Sum);
        expect_mismatch(c, "allreduce_slices totals", res)?;
        // The same total, split differently on rank 0.
        let (a, b) = if r == 0 { (3, 4) } else { (4, 3) };
        let (mut x, mut y) = (vec![1f32; a], vec![1f32; b]);
        let res = c.allreduce_slices(&mut [&mut x[..], &mut y[..]], ReduceOp::Sum);
        expect_mismatch(c, "allreduce_slices lengths", res)?;
    }
    Ok(())
}

/// `reduce_scatter_slices` leaves in each rank's rows of every buffer
/// (rows of 1 to 3 values, fewer rows than ranks too) what
/// `allreduce_slices` gives there, bit for bit; `allgather_slices` then
/// gives every rank every rank's rows. Units that do not divide a buffer,
/// and buffers split differently across the ranks, are errors on every rank.
pub(super) fn row_slices(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let shapes = [
        (1, 1),
        (0, 2),
        (2 * n + 1, 3),
        (3 * n - 1, 1),
        (n.max(2) - 1, 2),
        (333, 3),
    ];
    let value = |rank: usize, b: usize, i: usize| {
        let x = (rank * 7919 + b * 104_729 + i * 31) % 1013;
        (x as f32 - 506.0) / 64.0
    };
    let units: Vec<usize> = shapes.iter().map(|s| s.1).collect();
    let fresh = |rank: usize| -> Vec<Vec<f32>> {
        shapes
            .iter()
            .enumerate()
            .map(|(b, &(rows, unit))| (0..rows * unit).map(|i| value(rank, b, i)).collect())
            .collect()
    };
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let mut want = fresh(r);
        let mut views: Vec<&mut [f32]> = want.iter_mut().map(|b| &mut b[..]).collect();
        c.allreduce_slices(&mut views, op)?;
        let mut got = fresh(r);
        let mut views: Vec<&mut [f32]> = got.iter_mut().map(|b| &mut b[..]).collect();
        c.reduce_scatter_slices(&mut views, &units, op)?;
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            let share = shardnet::comm::row_share(g.len(), units[b], n, r);
            let same = g[share.clone()]
                .iter()
                .zip(&w[share.clone()])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            check(same, || {
                format!("reduce_scatter_slices {} buffer {b}: rows {share:?} differ from allreduce_slices", op.name())
            })?;
        }
        // Every rank's own rows out to all: the allreduce's whole result.
        let mut views: Vec<&mut [f32]> = got.iter_mut().map(|b| &mut b[..]).collect();
        c.allgather_slices(&mut views, &units)?;
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            check(
                g.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()),
                || {
                    format!("allgather_slices after reduce_scatter_slices {} buffer {b}: differs from allreduce_slices", op.name())
                },
            )?;
        }
    }
    // A unit that does not divide its buffer: refused before any exchange.
    let mut odd = [0f32; 5];
    let res = c.allgather_slices(&mut [&mut odd[..]], &[2]);
    check(
        res.as_ref()
            .is_err_and(|e| e.to_string().contains("not a whole number of rows of 2")),
        || format!("allgather_slices with rows of 2 over 5 values: {res:?}"),
    )?;
    if n > 1 {
        // The same lengths, rows of another length on rank 0.
        let mut x = [1f32; 6];
        let unit = if r == 0 { 2 } else { 3 };
        let res = c.allgather_slices(&mut [&mut x[..]], &[unit]);
        expect_mismatch(c, "allgather_slices rows", res)?;
        let res = c.reduce_scatter_slices(&mut [&mut x[..]], &[unit], ReduceOp::Sum);
        expect_mismatch(c, "reduce_scatter_slices rows", res)?;
    }
    Ok(())
}

pub(super) fn reduce_scatter_uneven(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let rows = 2 * n + 1;
    let sizes = chunk_sizes(rows, n);
    let start: usize = sizes[..r].iter().sum();
    for (salt, dt) in DTYPES.iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            if u8_sum_overflows(*dt, op, n) {
                continue;
            }
            let parts = (0..n)
                .map(|s| data(s, rows, 3, *dt, salt))
                .collect::<Result<Vec<_>>>()?;
            let got = c.reduce_scatter(&parts[r], op)?;
            let want = reference(&parts, op)?.narrow(0, start, sizes[r])?;
            expect_eq(&format!("reduce_scatter {} {dt:?}", op.name()), &got, &want)?;
        }
    }
    Ok(())
}
