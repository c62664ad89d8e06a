//! The differentiable-communication suite: every op of [`crate::functions`]
//! against finite differences and against the same network on one device.
//!
//! Runs on the local backend (`tests/functions.rs`, 1–4 thread ranks) and
//! under MPI (`shardnet selftest`, driven by `tests/mpi.rs`). Every rank
//! builds every rank's data and parameters from seeds, so it can compute the
//! one-device reference on its own.
//!
//! - **Finite differences** (f64): the global loss is the sum of the ranks'
//!   losses (or, for `_replicated` ops, the one loss every rank computes).
//!   Each input element of each rank is moved by ±h = 1e-5 on its rank only,
//!   all ranks recompute, and the central difference must match the analytic
//!   gradient: |a − fd| ≤ 1e-6 · max(1, |fd|). On more than 4 ranks every
//!   rank moves all its elements at once along 3 seeded directions v, and
//!   Σ_ranks a·v must match the central difference along v.
//! - **One device** (f32): each rank's parameters before and after the op;
//!   the loss and every parameter gradient must match the one-device network
//!   with relative error ≤ 1e-5 (max |got − want| / max |want|).
//!
//! Ranks' losses differ (their weights are seeded by rank) except for the
//! `_replicated` forms, so a wrong backward for either form fails.

use super::expect_eq;
use crate::comm::{chunk_sizes, Communicator, ReduceOp};
use crate::functions as f;
use crate::functions::Context;
use crate::{Error, Result};
use candle_core::{DType, Tensor, Var};

/// One named body, run on every rank of a communicator.
pub type Case = (String, Box<dyn Fn(&Context) -> Result<()> + Send + Sync>);

/// A case body: one rank's part.
type Body = fn(&Context) -> Result<()>;

const COLS: usize = 3;
const IN: usize = 4;
const FD_H: f64 = 1e-5;
const FD_TOL: f64 = 1e-6;
/// Up to this many ranks, finite differences move one element at a time;
/// beyond, they check [`DIRECTIONS`] seeded directions (the cost of one
/// element at a time grows with the square of the rank count).
const PER_ELEMENT_RANKS: usize = 4;
const DIRECTIONS: usize = 3;
const NET_TOL: f64 = 1e-5;

/// Every case: each op under finite differences and in a network, and the
/// designed-out failures.
pub fn cases() -> Vec<Case> {
    let mut all: Vec<Case> = Vec::new();
    let along_dims = ops().into_iter().filter(|op| {
        [
            "allgather",
            "reduce_scatter",
            "gather",
            "scatter",
            "alltoall",
        ]
        .iter()
        .any(|p| op.name.starts_with(p))
    });
    let mut variants = ops();
    for d in [1, 2] {
        variants.extend(along_dims.clone().map(|op| OpCase { dim: d, ..op }));
    }
    for op in variants {
        let name = match op.dim {
            0 => op.name.to_string(),
            d => format!("{}_dim{d}", op.name),
        };
        let op2 = op.clone();
        all.push((
            format!("{name}_finite_differences"),
            Box::new(move |c| op_fd(c, &op)),
        ));
        all.push((
            format!("{name}_network_vs_one_device"),
            Box::new(move |c| op_network(c, &op2)),
        ));
    }
    let special: [(&str, Body); 7] = [
        ("send_recv_ring_finite_differences", ring_fd),
        ("send_recv_ring_network_vs_one_device", ring_network),
        ("backward_mirrors_forward_order", order_mirrors),
        ("backward_reaches_ops_without_parameters", no_parameters),
        ("replicated_form_is_wrong_for_distinct_losses", forms_differ),
        ("integer_tensors_pass_plainly", integers_plain),
        ("max_has_no_gradient", max_refused),
    ];
    for (name, body) in special {
        all.push((name.to_string(), Box::new(body)));
    }
    all
}

/// Run every case ([`super::Tally::run`]: the ranks agree on each outcome).
pub fn run_all(comm: &Communicator, tally: &mut super::Tally) -> Result<()> {
    for (name, body) in cases() {
        // A fresh tape per case: a failed case's pending ops stay behind.
        let cx = &Context::new(comm);
        tally.run(comm, &name, || body(cx).and_then(|_| tape_is_empty(cx)))?;
    }
    Ok(())
}

