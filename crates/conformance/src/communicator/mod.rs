//! The communicator suite's cases: point to point, every collective on
//! every dtype against its definition, objects, split, and the mismatches
//! and misuses that must be errors; with the dtypes carried and the inputs
//! every rank can build for every other ([`data`]).

mod misuse;
mod reductions;

use super::harness::{check, expect_eq};
use candle_core::{DType, Tensor};
use misuse::{
    mismatch_dtypes, mismatch_ops, mismatch_roots, mismatch_shapes, misuse_is_local_error,
};
use reductions::{allreduce, allreduce_slices, reduce_scatter_uneven, row_slices};
use shardnet::comm::{chunk_sizes, Communicator, ReduceOp};
use shardnet::Result;

/// The dtypes a communicator must carry.
pub const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::U8,
    DType::U32,
    DType::I64,
    DType::F64,
];

/// The most ranks the suite's expectations hold for (u8 sums stay below 256).
pub const MAX_RANKS: usize = 17;

/// A test body, run on every rank of a communicator.
pub type Body = fn(&Communicator) -> Result<()>;

/// One named test body.
pub type Case = (&'static str, Body);

/// Every case of the suite.
pub fn cases() -> Vec<Case> {
    vec![
        ("rank_and_size", rank_and_size),
        ("send_recv_ring", send_recv_ring),
        ("send_keeps_value_at_call", send_keeps_value_at_call),
        (
            "send_recv_sizes_around_packing",
            send_recv_sizes_around_packing,
        ),
        ("bcast", bcast),
        ("gather", gather),
        ("scatter", scatter),
        ("allgather_uneven", allgather_uneven),
        ("alltoall_uneven", alltoall_uneven),
        ("allreduce", allreduce),
        ("allreduce_slices", allreduce_slices),
        ("row_slices", row_slices),
        ("reduce_scatter_uneven", reduce_scatter_uneven),
        ("barrier", barrier),
        ("objects", objects),
        ("split", split),
        ("mismatch_shapes", mismatch_shapes),
        ("mismatch_ops", mismatch_ops),
        ("mismatch_dtypes", mismatch_dtypes),
        ("mismatch_roots", mismatch_roots),
        ("misuse_is_local_error", misuse_is_local_error),
    ]
}

/// Rank `rank`'s input: `rows` × `cols`, small integers, in `dtype`.
pub fn data(rank: usize, rows: usize, cols: usize, dtype: DType, salt: usize) -> Result<Tensor> {
    // u8: 0..=15, so that a sum over MAX_RANKS ranks is at most 255.
    let modulus = if dtype == DType::U8 { 16 } else { 97 };
    let signed = matches!(
        dtype,
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::I64
    );
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let x = ((rank * 1009 + i * 7 + salt * 31) % modulus) as f32;
            if signed {
                x - 48.0
            } else {
                x
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (rows, cols), &shardnet::comm::HOST)?.to_dtype(dtype)?)
}

fn rank_and_size(c: &Communicator) -> Result<()> {
    check(c.rank() < c.size(), || {
        format!("rank {} of {}", c.rank(), c.size())
    })?;
    check(c.intra_rank() < c.intra_size(), || {
        "intra rank out of range".into()
    })?;
    let ranks = c.allgather_obj(&c.rank())?;
    check(ranks == (0..c.size()).collect::<Vec<_>>(), || {
        format!("ranks {ranks:?}")
    })
}

fn send_recv_ring(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for (salt, dt) in DTYPES.iter().enumerate() {
        // Shapes differ per sender; the receiver learns them from the message.
        c.send(&data(r, r + 1, 3, *dt, salt)?, next)?;
        let got = c.recv(prev)?;
        expect_eq(
            &format!("recv {dt:?} from {prev}"),
            &got,
            &data(prev, prev + 1, 3, *dt, salt)?,
        )?;
    }
    // Several messages in flight between one pair arrive in order.
    if r == 0 {
        for k in 0..3 {
            c.send(&data(0, k, 2, DType::F32, k)?, 1)?;
        }
    } else if r == 1 {
        for k in 0..3 {
            expect_eq("ordered recv", &c.recv(0)?, &data(0, k, 2, DType::F32, k)?)?;
        }
    }
    Ok(())
}

