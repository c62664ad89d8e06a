//! Differentiable point-to-point communication with delegate variables
//! (ChainerMN's `send`/`recv`): `send` returns a zero-size *delegate*; passing it on keeps the
//! send in the graph that backward walks.
//!
//! | op | forward | backward | bytes (x of b bytes) |
//! |----|---------|----------|----------------------|
//! | `send(x, ctx, dst)` | x → dst | dL/dx ← dst | b each way |
//! | `recv(ctx, src, delegate)` | y ← src | dL/dy → src | b each way |
//!
//! ChainerMN's two-rank model-parallel MLP, one-to-one:
//!
//! ```
//! use candle_core::{DType, Tensor, Var};
//! use shardnet::{functions::{recv, send, Context}, launch};
//!
//! let grads = launch(2, |comm| {
//!     let ctx = Context::new(&comm);
//!     let x = Tensor::ones((4, 3), DType::F32, ctx.device())?;
//!     if ctx.rank() == 0 {
//!         // MLP0: h0 = relu(l1(x)); phi = send(h0, rank 1); y = recv(rank 1, phi)
//!         let w1 = Var::ones((3, 5), DType::F32, ctx.device())?;
//!         let h0 = x.matmul(w1.as_tensor())?.relu()?;
//!         let phi = send(&h0, &ctx, 1)?;
//!         let y = recv(&ctx, 1, Some(&phi))?;
//!         let loss = y.sum_all()?;
//!         let grads = loss.backward()?;
//!         let g = grads.get(w1.as_tensor()).expect("w1 has a gradient");
//!         Ok(g.sum_all()?.to_scalar::<f32>()?)
//!     } else {
//!         // MLP1: h0 = recv(rank 0); return send(l3(relu(l2(h0))), rank 0)
//!         let w2 = Var::ones((5, 2), DType::F32, ctx.device())?;
//!         let h0 = recv(&ctx, 0, None)?;
//!         let phi = send(&h0.matmul(w2.as_tensor())?.relu()?, &ctx, 0)?;
//!         phi.backward()?;
//!         Ok(0.0)
//!     }
//! })?;
//! // dL/dw1 = x^T · (1 · w2^T) = 4 rows × 2 = 8 per element, 15 elements.
//! assert_eq!(grads[0], 120.0);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::tape::{backward, record, Connect, Context, Once, Op};
use crate::{Error, Result};
use candle_core::Tensor;

/// Send `x` to rank `dst`; backward receives dL/dx from `dst`.
///
/// Returns the zero-size delegate. Pass it to the next [`recv`], join it with
/// [`pseudo_connect`], or call `backward()` on it: whatever this rank's
/// backward starts from must reach it, or backward stops with an error naming
/// this send (instead of leaving `dst` waiting).
pub fn send(x: &Tensor, ctx: &Context, dst: usize) -> Result<Tensor> {
    let c = ctx.clone();
    let dims = x.dims().to_vec();
    record(
        Op {
            ctx,
            name: "send",
            x: Some(x),
            delegate: None,
        },
        || {
            ctx.send(x, dst)?;
            let delegate = Tensor::zeros(0, x.dtype(), x.device())?;
            Ok((
                delegate,
                // Mirror: receive dL/dx from dst.
                backward(move |_| {
                    let g = c.recv(dst)?;
                    if g.dims() != dims {
                        return Err(Error::Mismatch {
                            op: "send backward".into(),
                            details: format!(
                                "rank {dst} sent a gradient of shape {:?} for a tensor of shape {dims:?}",
                                g.dims()
                            ),
                        });
                    }
                    Ok(Some(g))
                }),
            ))
        },
    )
}

/// Receive a tensor from rank `src`; backward sends dL/dy back to `src` and
/// then continues into `delegate` (the delegate of this rank's earlier send,
/// as in ChainerMN; optional here, since every differentiable op is chained to
/// the one before it anyway).
pub fn recv(ctx: &Context, src: usize, delegate: Option<&Tensor>) -> Result<Tensor> {
    let c = ctx.clone();
    record(
        Op {
            ctx,
            name: "recv",
            x: None,
            delegate,
        },
        || {
            let y = ctx.recv(src)?;
            // Mirror: send dL/dy back to src.
            Ok((y, backward(move |g| c.send(g, src).map(|_| None))))
        },
    )
}

/// `x` itself, joined in the graph to `delegate`: backward from anything
/// computed from the result also reaches `delegate` (and the sends behind it).
pub fn pseudo_connect(delegate: &Tensor, x: &Tensor) -> Result<Tensor> {
    let delegate = delegate.to_device(x.device())?;
    Ok(x.apply_op2(
        &delegate,
        Connect {
            out: Once::new(x.contiguous()?),
        },
    )?)
}