fn fail(what: String) -> Error {
    Error::Usage(format!("autograd conformance: {what}"))
}

fn tape_is_empty(c: &Context) -> Result<()> {
    match c.pending_backward() {
        0 => Ok(()),
        k => Err(fail(format!("{k} ops still wait for backward"))),
    }
}

/// Deterministic values in [-1, 1) from a seed.
pub(super) fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x2545_F491_4F6C_DD1D;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// A seeded tensor of `dims` (values in [−1, 1)), the inputs of every case.
pub fn seeded(seed: u64, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let n = dims.iter().product();
    Ok(Tensor::from_vec(values(seed, n), dims, &crate::comm::HOST)?.to_dtype(dtype)?)
}

fn var(seed: u64, dims: &[usize], dtype: DType) -> Result<Var> {
    Ok(Var::from_tensor(&seeded(seed, dims, dtype)?)?)
}

/// sum(tanh(y) ⊙ w), w seeded by `seed` and shaped like y.
pub(super) fn weighted(y: &Tensor, seed: u64) -> Result<Tensor> {
    let w = seeded(seed, y.dims(), y.dtype())?;
    Ok(y.tanh()?.mul(&w)?.sum_all()?)
}

/// max |got − want| / max |want| ≤ tol (both flattened; equal shapes).
pub(super) fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<()> {
    close_in(what, got, want, want, tol)
}

/// max |got − want| / max |of| ≤ tol: `want` judged against the scale of
/// `of` (the whole tensor a slice `want` was cut from, or `want` itself).
pub(super) fn close_in(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    of: &Tensor,
    tol: f64,
) -> Result<()> {
    if got.dims() != want.dims() {
        super::miss(format!(
            "{what}: shape {:?}, want {:?}",
            got.dims(),
            want.dims()
        ));
        return Ok(());
    }
    let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let o = of.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let scale = o.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    if !(err <= tol * scale.max(1e-30) || err <= 1e-30) {
        super::miss(format!(
            "{what}: relative error {:.2e} (max |want| {scale:.3e}), over {tol:e}",
            err / scale.max(1e-30)
        ));
    }
    Ok(())
}

fn grad_of(grads: &candle_core::backprop::GradStore, v: &Var) -> Result<Tensor> {
    match grads.get(v.as_tensor()) {
        Some(g) => Ok(g.clone()),
        None => Ok(v.as_tensor().zeros_like()?),
    }
}

