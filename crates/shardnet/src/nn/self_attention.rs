//! Causal self-attention straight from a fused q, k, v projection:
//! [`causal_self_attention`]`(qkv, heads)`.
//!
//! qkv (B, T, 3·H·d) holds each position's queries, keys and values side
//! by side, `[q | k | v]`, head h's features at h·d .. (h+1)·d of each
//! (what a `Linear` of weight (3, H·d, D) writes); the output (B, T, H·d)
//! holds head h's at h·d .. (h+1)·d (what the output projection reads).
//! It equals [`causal_attention`] on q, k, v cut out and permuted to
//! (B, H, T, d), with the result permuted back.
//!
//! | pass | the composition in candle ops | this op (f32 on the CPU kernels) |
//! |---|---|---|
//! | forward | a permuted view, three copies of q, k, v, the attention, a copy back | each head's q, k, v gathered per thread, the attention, its rows written into place |
//! | memory held for backward | qkv, q, k, v and the output | qkv and the output |
//! | backward | the output's gradient permuted (a copy), q, k, v, out and g copied again, then three zero-padded gradients of qkv summed (candle's `narrow` backward) | per head: gather, the kernel, dq, dk, dv written into one dqkv |
//!
//! f64 and the generic path (other devices, `SHARDNET_KERNELS=generic`)
//! run the composition.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use shardnet::nn::causal_self_attention;
//! // One head of size 2 over 3 positions; all queries and keys equal.
//! let q = [1f32, 1.];
//! let rows: Vec<f32> = (0..3)
//!     .flat_map(|t| q.iter().chain(&q).copied().chain([t as f32, 1.]).collect::<Vec<_>>())
//!     .collect();
//! let qkv = Tensor::from_vec(rows, (1, 3, 6), &Device::Cpu)?;
//! let out = causal_self_attention(&qkv, 1)?;
//! // Equal scores: each position averages the values up to it.
//! assert_eq!(out.get(0)?.to_vec2::<f32>()?, vec![vec![0., 1.], vec![0.5, 1.], vec![1., 1.]]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::attention::causal_attention;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Causal attention of `heads` heads over `qkv` (B, T, 3·H·d) laid out as
/// the module doc says: (B, T, H·d).
pub fn causal_self_attention(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, width) = match qkv.dims() {
        &[b, t, w] => (b, t, w),
        other => {
            return Err(Error::Usage(format!(
                "causal_self_attention: qkv of shape {other:?}; give (batch, seq, 3 × heads × head dim)"
            )))
        }
    };
    if heads == 0 || !width.is_multiple_of(3 * heads) {
        return Err(Error::Usage(format!(
            "causal_self_attention: {width} features for {heads} heads; give 3 × heads × head dim"
        )));
    }
    let d = width / (3 * heads);
    if !crate::kernels::fast(qkv.device()) || qkv.dtype() != DType::F32 || d == 0 {
        let parts = qkv.reshape((b, t, 3, heads, d))?.permute((2, 0, 3, 1, 4))?;
        let part = |i: usize| -> Result<Tensor> { Ok(parts.get(i)?.contiguous()?) };
        let y = causal_attention(&part(0)?, &part(1)?, &part(2)?)?;
        return Ok(y.transpose(1, 2)?.reshape((b, t, heads * d))?);
    }
    let op = SelfAttention {
        shape: Heads {
            batch: b,
            seq: t,
            heads,
            dim: d,
        },
        lse: Arc::new(Mutex::new(Vec::new())),
    };
    Ok(qkv.contiguous()?.apply_op1(op)?)
}

/// The sizes: B, T, H, d.
#[derive(Clone, Copy)]
struct Heads {
    batch: usize,
    seq: usize,
    heads: usize,
    dim: usize,
}

impl Heads {
    /// Head h of batch row b's features `part` (0 q, 1 k, 2 v) of a
    /// (B, T, `parts`·H·d) tensor, as T × d rows.
    fn gather(&self, src: &[f32], parts: usize, (b, h, part): (usize, usize, usize)) -> Vec<f32> {
        let (t, d, width) = (self.seq, self.dim, parts * self.heads * self.dim);
        let at = part * self.heads * d + h * d;
        let mut out = Vec::with_capacity(t * d);
        for row in src[b * t * width..(b + 1) * t * width].chunks_exact(width) {
            out.extend_from_slice(&row[at..at + d]);
        }
        out
    }

