//! The fused CPU op of one rank: training-mode batch normalisation, with
//! ReLU and the max pooling after it or not, as one candle op whose
//! backward adds dγ and dβ to the parameters; and the small helpers the
//! group's path shares.

use crate::comm::ReduceOp;
use crate::kernels::batch_norm::{affine, Affine, Dy, Planes};
use crate::nn::Param;
use crate::Result;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Whether the fused CPU op serves x: f32 on the CPU with the fast kernels.
pub(super) fn fused(x: &Tensor) -> bool {
    crate::kernels::fast(x.device()) && x.dtype() == DType::F32
}

/// Training-mode batch normalisation as one op (per channel: two passes for
/// the statistics, one for y; backward one pass for the sums, one for dx).
pub(super) struct FusedOp {
    gamma: Param,
    beta: Param,
    eps: f64,
    /// ReLU after: y = max(0, ·), dy masked where y ≤ 0.
    relu: bool,
    /// k × k max pooling after (of the ReLU's output): only the windows'
    /// winners are written, their offsets kept for backward.
    pool: Option<usize>,
    /// (mean, biased variance) per channel, set by the forward.
    stats: Arc<Mutex<Vec<(f64, f64)>>>,
    /// With `relu`: the forward's affine pair, whose sign of x·scale + shift
    /// is ReLU's mask in backward.
    mask: Mutex<Option<Affine>>,
    /// With `pool`: each output's winner, its offset in its plane.
    winners: Mutex<Vec<u32>>,
}

/// The f32 elements of a contiguous CPU tensor.
pub(super) fn f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// `f` on the f32 elements of a contiguous CPU tensor, read in place (in
/// the op's backward, and on the group's path, where `f` communicates and
/// returns shardnet's errors).
pub(super) fn with_f32s<R, E: From<candle_core::Error>>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    crate::kernels::with_f32s(t, "BatchNorm2d", f)
}

impl CustomOp1 for FusedOp {
    fn name(&self) -> &'static str {
        "shardnet-batch-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else {
            candle_core::bail!("shardnet BatchNorm2d: the fused op takes f32");
        };
        if !l.is_contiguous() {
            candle_core::bail!("shardnet BatchNorm2d: expected a contiguous tensor");
        }
        let (b, c, h, w) = l.shape().dims4()?;
        let x = &v[l.start_offset()..l.start_offset() + l.shape().elem_count()];
        let (gamma, beta) = (f32s(self.gamma.value())?, f32s(self.beta.value())?);
        let pl = Planes { b, c, hw: h * w };
        let n = (b * pl.hw) as f64;
        let mean: Vec<f64> = pl.sums(x).iter().map(|s| s / n).collect();
        let var: Vec<f64> = pl.centred_squares(x, &mean).iter().map(|s| s / n).collect();
        let pair = affine(&mean, &var, &gamma, &beta, self.eps);
        let (y, shape) = match self.pool {
            Some(k) => {
                let (y, win) = pl.normalise_pool(x, &pair, self.relu, (h, w, k));
                *self.winners.lock().unwrap_or_else(|e| e.into_inner()) = win;
                (y, Shape::from((b, c, h / k, w / k)))
            }
            None => (pl.normalise(x, &pair, self.relu), l.shape().clone()),
        };
        if self.relu {
            *self.mask.lock().unwrap_or_else(|e| e.into_inner()) = Some(pair);
        }
        let stats = mean.into_iter().zip(var).collect();
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (_, c, _, _) = x.dims4()?;
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if stats.len() != c {
            candle_core::bail!("shardnet BatchNorm2d: backward before forward");
        }
        // x and dy are read where they lie (a copy of each cost 1.7% of a
        // VGG16 step).
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        with_f32s(&x, |xs| {
            with_f32s(&grad, |dy| self.input_grad(&x, xs, dy, &stats))
        })
    }
}

impl FusedOp {
    /// The op for γ, β and ε, with ReLU and the k × k pooling after it or
    /// not; the forward leaves (mean, variance) per channel in `stats`.
    pub(super) fn new(
        (gamma, beta): (&Param, &Param),
        eps: f64,
        (relu, pool): (bool, Option<usize>),
        stats: &Arc<Mutex<Vec<(f64, f64)>>>,
    ) -> Self {
        FusedOp {
            gamma: gamma.clone(),
            beta: beta.clone(),
            eps,
            relu,
            pool,
            stats: stats.clone(),
            mask: Mutex::new(None),
            winners: Mutex::new(Vec::new()),
        }
    }