/// Messages just below, at and above the size the MPI backend packs behind
/// its header (8 KiB − 128 bytes of payload), empty and large ones, every
/// dtype, several in flight between one pair: each arrives whole, in order.
fn send_recv_sizes_around_packing(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let packed = (8 << 10) - 128;
    let mut sizes = Vec::new();
    for (salt, dt) in DTYPES.iter().enumerate() {
        let at = packed / dt.size_in_bytes();
        for (k, rows) in [0, 1, at - 1, at, at + 1, 3 * at].into_iter().enumerate() {
            sizes.push((rows, *dt, salt * 8 + k));
        }
    }
    if c.rank() == 0 {
        for (rows, dt, salt) in &sizes {
            c.send(&data(0, *rows, 1, *dt, *salt)?, 1)?;
        }
    } else if c.rank() == 1 {
        for (rows, dt, salt) in &sizes {
            expect_eq(
                &format!("recv of {rows} {dt:?}"),
                &c.recv(0)?,
                &data(0, *rows, 1, *dt, *salt)?,
            )?;
        }
    }
    Ok(())
}

fn send_keeps_value_at_call(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    if c.rank() == 0 {
        let v = candle_core::Var::from_tensor(&data(0, 2, 2, DType::F32, 0)?)?;
        c.send(v.as_tensor(), 1)?;
        v.set(&data(0, 2, 2, DType::F32, 1)?)?;
        c.barrier()?;
    } else {
        c.barrier()?;
        if c.rank() == 1 {
            expect_eq("value at send", &c.recv(0)?, &data(0, 2, 2, DType::F32, 0)?)?;
        }
    }
    Ok(())
}

fn bcast(c: &Communicator) -> Result<()> {
    let n = c.size();
    for root in [n - 1, 0] {
        for (salt, dt) in DTYPES.iter().enumerate() {
            let want = data(root, 3, 5, *dt, salt)?;
            let mine = (c.rank() == root).then_some(&want);
            expect_eq(
                &format!("bcast {dt:?} root {root}"),
                &c.bcast(mine, root)?,
                &want,
            )?;
        }
        // A receiving rank may pass a tensor of the right shape.
        let want = data(root, 2, 2, DType::F32, 9)?;
        let mine = if c.rank() == root {
            want.clone()
        } else {
            want.zeros_like()?
        };
        expect_eq("bcast into", &c.bcast(Some(&mine), root)?, &want)?;
    }
    Ok(())
}

fn gather(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let root = n / 2;
    for (salt, dt) in DTYPES.iter().enumerate() {
        let got = c.gather(&data(r, r + 1, 2, *dt, salt)?, root)?;
        match got {
            Some(parts) => {
                check(r == root && parts.len() == n, || {
                    format!("gather gave {} parts on rank {r}", parts.len())
                })?;
                for (s, p) in parts.iter().enumerate() {
                    expect_eq(
                        &format!("gather {dt:?} part {s}"),
                        p,
                        &data(s, s + 1, 2, *dt, salt)?,
                    )?;
                }
            }
            None => check(r != root, || "root got nothing".into())?,
        }
    }
    Ok(())
}

fn scatter(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let root = n - 1;
    for (salt, dt) in DTYPES.iter().enumerate() {
        let parts = (0..n)
            .map(|d| data(d, d + 2, 3, *dt, salt))
            .collect::<Result<Vec<_>>>()?;
        let got = c.scatter((r == root).then_some(&parts[..]), root)?;
        expect_eq(&format!("scatter {dt:?}"), &got, &parts[r])?;
    }
    // Pieces of one tensor (the zero-copy path under MPI).
    let whole = data(root, 2 * n + 1, 2, DType::F32, 3)?;
    let sizes = chunk_sizes(2 * n + 1, n);
    let pieces = (0..n)
        .map(|d| whole.narrow(0, sizes[..d].iter().sum(), sizes[d]))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let got = c.scatter((r == root).then_some(&pieces[..]), root)?;
    expect_eq("scatter pieces", &got, &pieces[r])
}

