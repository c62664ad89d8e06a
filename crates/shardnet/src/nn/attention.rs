//! Causal scaled dot-product attention, never holding a head's T × T
//! scores on the CPU path.
//!
//! q, k, v: (B, H, T, d); out_i = Σ_{j ≤ i} softmax_j(q_i·k_j / √d) v_j.
//!
//! **f32** (what models train in): [`crate::kernels::attention`], a block
//! of 64 queries at a time against the keys up to the diagonal, on GEMMs
//! (2 forward, 5 backward), the block's scores (64 × T) and the rows'
//! log-sum-exp the only state; heads run in parallel.
//!
//! **f64** (the reference): per head and block of [`BLOCK`] queries, blocked
//! online softmax as flash attention computes it: the key blocks up to
//! the diagonal in turn, each row's running maximum m, sum l and output
//! rescaled as a larger score arrives (sums in f64); the row's
//! log-sum-exp L = m + ln l is kept for backward. Backward (g = dL/dout):
//! Δ_i = g_i·out_i; per key block, P_ij = exp(s_ij − L_i) recomputed,
//! dv_j += Σ_i P_ij g_i, dP_ij = g_i·v_j, dS_ij = P_ij (dP_ij − Δ_i),
//! dq_i += dS_ij k_j / √d, dk_j += dS_ij q_i / √d. Memory: O(T·d) per head
//! besides the inputs, whatever T. On other devices (and with
//! `SHARDNET_KERNELS=generic`) it is the same function in candle ops,
//! with the masked T × T scores.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! let q = Tensor::ones((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
//! let v = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((1, 2, 3, 4))?;
//! let out = shardnet::nn::causal_attention(&q, &q, &v)?;
//! // Equal scores: each row is the mean of the values up to it.
//! let first = out.get(0)?.get(0)?.to_vec2::<f32>()?;
//! assert_eq!(first[0], vec![0., 1., 2., 3.]);
//! assert_eq!(first[1], vec![2., 3., 4., 5.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::kernels::Float;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, D};
use std::sync::{Arc, Mutex};

/// Queries (and keys) per block: a block of scores is BLOCK × BLOCK.
pub const BLOCK: usize = 64;

/// Causal attention of `q` over `k`, `v`, all (B, H, T, d), scaled by
/// 1/√d: (B, H, T, d).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let dims = q.dims();
    if dims.len() != 4 || k.dims() != dims || v.dims() != dims {
        return Err(Error::Usage(format!(
            "causal_attention: q {:?}, k {:?}, v {:?}; give three (batch, heads, seq, head dim)",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let (t, d) = (dims[2], dims[3]);
    let scale = 1.0 / (d.max(1) as f64).sqrt();
    if !crate::kernels::fast(q.device()) {
        let s = (q.matmul(&k.t()?)? * scale)?;
        let mask: Vec<u8> = (0..t)
            .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), q.device())?;
        let neg = Tensor::new(f32::NEG_INFINITY, q.device())?
            .to_dtype(s.dtype())?
            .broadcast_as(s.shape())?;
        let s = mask.broadcast_as(s.shape())?.where_cond(&neg, &s)?;
        let p = candle_nn::ops::softmax(&s, D::Minus1)?;
        return Ok(p.matmul(v)?);
    }
    let op = Attention {
        scale,
        lse: Arc::new(Mutex::new(Lse::F64(Vec::new()))),
    };
    Ok(q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)?)
}

struct Attention {
    scale: f64,
    /// Per row of every head: its log-sum-exp, kept for backward (f32
    /// from the f32 kernel, f64 from the f64 one).
    lse: Arc<Mutex<Lse>>,
}

/// The rows' log-sum-exp, in the precision of the pass that made it.
enum Lse {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Run `f(h)` for every head h in 0..heads: over the threads (each head's
/// GEMMs on its own thread) where there are several, else here.
fn each_head<T: Send>(parts: Vec<T>, f: impl Fn(usize, T) + Send + Sync) {
    use rayon::prelude::*;
    if crate::kernels::threads_here() > 1 {
        parts
            .into_par_iter()
            .enumerate()
            .for_each(|(h, part)| crate::kernels::serial(|| f(h, part)));
    } else {
        parts
            .into_iter()
            .enumerate()
            .for_each(|(h, part)| f(h, part));
    }
}

/// The f32 forward on the GEMM kernel ([`crate::kernels::attention`]).
fn forward_f32(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (bh, t, d): (usize, usize, usize),
    scale: f64,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; bh * t * d];
    let mut lse = vec![0f32; bh * t];
    if t * d > 0 {
        let parts: Vec<_> = out.chunks_mut(t * d).zip(lse.chunks_mut(t)).collect();
        each_head(parts, |h, (o, l)| {
            let at = h * t * d..(h + 1) * t * d;
            let heads = (&q[at.clone()], &k[at.clone()], &v[at]);
            crate::kernels::attention::forward(heads, d, scale as f32, o, l)
        });
    }
    (out, lse)
}

fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "causal_attention")
}