    /// dx, with dγ and dβ added to the parameters, from x and dy.
    fn input_grad(
        &self,
        x: &Tensor,
        xs: &[f32],
        dy: &[f32],
        stats: &[(f64, f64)],
    ) -> candle_core::Result<Option<Tensor>> {
        let (b, c, h, w) = x.dims4()?;
        let hw = h * w;
        let n = (b * hw) as f64;
        let gamma = f32s(self.gamma.value())?;
        let pl = Planes { b, c, hw };
        let mean: Vec<f64> = stats.iter().map(|s| s.0).collect();
        let inv: Vec<f64> = stats
            .iter()
            .map(|s| 1.0 / (s.1 + self.eps).sqrt())
            .collect();
        let mask = self.mask.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if self.relu && mask.is_none() {
            candle_core::bail!("shardnet BatchNorm2d: backward before forward");
        }
        let mask = mask.as_ref();
        let winners = self.winners.lock().unwrap_or_else(|e| e.into_inner());
        let per = self.pool.map(|k| (h / k) * (w / k));
        if per.is_some_and(|per| winners.len() != b * c * per || dy.len() != winners.len()) {
            candle_core::bail!("shardnet BatchNorm2d: backward before forward");
        }
        let dy = Dy::of(dy, &winners, per);
        let (sdy, sdyx) = pl.grad_sums(xs, dy, &mean, &inv, mask);
        let dx = pl.input_grad(xs, dy, &mean, &inv, &gamma, (&sdy, &sdyx, n), mask);
        let f32s_of = |v: &[f64]| v.iter().map(|s| *s as f32).collect::<Vec<f32>>();
        let (dgamma, dbeta) = (f32s_of(&sdyx), f32s_of(&sdy));
        let add = |p: &Param, v| add_grad(p, v).map_err(|e| candle_core::Error::Msg(e.to_string()));
        add(&self.gamma, dgamma)?;
        add(&self.beta, dbeta)?;
        Ok(Some(Tensor::from_vec(dx, (b, c, h, w), x.device())?))
    }
}

/// A `Param`'s gradient += v (set on the first contribution).
pub(super) fn add_grad(p: &Param, v: Vec<f32>) -> Result<()> {
    p.update_grad(move |buf, empty| {
        for (d, s) in buf.iter_mut().zip(&v) {
            *d = if empty { *s } else { *d + s };
        }
        Ok(())
    })
}

/// v summed over the group's ranks, in f64.
pub(super) fn allreduce_f64(comm: &crate::comm::Communicator, v: Vec<f64>) -> Result<Vec<f64>> {
    let len = v.len();
    let t = Tensor::from_vec(v, len, &crate::comm::HOST)?;
    Ok(comm.allreduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?)
}

/// Every rank's `v`, concatenated in rank order, in f64. Every rank must
/// send as many values as this one (`what` names them): a peer that sent
/// another number is refused on every rank, naming it (an allgather takes
/// any lengths, so nothing else would catch, say, a peer's layer with
/// other channels).
pub(super) fn allgather_f64(
    comm: &crate::comm::Communicator,
    v: Vec<f64>,
    what: &str,
) -> Result<Vec<f64>> {
    let len = v.len();
    let t = Tensor::from_vec(v, len, &crate::comm::HOST)?;
    let (all, counts) = comm.allgather_counts(&t)?;
    if let Some((r, n)) = counts.iter().enumerate().find(|(_, n)| **n != len) {
        return Err(crate::Error::Usage(format!(
            "{what}: rank {r} of the group sent {n} values and this rank {len}: \
             the ranks' layers differ (build the same model on every rank)"
        )));
    }
    Ok(all.to_vec1::<f64>()?)
}

/// One rank's share of a channel's statistics: its count, Σx, and Σ(x − x̄)²
/// about its own mean x̄ (0 without images).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Part {
    pub(super) n: f64,
    pub(super) sum: f64,
    pub(super) m2: f64,
}

/// The whole batch's (count, μ, Σ(x − μ)²) of one channel from every
/// rank's part, in rank order (Chan, Golub and LeVeque's pairwise update):
/// μ = Σ sumᵢ / N and Σ(x − μ)² = Σ [m2ᵢ + nᵢ (x̄ᵢ − μ)²], every term ≥ 0,
/// so no cancellation however far μ lies from zero. Every rank merges the
/// same parts in the same order: the same bits everywhere.
pub(super) fn merge(parts: impl Iterator<Item = Part> + Clone) -> (f64, f64, f64) {
    let n: f64 = parts.clone().map(|p| p.n).sum();
    if n == 0.0 {
        return (0.0, 0.0, 0.0);
    }
    let mean = parts.clone().map(|p| p.sum).sum::<f64>() / n;
    let m2 = parts
        .filter(|p| p.n > 0.0)
        .map(|p| {
            let d = p.sum / p.n - mean;
            p.m2 + p.n * d * d
        })
        .sum();
    (n, mean, m2)
}
