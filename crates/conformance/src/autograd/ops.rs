//! Each collective as a case: who has input rows, how the op is applied
//! along a dimension, and its one-device definition; checked by finite
//! differences and in a small network against one device.

use super::common::{check_fd, close, fail, grad_of, seeded, tape_is_empty, var, weighted};
use super::common::{COLS, IN, NET_TOL};
use candle_core::{DType, Tensor, Var};
use shardnet::comm::{chunk_sizes, ReduceOp};
use shardnet::functions as f;
use shardnet::functions::Context;
use shardnet::Result;

/// A collective under test: who has input rows, how to apply it, and its
/// one-device definition.
#[derive(Clone)]
pub(super) struct OpCase {
    pub(super) name: &'static str,
    pub(super) replicated: bool,
    /// Rows of rank r's input among n ranks; `None`: no input.
    pub(super) rows: fn(usize, usize) -> Option<usize>,
    /// The op along the dimension given (ops without one ignore it).
    pub(super) apply: fn(&Context, Option<&Tensor>, usize) -> Result<Tensor>,
    /// The dimension the op runs along: the (rows, cols) inputs are moved so
    /// that their rows lie along it (0: as they are; 1: transposed; 2:
    /// transposed under a leading axis of 1), and the output moved back, so
    /// the one-device reference along rows holds for every `dim`.
    pub(super) dim: usize,
    /// Every rank's output, from every rank's input, on one device.
    pub(super) reference: fn(&[Option<Tensor>]) -> Result<Vec<Tensor>>,
}

/// Run the case's op along its `dim` on (rows, cols) `x` (see [`OpCase::dim`]).
fn apply(case: &OpCase, c: &Context, x: Option<&Tensor>) -> Result<Tensor> {
    let to = |t: &Tensor| -> Result<Tensor> {
        Ok(match case.dim {
            0 => t.clone(),
            1 => t.t()?.contiguous()?,
            _ => t.t()?.contiguous()?.unsqueeze(0)?,
        })
    };
    let y = (case.apply)(c, x.map(to).transpose()?.as_ref(), case.dim)?;
    Ok(match case.dim {
        0 => y,
        1 => y.t()?,
        _ => y.squeeze(0)?.t()?,
    })
}

fn need(x: Option<&Tensor>) -> Result<&Tensor> {
    x.ok_or_else(|| fail("this rank should have an input".into()))
}

fn inputs(xs: &[Option<Tensor>]) -> Vec<Tensor> {
    xs.iter().flatten().cloned().collect()
}

fn sum_all(xs: &[Option<Tensor>]) -> Result<Tensor> {
    let all = inputs(xs);
    let mut acc = all[0].clone();
    for t in &all[1..] {
        acc = acc.add(t)?;
    }
    Ok(acc)
}

fn same_for_all(y: Tensor, n: usize) -> Vec<Tensor> {
    vec![y; n]
}

fn chunks(y: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let mut at = 0;
    chunk_sizes(y.dims()[0], n)
        .into_iter()
        .map(|k| {
            at += k;
            Ok(y.narrow(0, at - k, k)?)
        })
        .collect()
}

fn uneven(r: usize) -> usize {
    [2, 0, 3, 1][r % 4]
}

/// Rows rank s sends to rank d in the alltoall case (some are 0).
fn a2a_count(s: usize, d: usize) -> usize {
    (s + 2 * d) % 3
}