fn dot<T: Float + Send + Sync>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
}

/// One head's forward: out (T × d) and its rows' log-sum-exp.
fn head_forward<T: Float + Send + Sync>(
    q: &[T],
    k: &[T],
    v: &[T],
    d: usize,
    scale: f64,
    out: &mut [T],
    lse: &mut [f64],
) {
    let t = lse.len();
    let mut s = vec![0f64; BLOCK];
    let mut acc = vec![0f64; BLOCK * d];
    for i0 in (0..t).step_by(BLOCK) {
        let rows = BLOCK.min(t - i0);
        let (mut m, mut l) = (vec![f64::NEG_INFINITY; rows], vec![0f64; rows]);
        acc[..rows * d].fill(0.0);
        for j0 in (0..=i0 + rows - 1).step_by(BLOCK) {
            let cols = BLOCK.min(t - j0);
            for r in 0..rows {
                let i = i0 + r;
                let last = cols.min((i + 1).saturating_sub(j0));
                if last == 0 {
                    continue;
                }
                let qi = &q[i * d..][..d];
                let mut top = m[r];
                for c in 0..last {
                    s[c] = dot(qi, &k[(j0 + c) * d..][..d]) * scale;
                    top = top.max(s[c]);
                }
                // Rescale what was summed under the old maximum.
                let shrink = (m[r] - top).exp();
                l[r] *= shrink;
                let a = &mut acc[r * d..][..d];
                a.iter_mut().for_each(|x| *x *= shrink);
                for c in 0..last {
                    let p = (s[c] - top).exp();
                    l[r] += p;
                    for (x, vv) in a.iter_mut().zip(&v[(j0 + c) * d..][..d]) {
                        *x += p * vv.to_f64();
                    }
                }
                m[r] = top;
            }
        }
        for r in 0..rows {
            let i = i0 + r;
            for (o, a) in out[i * d..][..d].iter_mut().zip(&acc[r * d..][..d]) {
                *o = T::from_f64(a / l[r]);
            }
            lse[i] = m[r] + l[r].ln();
        }
    }
}

/// One head's backward: dq, dk, dv (each T × d) from g and the forward's
/// out and log-sum-exp.
fn head_backward<T: Float + Send + Sync>(
    (q, k, v): (&[T], &[T], &[T]),
    out: &[T],
    g: &[T],
    lse: &[f64],
    d: usize,
    scale: f64,
    (dq, dk, dv): (&mut [f64], &mut [f64], &mut [f64]),
) {
    let t = lse.len();
    let delta: Vec<f64> = (0..t)
        .map(|i| dot(&g[i * d..][..d], &out[i * d..][..d]))
        .collect();
    for j0 in (0..t).step_by(BLOCK) {
        let cols = BLOCK.min(t - j0);
        for i in j0..t {
            let qi = &q[i * d..][..d];
            let gi = &g[i * d..][..d];
            let last = cols.min(i + 1 - j0);
            for c in 0..last {
                let j = j0 + c;
                let p = (dot(qi, &k[j * d..][..d]) * scale - lse[i]).exp();
                let dp = dot(gi, &v[j * d..][..d]);
                let ds = p * (dp - delta[i]) * scale;
                for x in 0..d {
                    dv[j * d + x] += p * gi[x].to_f64();
                    dq[i * d + x] += ds * k[j * d + x].to_f64();
                    dk[j * d + x] += ds * qi[x].to_f64();
                }
            }
        }
    }
}