/// Check every rank's analytic gradient of `loss` against central
/// differences of the global loss. `shapes(s)` are rank s's parameters.
fn check_fd(
    c: &Context,
    shapes: &dyn Fn(usize) -> Vec<Vec<usize>>,
    replicated: bool,
    loss: &dyn Fn(&Context, &[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let mine: Vec<Var> = shapes(r)
        .iter()
        .enumerate()
        .map(|(i, d)| var((r * 10 + i) as u64 + 1000, d, DType::F64))
        .collect::<Result<_>>()?;
    let params: Vec<Tensor> = mine.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = loss(c, &params)?.backward()?;
    tape_is_empty(c)?;
    let analytic: Vec<Vec<f64>> = mine
        .iter()
        .map(|v| Ok(grad_of(&grads, v)?.flatten_all()?.to_vec1::<f64>()?))
        .collect::<Result<_>>()?;

    let _plain = c.no_grad();
    let base: Vec<Tensor> = mine.iter().map(|v| v.as_tensor().detach()).collect();
    let global = |params: &[Tensor]| -> Result<f64> {
        let l = loss(c, params)?.reshape(1)?;
        let op = if replicated {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        Ok(c.allreduce(&l, op)?.to_vec1::<f64>()?[0])
    };
    if n > PER_ELEMENT_RANKS {
        // Directional derivatives: every rank moves all its elements at once
        // along a seeded direction v; d/dh L(θ + h·v) = Σ_ranks ∇L·v.
        for k in 0..DIRECTIONS {
            let dirs: Vec<Vec<f64>> = base
                .iter()
                .enumerate()
                .map(|(p, b)| values(7919 * (k as u64 + 1) + (r * 10 + p) as u64, b.elem_count()))
                .collect();
            let at = |delta: f64| -> Result<f64> {
                let moved = base
                    .iter()
                    .zip(&dirs)
                    .map(|(b, v)| {
                        let dv = Tensor::from_vec(v.clone(), b.dims(), &crate::comm::HOST)?;
                        Ok((b + (dv * delta)?)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                global(&moved)
            };
            let fd = (at(FD_H)? - at(-FD_H)?) / (2.0 * FD_H);
            let mine: f64 = analytic
                .iter()
                .zip(&dirs)
                .map(|(a, v)| a.iter().zip(v).map(|(a, v)| a * v).sum::<f64>())
                .sum();
            let a = c.allreduce_obj(&mine, |x, y| x + y)?;
            if !super::within((a - fd).abs(), FD_TOL * fd.abs().max(1.0)) {
                super::miss(format!(
                    "direction {k} (all ranks moved at once): gradient·v {a}, finite difference {fd}"
                ));
            }
        }
        return Ok(());
    }
    for s in 0..n {
        for (p, dims) in shapes(s).iter().enumerate() {
            for e in 0..dims.iter().product::<usize>() {
                let at = |delta: f64| -> Result<f64> {
                    if s != r {
                        return global(&base);
                    }
                    let mut moved = base.clone();
                    let mut v = base[p].flatten_all()?.to_vec1::<f64>()?;
                    v[e] += delta;
                    moved[p] = Tensor::from_vec(v, dims.as_slice(), &crate::comm::HOST)?;
                    global(&moved)
                };
                let fd = (at(FD_H)? - at(-FD_H)?) / (2.0 * FD_H);
                if s == r {
                    let a = analytic[p][e];
                    if !super::within((a - fd).abs(), FD_TOL * fd.abs().max(1.0)) {
                        super::miss(format!(
                            "rank {r}, parameter {p}, element {e}: gradient {a}, finite difference {fd}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// A collective under test: who has input rows, how to apply it, and its
/// one-device definition.
#[derive(Clone)]
struct OpCase {
    name: &'static str,
    replicated: bool,
    /// Rows of rank r's input among n ranks; `None`: no input.
    rows: fn(usize, usize) -> Option<usize>,
    /// The op along the dimension given (ops without one ignore it).
    apply: fn(&Context, Option<&Tensor>, usize) -> Result<Tensor>,
    /// The dimension the op runs along: the (rows, cols) inputs are moved so
    /// that their rows lie along it (0: as they are; 1: transposed; 2:
    /// transposed under a leading axis of 1), and the output moved back, so
    /// the one-device reference along rows holds for every `dim`.
    dim: usize,
    /// Every rank's output, from every rank's input, on one device.
    reference: fn(&[Option<Tensor>]) -> Result<Vec<Tensor>>,
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

fn ops() -> Vec<OpCase> {
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
                let empty = Tensor::zeros((0, COLS), inputs(xs)[0].dtype(), &crate::comm::HOST)?;
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

fn op_fd(c: &Context, case: &OpCase) -> Result<()> {
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

fn op_network(c: &Context, case: &OpCase) -> Result<()> {
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

/// The ring pipeline: rank 0 computes tanh(x·W_0) and sends it on; rank s
/// receives, computes tanh(h·W_s), adds its own term sum(h ⊙ q_s) to its loss
/// (joined to its send's delegate by `pseudo_connect`) and sends on; rank 0
/// receives the last stage's output (through the delegate of its send) and
/// computes sum(y ⊙ v). ChainerMN's MLP0/MLP1 is the two-rank case.
fn ring_loss(c: &Context, w: &Tensor) -> Result<Tensor> {
    let (r, n) = (c.rank(), c.size());
    let dt = w.dtype();
    if r == 0 {
        let x = seeded(500, &[2, COLS], dt)?;
        let h = x.matmul(w)?.tanh()?;
        if n == 1 {
            return weighted(&h, 501);
        }
        let phi = f::send(&h, c, 1)?;
        let y = f::recv(c, n - 1, Some(&phi))?;
        weighted(&y, 501)
    } else {
        let h = f::recv(c, r - 1, None)?;
        let h = h.matmul(w)?.tanh()?;
        let own = weighted(&h, 600 + r as u64)?;
        let phi = f::send(&h, c, (r + 1) % n)?;
        f::pseudo_connect(&phi, &own)
    }
}

fn ring_fd(c: &Context) -> Result<()> {
    let shapes = |_| vec![vec![COLS, COLS]];
    check_fd(c, &shapes, false, &|c, p| ring_loss(c, &p[0]))
}

fn ring_network(c: &Context) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let ws: Vec<Var> = (0..n)
        .map(|s| var(700 + s as u64, &[COLS, COLS], DType::F32))
        .collect::<Result<_>>()?;
    let loss = ring_loss(c, ws[r].as_tensor())?;
    let grads = loss.backward()?;
    tape_is_empty(c)?;

    let mut h = seeded(500, &[2, COLS], DType::F32)?
        .matmul(ws[0].as_tensor())?
        .tanh()?;
    let mut losses = vec![];
    for (s, w) in ws.iter().enumerate().skip(1) {
        h = h.matmul(w.as_tensor())?.tanh()?;
        losses.push(weighted(&h, 600 + s as u64)?);
    }
    losses.insert(0, weighted(&h, 501)?);
    let want = Tensor::stack(&losses, 0)?.sum_all()?.backward()?;
    close(&format!("rank {r} loss"), &loss, &losses[r], NET_TOL)?;
    close(
        &format!("rank {r} dL/dW"),
        &grad_of(&grads, &ws[r])?,
        &grad_of(&want, &ws[r])?,
        NET_TOL,
    )
}

/// Two allgathers of equal shapes; even ranks add their loss terms in one
/// order, odd ranks in the other, so candle's backward would visit the two
/// ops in different orders on different ranks. The tape keeps the mirrored
/// order; without it the ranks would exchange each other's gradients.
fn order_mirrors(c: &Context) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let x = |s: usize| seeded(800 + s as u64, &[2, IN], DType::F32);
    let params = |s: usize| -> Result<(Var, Var)> {
        Ok((
            var(810 + s as u64, &[IN, COLS], DType::F32)?,
            var(820 + s as u64, &[IN, COLS], DType::F32)?,
        ))
    };
    let terms = |a: &Tensor, b: &Tensor, s: usize| -> Result<(Tensor, Tensor)> {
        Ok((weighted(a, 830 + s as u64)?, weighted(b, 840 + s as u64)?))
    };
    let (wa, wb) = params(r)?;
    let a = f::allgather(c, &x(r)?.matmul(wa.as_tensor())?, 0)?;
    let b = f::allgather(c, &x(r)?.matmul(wb.as_tensor())?, 0)?;
    let (ta, tb) = terms(&a, &b, r)?;
    let loss = if r % 2 == 0 {
        ta.add(&tb)?
    } else {
        tb.add(&ta)?
    };
    let grads = loss.backward()?;
    tape_is_empty(c)?;

    let ps: Vec<(Var, Var)> = (0..n).map(params).collect::<Result<_>>()?;
    let gather = |pick: fn(&(Var, Var)) -> &Var| -> Result<Tensor> {
        let hs: Vec<Tensor> = (0..n)
            .map(|s| Ok(x(s)?.matmul(pick(&ps[s]).as_tensor())?))
            .collect::<Result<_>>()?;
        Ok(Tensor::cat(&hs, 0)?)
    };
    let (a1, b1) = (gather(|p| &p.0)?, gather(|p| &p.1)?);
    let mut total = Vec::new();
    for s in 0..n {
        let (ta, tb) = terms(&a1, &b1, s)?;
        total.push(ta.add(&tb)?);
    }
    let want = Tensor::stack(&total, 0)?.sum_all()?.backward()?;
    close(&format!("rank {r} loss"), &loss, &total[r], NET_TOL)?;
    close(
        "dL/dW_a",
        &grad_of(&grads, &wa)?,
        &grad_of(&want, &ps[r].0)?,
        NET_TOL,
    )?;
    close(
        "dL/dW_b",
        &grad_of(&grads, &wb)?,
        &grad_of(&want, &ps[r].1)?,
        NET_TOL,
    )
}

/// Only rank 0 has a parameter, before the allgather; the other ranks feed
/// plain data and have no parameter at all. Their backward must still run
/// the allgather's backward, or rank 0 would wait for it forever.
fn no_parameters(c: &Context) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let x = |s: usize| seeded(900 + s as u64, &[2, IN], DType::F32);
    let w = var(910, &[IN, IN], DType::F32)?;
    let h = if r == 0 {
        x(0)?.matmul(w.as_tensor())?
    } else {
        x(r)?
    };
    let loss = weighted(&f::allgather(c, &h, 0)?, 920 + r as u64)?;
    let grads = loss.backward()?;
    tape_is_empty(c)?;
    if r != 0 {
        return Ok(());
    }
    let mut hs = vec![x(0)?.matmul(w.as_tensor())?];
    for s in 1..n {
        hs.push(x(s)?);
    }
    let all = Tensor::cat(&hs, 0)?;
    let losses: Vec<Tensor> = (0..n)
        .map(|s| weighted(&all, 920 + s as u64))
        .collect::<Result<_>>()?;
    let want = Tensor::stack(&losses, 0)?.sum_all()?.backward()?;
    close(
        "dL/dW",
        &grad_of(&grads, &w)?,
        &grad_of(&want, &w)?,
        NET_TOL,
    )
}

/// With distinct losses, the replicated allgather's gradient is wrong: the
/// check that the suite can tell the two forms apart.
fn forms_differ(c: &Context) -> Result<()> {
    let r = c.rank();
    let x = Var::from_tensor(&seeded(950 + r as u64, &[2, COLS], DType::F64)?)?;
    let right = weighted(&f::allgather(c, x.as_tensor(), 0)?, 960 + r as u64)?.backward()?;
    let wrong = weighted(
        &f::allgather_replicated(c, x.as_tensor(), 0)?,
        960 + r as u64,
    )?
    .backward()?;
    let diff = (grad_of(&right, &x)? - grad_of(&wrong, &x)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?;
    let differs = c.allreduce_obj(&(diff > 1e-3), |a, b| a || b)?;
    if c.size() > 1 && !differs {
        return Err(fail(
            "allgather and allgather_replicated gave the same gradient for distinct losses".into(),
        ));
    }
    Ok(())
}

/// Integer tensors carry no gradient: communicated plainly, nothing recorded.
fn integers_plain(c: &Context) -> Result<()> {
    let x = Tensor::new(&[c.rank() as u32, 1], &crate::comm::HOST)?;
    let y = f::allgather(c, &x, 0)?;
    let want = Tensor::new(
        (0..c.size())
            .flat_map(|s| [s as u32, 1])
            .collect::<Vec<_>>(),
        &crate::comm::HOST,
    )?;
    expect_eq("allgather u32", &y, &want)?;
    tape_is_empty(c)
}

/// max/min reductions have no gradient here: refused before communicating.
fn max_refused(c: &Context) -> Result<()> {
    let x = Tensor::ones(2, DType::F32, &crate::comm::HOST)?;
    match f::allreduce(c, &x, ReduceOp::Max) {
        Err(Error::Usage(m)) if m.contains("no gradient") => Ok(()),
        other => Err(fail(format!("allreduce max gave {:?}", other.map(|_| ())))),
    }
}

/// A rank whose loss does not depend on its last send: backward must stop
/// with an error naming the send, and the peer must not hang (it gets the
/// error through the communicator). Run on two or more ranks; rank 1 errs.
pub fn unconsumed_delegate(c: &Context) -> Result<()> {
    let w = var(990, &[COLS, COLS], DType::F32)?;
    match c.rank() {
        0 => {
            let h = seeded(991, &[2, COLS], DType::F32)?.matmul(w.as_tensor())?;
            let phi = f::send(&h, c, 1)?;
            let y = f::recv(c, 1, Some(&phi))?;
            y.sum_all()?.backward()?;
        }
        1 => {
            let h = f::recv(c, 0, None)?;
            let _phi = f::send(&h.matmul(w.as_tensor())?, c, 0)?;
            // The mistake: backward from something that does not reach the send.
            h.sum_all()?.backward()?;
        }
        _ => {}
    }
    Ok(())
}