pub(super) fn ops() -> Vec<OpCase> {
    fn gathered(xs: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        Ok(same_for_all(Tensor::cat(&inputs(xs), 0)?, xs.len()))
    }
    fn summed(xs: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        Ok(same_for_all(sum_all(xs)?, xs.len()))
    }
    fn averaged(xs: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        Ok(same_for_all((sum_all(xs)? / xs.len() as f64)?, xs.len()))
    }
    fn from_root(xs: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        Ok(same_for_all(inputs(xs)[0].clone(), xs.len()))
    }
    fn last_root(r: usize, n: usize) -> Option<usize> {
        (r == n - 1).then_some(3)
    }
    vec![
        OpCase {
            dim: 0,
            name: "allgather_even",
            replicated: false,
            rows: |_, _| Some(2),
            apply: |c, x, d| f::allgather(c, need(x)?, d),
            reference: gathered,
        },
        OpCase {
            dim: 0,
            name: "allgather_uneven",
            replicated: false,
            rows: |r, _| Some(uneven(r)),
            apply: |c, x, d| f::allgather(c, need(x)?, d),
            reference: gathered,
        },
        OpCase {
            dim: 0,
            name: "allgather_replicated",
            replicated: true,
            rows: |r, _| Some(uneven(r)),
            apply: |c, x, d| f::allgather_replicated(c, need(x)?, d),
            reference: gathered,
        },
        OpCase {
            dim: 0,
            name: "allreduce_sum",
            replicated: false,
            rows: |_, _| Some(2),
            apply: |c, x, _| f::allreduce(c, need(x)?, ReduceOp::Sum),
            reference: summed,
        },
        OpCase {
            dim: 0,
            name: "allreduce_mean",
            replicated: false,
            rows: |_, _| Some(2),
            apply: |c, x, _| f::allreduce(c, need(x)?, ReduceOp::Mean),
            reference: averaged,
        },
        OpCase {
            dim: 0,
            name: "allreduce_replicated_sum",
            replicated: true,
            rows: |_, _| Some(2),
            apply: |c, x, _| f::allreduce_replicated(c, need(x)?, ReduceOp::Sum),
            reference: summed,
        },
        OpCase {
            dim: 0,
            name: "allreduce_replicated_mean",
            replicated: true,
            rows: |_, _| Some(2),
            apply: |c, x, _| f::allreduce_replicated(c, need(x)?, ReduceOp::Mean),
            reference: averaged,
        },
        OpCase {
            dim: 0,
            name: "reduce_scatter_sum",
            replicated: false,
            rows: |_, _| Some(5),
            apply: |c, x, d| f::reduce_scatter(c, need(x)?, ReduceOp::Sum, d),
            reference: |xs| chunks(&sum_all(xs)?, xs.len()),
        },
        OpCase {
            dim: 0,
            name: "reduce_scatter_mean",
            replicated: false,
            rows: |_, _| Some(5),
            apply: |c, x, d| f::reduce_scatter(c, need(x)?, ReduceOp::Mean, d),
            reference: |xs| chunks(&(sum_all(xs)? / xs.len() as f64)?, xs.len()),
        },
        OpCase {
            dim: 0,
            name: "bcast",
            replicated: false,
            rows: last_root,
            apply: |c, x, _| f::bcast(c, x, c.size() - 1),
            reference: from_root,
        },
        OpCase {
            dim: 0,
            name: "bcast_replicated",
            replicated: true,
            rows: last_root,
            apply: |c, x, _| f::bcast_replicated(c, x, c.size() - 1),
            reference: from_root,
        },
        OpCase {
            dim: 0,
            name: "gather",
            replicated: false,
            rows: |r, _| Some(uneven(r + 1)),
            apply: |c, x, d| f::gather(c, need(x)?, c.size() / 2, d),
            reference: |xs| {
                let n = xs.len();
                let empty = Tensor::zeros((0, COLS), inputs(xs)[0].dtype(), &shardnet::comm::HOST)?;
                let mut ys = same_for_all(empty, n);
                ys[n / 2] = Tensor::cat(&inputs(xs), 0)?;
                Ok(ys)
            },
        },
        OpCase {
            dim: 0,
            name: "scatter",
            replicated: false,
            rows: |r, n| (r == (n - 1) / 2).then_some(5),
            apply: |c, x, d| f::scatter(c, x, (c.size() - 1) / 2, d),
            reference: |xs| chunks(&inputs(xs)[0], xs.len()),
        },
        OpCase {
            dim: 0,
            name: "alltoall",
            replicated: false,
            rows: |r, n| Some((0..n).map(|d| a2a_count(r, d)).sum()),
            apply: |c, x, dim| {
                let counts: Vec<usize> = (0..c.size()).map(|d| a2a_count(c.rank(), d)).collect();
                f::alltoall(c, need(x)?, &counts, dim)
            },
            reference: |xs| {
                let n = xs.len();
                let mut offsets = vec![0; n];
                (0..n)
                    .map(|d| {
                        let mut pieces = Vec::new();
                        for (s, x) in xs.iter().enumerate() {
                            let k = a2a_count(s, d);
                            pieces.push(need(x.as_ref())?.narrow(0, offsets[s], k)?);
                            offsets[s] += k;
                        }
                        Ok(Tensor::cat(&pieces, 0)?)
                    })
                    .collect()
            },
        },
    ]
}