fn forward<T: Float + Send + Sync>(
    q: &[T],
    k: &[T],
    v: &[T],
    (bh, t, d): (usize, usize, usize),
    scale: f64,
) -> (Vec<T>, Vec<f64>) {
    use rayon::prelude::*;
    let mut out = vec![T::from_f64(0.0); bh * t * d];
    let mut lse = vec![0f64; bh * t];
    if t * d > 0 {
        out.par_chunks_mut(t * d)
            .zip(lse.par_chunks_mut(t))
            .enumerate()
            .for_each(|(h, (o, l))| {
                let at = h * t * d;
                head_forward(
                    &q[at..][..t * d],
                    &k[at..][..t * d],
                    &v[at..][..t * d],
                    d,
                    scale,
                    o,
                    l,
                )
            });
    }
    (out, lse)
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "shardnet-causal-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = ql.shape().dims4()?;
        let shape = (b * h, t, d);
        let (out, lse) = match (qs, ks, vs) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let (o, l) =
                    forward_f32(view(q, ql)?, view(k, kl)?, view(v, vl)?, shape, self.scale);
                (CpuStorage::F32(o), Lse::F32(l))
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                let (o, l) = forward(view(q, ql)?, view(k, kl)?, view(v, vl)?, shape, self.scale);
                (CpuStorage::F64(o), Lse::F64(l))
            }
            _ => candle_core::bail!(
                "shardnet causal_attention: f32 or f64, one dtype for q, k and v"
            ),
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        use rayon::prelude::*;
        let (b, h, t, d) = q.dims4()?;
        let n = t * d;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        if let Lse::F32(lse) = &*lse {
            let flat = |x: &Tensor| -> candle_core::Result<Vec<f32>> {
                x.contiguous()?.flatten_all()?.to_vec1::<f32>()
            };
            let (q32, k32, v32, o, g) = (flat(q)?, flat(k)?, flat(v)?, flat(out)?, flat(grad)?);
            let (mut dq, mut dk, mut dv) = (
                vec![0f32; b * h * n],
                vec![0f32; b * h * n],
                vec![0f32; b * h * n],
            );
            if n > 0 {
                let parts: Vec<_> = dq
                    .chunks_mut(n)
                    .zip(dk.chunks_mut(n))
                    .zip(dv.chunks_mut(n))
                    .map(|((a, b), c)| (a, b, c))
                    .collect();
                each_head(parts, |hd, grads| {
                    let at = hd * n..(hd + 1) * n;
                    crate::kernels::attention::backward(
                        (&q32[at.clone()], &k32[at.clone()], &v32[at.clone()]),
                        &o[at.clone()],
                        &g[at],
                        &lse[hd * t..(hd + 1) * t],
                        d,
                        self.scale as f32,
                        grads,
                    )
                });
            }
            let back = |g: Vec<f32>| Tensor::from_vec(g, q.shape(), q.device());
            return Ok((Some(back(dq)?), Some(back(dk)?), Some(back(dv)?)));
        }
        let Lse::F64(lse) = &*lse else {
            candle_core::bail!("shardnet causal_attention: no forward state for backward")
        };
        let (mut dq, mut dk, mut dv) = (
            vec![0f64; b * h * n],
            vec![0f64; b * h * n],
            vec![0f64; b * h * n],
        );
        macro_rules! run {
            ($t:ty) => {{
                let flat = |x: &Tensor| -> candle_core::Result<Vec<$t>> {
                    x.contiguous()?.flatten_all()?.to_vec1::<$t>()
                };
                let (q, k, v, o, g) = (flat(q)?, flat(k)?, flat(v)?, flat(out)?, flat(grad)?);
                if n > 0 {
                    dq.par_chunks_mut(n)
                        .zip(dk.par_chunks_mut(n))
                        .zip(dv.par_chunks_mut(n))
                        .enumerate()
                        .for_each(|(hd, ((dq, dk), dv))| {
                            let at = hd * n;
                            head_backward(
                                (&q[at..][..n], &k[at..][..n], &v[at..][..n]),
                                &o[at..][..n],
                                &g[at..][..n],
                                &lse[hd * t..][..t],
                                d,
                                self.scale,
                                (dq, dk, dv),
                            )
                        });
                }
            }};
        }
        match q.dtype() {
            DType::F64 => run!(f64),
            other => candle_core::bail!("shardnet causal_attention: {other:?}; f32 or f64"),
        }
        let back = |g: Vec<f64>| -> candle_core::Result<Tensor> {
            Tensor::from_vec(g, q.shape(), q.device())?.to_dtype(q.dtype())
        };
        Ok((Some(back(dq)?), Some(back(dk)?), Some(back(dv)?)))
    }
}