fn allgather_uneven(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    for (salt, dt) in DTYPES.iter().enumerate() {
        // Rank 0 contributes no rows at all.
        let (got, counts) = c.allgather_counts(&data(r, r, 4, *dt, salt)?)?;
        let want = (0..n)
            .map(|s| data(s, s, 4, *dt, salt))
            .collect::<Result<Vec<_>>>()?;
        expect_eq(&format!("allgather {dt:?}"), &got, &Tensor::cat(&want, 0)?)?;
        check(counts == (0..n).collect::<Vec<_>>(), || {
            format!("counts {counts:?}")
        })?;
    }
    // Higher-rank tensors keep their trailing dimensions.
    let x = data(r, 2, 6, DType::F32, 1)?.reshape((2, 2, 3))?;
    let want = (0..n)
        .map(|s| Ok(data(s, 2, 6, DType::F32, 1)?.reshape((2, 2, 3))?))
        .collect::<Result<Vec<_>>>()?;
    expect_eq("allgather 3-d", &c.allgather(&x)?, &Tensor::cat(&want, 0)?)
}

fn alltoall_uneven(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    for (salt, dt) in DTYPES.iter().enumerate() {
        let mine = (0..n)
            .map(|d| data(r * n + d, (r + d) % 3, 2, *dt, salt))
            .collect::<Result<Vec<_>>>()?;
        let got = c.alltoall(&mine)?;
        check(got.len() == n, || {
            format!("alltoall gave {} tensors", got.len())
        })?;
        for (s, g) in got.iter().enumerate() {
            expect_eq(
                &format!("alltoall {dt:?} from {s}"),
                g,
                &data(s * n + r, (s + r) % 3, 2, *dt, salt)?,
            )?;
        }
    }
    // Pieces of one tensor (the zero-copy path under MPI).
    let whole = data(r, 2 * n, 3, DType::F32, 5)?;
    let pieces = whole.chunk(n, 0)?;
    let got = c.alltoall(&pieces)?;
    for (s, g) in got.iter().enumerate() {
        expect_eq(
            "alltoall pieces",
            g,
            &data(s, 2 * n, 3, DType::F32, 5)?.narrow(0, 2 * r, 2)?,
        )?;
    }
    Ok(())
}

fn barrier(c: &Communicator) -> Result<()> {
    for _ in 0..3 {
        c.barrier()?;
    }
    Ok(())
}

fn objects(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let root = n - 1;
    let seed: u64 = c.bcast_obj((r == root).then_some(&1234u64), root)?;
    check(seed == 1234, || format!("bcast_obj gave {seed}"))?;
    let names = c.allgather_obj(&format!("rank{r}"))?;
    check(
        names == (0..n).map(|s| format!("rank{s}")).collect::<Vec<_>>(),
        || format!("allgather_obj {names:?}"),
    )?;
    let g = c.gather_obj(&vec![r; r], 0)?;
    if r == 0 {
        check(g == Some((0..n).map(|s| vec![s; s]).collect()), || {
            format!("gather_obj {g:?}")
        })?;
    }
    let total = c.allreduce_obj(&(r as u64 + 1), |a, b| a + b)?;
    check(total == (n * (n + 1) / 2) as u64, || {
        format!("allreduce_obj {total}")
    })?;
    if n > 1 {
        if r == 0 {
            c.send_obj(&(7u32, "batch".to_string()), 1)?;
        } else if r == 1 {
            let v: (u32, String) = c.recv_obj(0)?;
            check(v == (7, "batch".into()), || format!("recv_obj {v:?}"))?;
        }
    }
    Ok(())
}

fn split(c: &Communicator) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    // Two colours, ordered by descending rank; with 3+ ranks the last joins none.
    let color = if n >= 3 && r == n - 1 {
        None
    } else {
        Some((r % 2) as u32)
    };
    let sub = c.split(color, -(r as i64))?;
    let Some(sub) = sub else {
        check(color.is_none(), || "split returned no communicator".into())?;
        return c.barrier();
    };
    let members: Vec<usize> = (0..n)
        .filter(|s| !(n >= 3 && *s == n - 1) && s % 2 == r % 2)
        .rev()
        .collect();
    check(sub.size() == members.len(), || {
        format!("sub size {} want {}", sub.size(), members.len())
    })?;
    check(members[sub.rank()] == r, || {
        format!("sub rank {}", sub.rank())
    })?;
    check(sub.world_ranks() == members, || {
        format!("world ranks {:?}", sub.world_ranks())
    })?;
    let x = Tensor::new(&[r as f32], &shardnet::comm::HOST)?;
    let s = sub.allreduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
    check(s == members.iter().sum::<usize>() as f32, || {
        format!("sub allreduce {s}")
    })?;
    // The parent still works after the split.
    c.barrier()
}