/// Loss weights: one seed for every rank when the loss is replicated.
fn loss_seed(case: &OpCase, rank: usize) -> u64 {
    if case.replicated {
        7
    } else {
        100 + rank as u64
    }
}

pub(super) fn op_fd(c: &Context, case: &OpCase) -> Result<()> {
    let n = c.size();
    let shapes = |s: usize| {
        (case.rows)(s, n)
            .map(|k| vec![k, COLS])
            .into_iter()
            .collect()
    };
    let loss = |c: &Context, p: &[Tensor]| {
        let y = apply(case, c, p.first())?;
        weighted(&y, loss_seed(case, c.rank()))
    };
    check_fd(c, &shapes, case.replicated, &loss)
}

/// Rank s's data, its parameter before the op (when it has input) and its
/// parameter after the op: h = x·W → op → loss = sum(tanh(y ⊙ u) ⊙ w).
struct Stage {
    x: Option<Tensor>,
    w: Option<Var>,
    u: Var,
}

fn stage(case: &OpCase, s: usize, n: usize) -> Result<Stage> {
    let x = (case.rows)(s, n)
        .map(|k| seeded(200 + s as u64, &[k, IN], DType::F32))
        .transpose()?;
    let w = x
        .as_ref()
        .map(|_| var(300 + s as u64, &[IN, COLS], DType::F32))
        .transpose()?;
    let u = var(loss_seed(case, s) + 400, &[COLS], DType::F32)?;
    Ok(Stage { x, w, u })
}

fn before(st: &Stage) -> Result<Option<Tensor>> {
    match (&st.x, &st.w) {
        (Some(x), Some(w)) => Ok(Some(x.matmul(w.as_tensor())?)),
        _ => Ok(None),
    }
}

fn after(y: &Tensor, u: &Var, seed: u64) -> Result<Tensor> {
    weighted(&y.broadcast_mul(u.as_tensor())?, seed)
}

pub(super) fn op_network(c: &Context, case: &OpCase) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    // Distributed.
    let me = stage(case, r, n)?;
    let y = apply(case, c, before(&me)?.as_ref())?;
    let loss = after(&y, &me.u, loss_seed(case, r))?;
    let grads = loss.backward()?;
    tape_is_empty(c)?;

    // The same network on one device.
    let all: Vec<Stage> = (0..n).map(|s| stage(case, s, n)).collect::<Result<_>>()?;
    let hs: Vec<Option<Tensor>> = all.iter().map(before).collect::<Result<_>>()?;
    let ys = (case.reference)(&hs)?;
    let losses: Vec<Tensor> = (0..n)
        .map(|s| after(&ys[s], &all[s].u, loss_seed(case, s)))
        .collect::<Result<_>>()?;
    let total = if case.replicated {
        // One loss, computed once; each rank's u is a replica of the same value.
        losses[0].clone()
    } else {
        Tensor::stack(&losses, 0)?.sum_all()?
    };
    let want = total.backward()?;
    close(&format!("rank {r} loss"), &loss, &losses[r], NET_TOL)?;
    let mine = &all[r];
    let u_want = if case.replicated {
        // The one-device u gets the gradient of the one loss through rank 0's copy.
        grad_of(&want, &all[0].u)?
    } else {
        grad_of(&want, &mine.u)?
    };
    close(
        &format!("rank {r} dL/du"),
        &grad_of(&grads, &me.u)?,
        &u_want,
        NET_TOL,
    )?;
    if let (Some(w), Some(w_ref)) = (&me.w, &mine.w) {
        close(
            &format!("rank {r} dL/dW"),
            &grad_of(&grads, w)?,
            &grad_of(&want, w_ref)?,
            NET_TOL,
        )?;
    }
    Ok(())
}
