//! The cases beyond one collective: the send/recv ring pipeline, the
//! backward order the tape keeps, ranks without parameters, the designed-out
//! failures, and the unconsumed delegate that must be an error.

use super::common::{check_fd, close, fail, grad_of, seeded, tape_is_empty, var, weighted};
use super::common::{COLS, IN, NET_TOL};
use crate::expect_eq;
use candle_core::{DType, Tensor, Var};
use shardnet::comm::ReduceOp;
use shardnet::functions as f;
use shardnet::functions::Context;
use shardnet::{Error, Result};

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

pub(super) fn ring_fd(c: &Context) -> Result<()> {
    let shapes = |_| vec![vec![COLS, COLS]];
    check_fd(c, &shapes, false, &|c, p| ring_loss(c, &p[0]))
}

pub(super) fn ring_network(c: &Context) -> Result<()> {
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
pub(super) fn order_mirrors(c: &Context) -> Result<()> {
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
pub(super) fn no_parameters(c: &Context) -> Result<()> {
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
pub(super) fn forms_differ(c: &Context) -> Result<()> {
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
pub(super) fn integers_plain(c: &Context) -> Result<()> {
    let x = Tensor::new(&[c.rank() as u32, 1], &shardnet::comm::HOST)?;
    let y = f::allgather(c, &x, 0)?;
    let want = Tensor::new(
        (0..c.size())
            .flat_map(|s| [s as u32, 1])
            .collect::<Vec<_>>(),
        &shardnet::comm::HOST,
    )?;
    expect_eq("allgather u32", &y, &want)?;
    tape_is_empty(c)
}

/// max/min reductions have no gradient here: refused before communicating.
pub(super) fn max_refused(c: &Context) -> Result<()> {
    let x = Tensor::ones(2, DType::F32, &shardnet::comm::HOST)?;
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