    /// Each (b, h)'s T × d results (`per_head[b·H + h][part]`) written into
    /// a (B, T, `parts`·H·d) tensor's rows.
    fn scatter(&self, per_head: &[Vec<Vec<f32>>], parts: usize) -> Vec<f32> {
        let (t, d, hs) = (self.seq, self.dim, self.heads);
        let width = parts * hs * d;
        // Every element written: each row's parts of each head.
        let mut dst = crate::kernels::unfilled(self.batch * t * width, f32::NAN);
        crate::kernels::for_chunks_mut(&mut dst, width, |row, out| {
            let (b, i) = (row / t, row % t);
            for h in 0..hs {
                for (part, src) in per_head[b * hs + h].iter().enumerate() {
                    let at = part * hs * d + h * d;
                    out[at..at + d].copy_from_slice(&src[i * d..(i + 1) * d]);
                }
            }
        });
        dst
    }

    /// `f(b, h)` for every (b, h), over the threads where there are
    /// several (each head's GEMMs on its own thread), in (b, h) order.
    fn each<R: Send>(&self, f: impl Fn(usize, usize) -> R + Send + Sync) -> Vec<R> {
        use rayon::prelude::*;
        let n = self.batch * self.heads;
        let one = |i: usize| f(i / self.heads, i % self.heads);
        if crate::kernels::threads_here() > 1 {
            (0..n)
                .into_par_iter()
                .map(|i| crate::kernels::serial(|| one(i)))
                .collect()
        } else {
            (0..n).map(one).collect()
        }
    }
}

struct SelfAttention {
    shape: Heads,
    /// Every head's rows' log-sum-exp, (B, H, T), kept for backward.
    lse: Arc<Mutex<Vec<f32>>>,
}

impl SelfAttention {
    fn scale(&self) -> f32 {
        1.0 / (self.shape.dim as f32).sqrt()
    }
}

impl CustomOp1 for SelfAttention {
    fn name(&self) -> &'static str {
        "shardnet-causal-self-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(qkv) = s else {
            candle_core::bail!("shardnet causal_self_attention: f32 on the CPU kernels")
        };
        let qkv = crate::kernels::view(qkv, l, "causal_self_attention")?;
        let sh = self.shape;
        let t = sh.seq;
        let heads = sh.each(|b, h| {
            let (q, k, v) = (
                sh.gather(qkv, 3, (b, h, 0)),
                sh.gather(qkv, 3, (b, h, 1)),
                sh.gather(qkv, 3, (b, h, 2)),
            );
            let (mut out, mut lse) = (vec![0f32; t * sh.dim], vec![0f32; t]);
            crate::kernels::attention::forward(
                (&q, &k, &v),
                sh.dim,
                self.scale(),
                &mut out,
                &mut lse,
            );
            (vec![out], lse)
        });
        let (outs, lses): (Vec<_>, Vec<_>) = heads.into_iter().unzip();
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lses.concat();
        let y = sh.scatter(&outs, 1);
        Ok((
            CpuStorage::F32(y),
            Shape::from((sh.batch, t, sh.heads * sh.dim)),
        ))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let sh = self.shape;
        let t = sh.seq;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        if lse.len() != sh.batch * sh.heads * t {
            candle_core::bail!("shardnet causal_self_attention: no forward state for backward")
        }
        let grad = grad.contiguous()?;
        let what = "causal_self_attention";
        let grads = crate::kernels::with_f32s(qkv, what, |qkv| {
            crate::kernels::with_f32s(out, what, |out| {
                crate::kernels::with_f32s(&grad, what, |g| {
                    Ok::<_, candle_core::Error>(sh.each(|b, h| {
                        let at = |part| (b, h, part);
                        let (q, k, v) = (
                            sh.gather(qkv, 3, at(0)),
                            sh.gather(qkv, 3, at(1)),
                            sh.gather(qkv, 3, at(2)),
                        );
                        let (o, gh) = (sh.gather(out, 1, at(0)), sh.gather(g, 1, at(0)));
                        let n = t * sh.dim;
                        let (mut dq, mut dk, mut dv) =
                            (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
                        let row = (b * sh.heads + h) * t;
                        crate::kernels::attention::backward(
                            (&q, &k, &v),
                            &o,
                            &gh,
                            &lse[row..row + t],
                            sh.dim,
                            self.scale(),
                            (&mut dq, &mut dk, &mut dv),
                        );
                        vec![dq, dk, dv]
                    }))
                })
            })
        })?;
        let dqkv = sh.scatter(&grads, 3);
        Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
    }
}
