//! `BatchNorm2d`: batch normalisation over (batch, height, width) per
//! channel, optionally across the ranks of a data-parallel group.
//!
//! | mode | statistics | y |
//! |------|------------|---|
//! | training | μ = Σ x / N, σ² = Σ (x − μ)² / N over the batch's N = B·H·W values of each channel (two passes: no cancellation) | (x − μ) / √(σ² + ε) · γ + β |
//! | evaluation | the running μ̂, σ̂² | (x − μ̂) / √(σ̂² + ε) · γ + β |
//!
//! Each training step updates the running statistics as PyTorch does:
//! μ̂ ← (1 − m) μ̂ + m μ, σ̂² ← (1 − m) σ̂² + m σ² · N / (N − 1), with
//! momentum m = 0.1 and ε = 1e-5 by default. Shapes: x and y (B, C, H, W);
//! γ, β, μ̂, σ̂² (C).
//!
//! **Across ranks** ([`BatchNorm2d::multi_node`], ChainerMN's
//! `MultiNodeBatchNormalization`): the two per-channel sums and the count are
//! allreduced over the group, so every rank normalises with the statistics
//! of the concatenated batch, exactly as one device would. The sums are
//! differentiable allreduces, so the backward sums their gradients too.
//! Communication per training call: two allreduces of C values and one of a
//! count; ranks may hold different batch sizes, even none.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::comm::HOST;
//! use shardnet::nn::{BatchNorm2d, ParamStore};
//!
//! let store = ParamStore::new(&HOST, 0);
//! let bn = BatchNorm2d::new(&store, "bn", 2)?;
//! let x = Tensor::new(&[1f32, 3., 10., 30.], &HOST)?.reshape((2, 2, 1, 1))?;
//! let y = bn.forward(&x, true)?;
//! // Channel 0 holds 1 and 10, channel 1 holds 3 and 30: each becomes ±1.
//! let y = y.flatten_all()?.to_vec1::<f32>()?;
//! assert!((y[0] + 1.0).abs() < 1e-3 && (y[2] - 1.0).abs() < 1e-3);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::{Param, ParamStore};
use crate::comm::ReduceOp;
use crate::functions::{allreduce, backward, communicating, Context};
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Batch normalisation of 4-D inputs per channel, with running statistics.
#[derive(Clone)]
pub struct BatchNorm2d {
    /// γ, (C).
    pub weight: Param,
    /// β, (C).
    pub bias: Param,
    running: Arc<Mutex<(Tensor, Tensor)>>,
    /// m of the running statistics' update.
    pub momentum: f64,
    /// ε added to the variance.
    pub eps: f64,
    group: Option<Context>,
}

impl std::fmt::Debug for BatchNorm2d {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BatchNorm2d({}, {} channels{})",
            self.weight.name(),
            self.channels(),
            if self.group.is_some() {
                ", across ranks"
            } else {
                ""
            }
        )
    }
}

impl BatchNorm2d {
    /// γ = 1 and β = 0 registered in `store` as `name.weight` and
    /// `name.bias`; running mean 0 and variance 1.
    pub fn new(store: &ParamStore, name: &str, channels: usize) -> Result<Self> {
        let dev = store.device();
        let weight = store.add(
            &format!("{name}.weight"),
            &Tensor::ones(channels, DType::F32, dev)?,
            None,
        )?;
        let bias = store.add(
            &format!("{name}.bias"),
            &Tensor::zeros(channels, DType::F32, dev)?,
            None,
        )?;
        Self::from_params(weight, bias)
    }

    /// Channels `own` of a batch normalisation over `global` channels (γ = 1,
    /// β = 0), registered as shards of `name.weight` and `name.bias`: for
    /// activations split by channels over ranks, each normalising its own.
    pub fn new_shard(
        store: &ParamStore,
        name: &str,
        own: std::ops::Range<usize>,
        global: usize,
    ) -> Result<Self> {
        let dev = store.device();
        let shard = super::Shard {
            dim: 0,
            offset: own.start,
            global,
        };
        let n = own.len();
        let weight = store.add(
            &format!("{name}.weight"),
            &Tensor::ones(n, DType::F32, dev)?,
            Some(shard),
        )?;
        let bias = store.add(
            &format!("{name}.bias"),
            &Tensor::zeros(n, DType::F32, dev)?,
            Some(shard),
        )?;
        Self::from_params(weight, bias)
    }

    /// From ready γ and β (same shape (C)).
    pub fn from_params(weight: Param, bias: Param) -> Result<Self> {
        let c = weight.value().dims().to_vec();
        if c.len() != 1 || bias.value().dims() != c.as_slice() {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: γ {:?} and β {:?} must both be (channels)",
                weight.name(),
                c,
                bias.value().dims()
            )));
        }
        let (dev, dt) = (weight.value().device().clone(), weight.value().dtype());
        let running = (
            Tensor::zeros(c[0], dt, &dev)?,
            Tensor::ones(c[0], dt, &dev)?,
        );
        Ok(BatchNorm2d {
            weight,
            bias,
            running: Arc::new(Mutex::new(running)),
            momentum: 0.1,
            eps: 1e-5,
            group: None,
        })
    }

    /// ChainerMN's `MultiNodeBatchNormalization`: batch statistics over the
    /// concatenated batches of the ranks of `group` (a data-parallel group).
    pub fn multi_node(mut self, group: Context) -> Self {
        self.group = Some(group);
        self
    }

    /// The number of channels.
    pub fn channels(&self) -> usize {
        self.weight.value().dims()[0]
    }

    /// Its parameters: γ, β.
    pub fn params(&self) -> Vec<Param> {
        vec![self.weight.clone(), self.bias.clone()]
    }

    /// The running (mean, variance).
    pub fn running_stats(&self) -> (Tensor, Tensor) {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The running statistics as training state:
    /// `buffer/{layer}.running_mean` and `…running_var` (the layer's name is
    /// γ's without `.weight`), sharded as γ is.
    pub fn state(&self) -> Vec<super::StateTensor> {
        let name = self.weight.name();
        let layer = name.strip_suffix(".weight").unwrap_or(name);
        [(super::Half::First, "mean"), (super::Half::Second, "var")]
            .into_iter()
            .map(|(half, what)| super::StateTensor {
                name: format!("buffer/{layer}.running_{what}"),
                shape: vec![self.channels()],
                shard: self.weight.shard(),
                slot: super::Slot::TensorPair(self.running.clone(), half),
            })
            .collect()
    }

    /// Replace the running (mean, variance) (a checkpoint's).
    pub fn set_running_stats(&self, mean: Tensor, var: Tensor) -> Result<()> {
        let c = self.channels();
        if mean.dims() != [c] || var.dims() != [c] {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: running statistics {:?} and {:?} for {c} channels",
                self.weight.name(),
                mean.dims(),
                var.dims()
            )));
        }
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = (mean, var);
        Ok(())
    }

    /// y for x (B, C, H, W): batch statistics when `train` (and the running
    /// statistics updated), the running ones otherwise.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(x, train, false, None)
    }

    /// ReLU(batch norm(x)), as [`crate::nn::relu`] after [`forward`](Self::forward)
    /// and bit-for-bit the same; in training on the CPU kernels in one
    /// pass each way (the mask is y > 0, recomputed from x in backward:
    /// nothing more is kept).
    pub fn forward_relu(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(x, train, true, None)
    }

    /// k × k max pooling of ReLU(batch norm(x)), as [`crate::nn::max_pool2d`]
    /// after [`forward_relu`](Self::forward_relu) and bit-for-bit the same;
    /// in training on the CPU kernels in one pass each way that never
    /// writes the activation before the pooling (nor keeps it): each
    /// window's values are computed, compared and only the winner written;
    /// backward expands the pooled gradient one plane at a time.
    pub fn forward_relu_pool(&self, x: &Tensor, train: bool, k: usize) -> Result<Tensor> {
        if let [_, _, h, w] = x.dims()[..] {
            super::pool::check_window(h, w, k)?;
        }
        self.forward_with(x, train, true, Some(k))
    }

    fn forward_with(
        &self,
        x: &Tensor,
        train: bool,
        relu: bool,
        pool: Option<usize>,
    ) -> Result<Tensor> {
        let c = self.channels();
        let [b, xc, h, w] = x.dims()[..] else {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: input of shape {:?}, expected (batch, {c}, height, width)",
                self.weight.name(),
                x.dims()
            )));
        };
        if xc != c {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: input of shape {:?} has {xc} channels, the layer takes {c}",
                self.weight.name(),
                x.dims()
            )));
        }
        let per_channel = |t: &Tensor| t.reshape((1, c, 1, 1));
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: eps {} must be finite and not negative",
                self.weight.name(),
                self.eps
            )));
        }
        // The fused op carries dγ and dβ in its backward, which candle runs
        // only for an input in a graph: an untracked x takes candle's ops.
        // Across ranks the op is on the tape, whose token keeps its
        // backward (and its allreduce) in every rank's graph.
        if train && fused(x) {
            match &self.group {
                Some(g) => return self.forward_fused_group(x, g, relu, pool),
                None if x.track_op() => return self.forward_fused(x, relu, pool),
                None => {}
            }
        }
        if let Some(k) = pool {
            return super::max_pool2d(&self.forward_with(x, train, relu, None)?, k);
        }
        if relu {
            return super::relu(&self.forward_with(x, train, false, None)?);
        }
        let (mean, var) = if train {
            let local = b * h * w;
            let n = match &self.group {
                Some(g) => g.comm().allreduce_obj(&(local as u64), |a, b| a + b)? as usize,
                None => local,
            };
            if n == 0 {
                return Err(Error::Usage(format!(
                    "BatchNorm2d {}: batch statistics of an empty batch",
                    self.weight.name()
                )));
            }
            let mean = (self.sum(x)? / n as f64)?;
            let centred = x.broadcast_sub(&mean)?;
            let var = (self.sum(&centred.sqr()?)? / n as f64)?;
            self.update_running(&mean, &var, n)?;
            (mean, var)
        } else {
            let (m, v) = self.running_stats();
            (per_channel(&m)?, per_channel(&v)?)
        };
        let scale = (var + self.eps)?
            .sqrt()?
            .recip()?
            .broadcast_mul(&per_channel(&self.weight.tracked()?)?)?;
        Ok(x.broadcast_sub(&mean)?
            .broadcast_mul(&scale)?
            .broadcast_add(&per_channel(&self.bias.tracked()?)?)?)
    }

    /// Training on the CPU in f32 without a group: one op, statistics in
    /// f64, dγ and dβ accumulated into the `Param`s.
    fn forward_fused(&self, x: &Tensor, relu: bool, pool: Option<usize>) -> Result<Tensor> {
        let c = self.channels();
        let (b, _, h, w) = x.dims4()?;
        let n = b * h * w;
        if n == 0 {
            return Err(Error::Usage(format!(
                "BatchNorm2d {}: batch statistics of an empty batch",
                self.weight.name()
            )));
        }
        let stats = Arc::new(Mutex::new(Vec::new()));
        let y = x.contiguous()?.apply_op1(FusedOp {
            gamma: self.weight.clone(),
            beta: self.bias.clone(),
            eps: self.eps,
            relu,
            pool,
            stats: stats.clone(),
            mask: Mutex::new(None),
            winners: Mutex::new(Vec::new()),
        })?;
        // (mean, variance) per channel, from the forward.
        let st = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mean: Vec<f32> = st.iter().map(|s| s.0 as f32).collect();
        let var: Vec<f32> = st.iter().map(|s| s.1 as f32).collect();
        let dev = x.device();
        self.update_running(
            &Tensor::from_vec(mean, c, dev)?,
            &Tensor::from_vec(var, c, dev)?,
            n,
        )?;
        Ok(y)
    }

    /// Training across the group's ranks on the CPU in f32: the fused
    /// passes of [`FusedOp`] on this rank's images, with the per-channel
    /// sums allreduced in f64 between them (forward: Σx with the count,
    /// then Σ(x − μ)²; backward: Σdy and Σdy·x̂ in one message), so every
    /// rank normalises with the whole batch's statistics. dγ and dβ get
    /// this rank's sums (data parallelism sums them over the ranks).
    fn forward_fused_group(
        &self,
        x: &Tensor,
        group: &Context,
        relu: bool,
        pool: Option<usize>,
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let (b, c, h, w) = x.dims4()?;
        let pl = Planes { b, c, hw: h * w };
        let comm = group.comm().clone();
        let (gamma_p, beta_p, eps) = (self.weight.clone(), self.bias.clone(), self.eps);
        let name = self.weight.name().to_string();
        let mut stats = None;
        let y = communicating(group, "batch norm", &x, || {
            let xs = f32s(&x)?;
            let mut sums = pl.sums(&xs);
            sums.push((b * pl.hw) as f64);
            let sums = allreduce_f64(&comm, sums)?;
            let n = sums[c];
            if n == 0.0 {
                return Err(Error::Usage(format!(
                    "BatchNorm2d {name}: batch statistics of an empty batch (no rank of the \
                     group holds an image)"
                )));
            }
            let mean: Vec<f64> = sums[..c].iter().map(|s| s / n).collect();
            let var: Vec<f64> = allreduce_f64(&comm, pl.centred_squares(&xs, &mean))?
                .iter()
                .map(|s| s / n)
                .collect();
            let gamma = f32s(gamma_p.value())?;
            let affine = affine(&mean, &var, &gamma, &f32s(beta_p.value())?, eps);
            let (y, winners) = match pool {
                Some(k) => {
                    let (y, win) = pl.normalise_pool(&xs, &affine, relu, (h, w, k));
                    (Tensor::from_vec(y, (b, c, h / k, w / k), x.device())?, win)
                }
                None => {
                    let y = pl.normalise(&xs, &affine, relu);
                    (Tensor::from_vec(y, (b, c, h, w), x.device())?, Vec::new())
                }
            };
            let mask = relu.then_some(affine);
            let inv: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
            stats = Some((mean.clone(), var, n as usize));
            let x = x.clone();
            let back = backward(move |g| {
                let (xs, g) = (f32s(&x)?, f32s(&g.contiguous()?)?);
                let dy = Dy::of(&g, &winners, pool.map(|k| (h / k) * (w / k)));
                let mask = mask.as_ref();
                let (sdy, sdyx) = pl.grad_sums(&xs, dy, &mean, &inv, mask);
                let both = allreduce_f64(&comm, [&sdy[..], &sdyx[..]].concat())?;
                let (gdy, gdyx) = both.split_at(c);
                let sums = (gdy, gdyx, n);
                let dx = pl.input_grad(&xs, dy, &mean, &inv, &gamma, sums, mask);
                add_grad(&gamma_p, sdyx.iter().map(|v| *v as f32).collect())?;
                add_grad(&beta_p, sdy.iter().map(|v| *v as f32).collect())?;
                Ok(Some(Tensor::from_vec(dx, (b, c, h, w), x.device())?))
            });
            Ok((y, back))
        })?;
        // Under no_grad too the statistics were computed and the running
        // ones move.
        if let Some((mean, var, n)) = stats {
            let f = |v: Vec<f64>| Tensor::from_vec(v, c, x.device())?.to_dtype(DType::F32);
            self.update_running(&f(mean)?, &f(var)?, n)?;
        }
        Ok(y)
    }

    /// Σ over (batch, height, width) per channel, (1, C, 1, 1); over the
    /// group's ranks when there is one.
    fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let s = t.sum_keepdim(3)?.sum_keepdim(2)?.sum_keepdim(0)?;
        match &self.group {
            Some(g) => allreduce(g, &s, ReduceOp::Sum),
            None => Ok(s),
        }
    }

    fn update_running(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let c = self.channels();
        let m = self.momentum;
        let unbiased = n as f64 / (n.max(2) - 1) as f64;
        let mut r = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let mean = mean.detach().reshape(c)?.to_dtype(r.0.dtype())?;
        let var = (var.detach().reshape(c)?.to_dtype(r.1.dtype())? * unbiased)?;
        let new_mean = ((&r.0 * (1.0 - m))? + (mean * m)?)?;
        let new_var = ((&r.1 * (1.0 - m))? + (var * m)?)?;
        *r = (new_mean, new_var);
        Ok(())
    }
}

/// Whether the fused CPU op serves x: f32 on the CPU with the fast kernels.
fn fused(x: &Tensor) -> bool {
    crate::kernels::fast(x.device()) && x.dtype() == DType::F32
}

/// Training-mode batch normalisation as one op (per channel: two passes for
/// the statistics, one for y; backward one pass for the sums, one for dx).
struct FusedOp {
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
fn f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// `f` on the f32 elements of a contiguous CPU tensor, read in place.
fn with_f32s<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(v)) = &*storage else {
        candle_core::bail!("shardnet BatchNorm2d: the fused op takes f32 on the CPU");
    };
    f(crate::kernels::view(v, layout, "BatchNorm2d")?)
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
fn add_grad(p: &Param, v: Vec<f32>) -> Result<()> {
    p.update_grad(move |buf, empty| {
        for (d, s) in buf.iter_mut().zip(&v) {
            *d = if empty { *s } else { *d + s };
        }
        Ok(())
    })
}

/// Per channel (scale, shift) in f32: y = x·scale + shift.
type Affine = (Vec<f32>, Vec<f32>);

/// The normalisation as an affine map per channel: scale = γ/√(σ² + ε),
/// shift = β − μ·scale (computed in f64, then rounded).
fn affine(mean: &[f64], var: &[f64], gamma: &[f32], beta: &[f32], eps: f64) -> Affine {
    (0..mean.len())
        .map(|ch| {
            let inv = 1.0 / (var[ch] + eps).sqrt();
            let scale = (inv * gamma[ch] as f64) as f32;
            let shift = (beta[ch] as f64 - mean[ch] * inv * gamma[ch] as f64) as f32;
            (scale, shift)
        })
        .unzip()
}

/// v summed over the group's ranks, in f64.
fn allreduce_f64(comm: &crate::comm::Communicator, v: Vec<f64>) -> Result<Vec<f64>> {
    let len = v.len();
    let t = Tensor::from_vec(v, len, &crate::comm::HOST)?;
    Ok(comm.allreduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?)
}

/// Σ f(a[i], b[i]) (K sums at once) in f64 over 8 interleaved partial
/// sums — independent adds that pipeline and vectorise, where one running
/// sum waits on each add's latency — combined in a fixed order (the same
/// result on every run), the tail after.
#[inline(always)]
fn sum8<const K: usize>(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> [f64; K]) -> [f64; K] {
    let mut acc = [[0f64; 8]; K];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            let v = f(x[l], y[l]);
            for k in 0..K {
                acc[k][l] += v[k];
            }
        }
    }
    let mut out = [0f64; K];
    for k in 0..K {
        let a = &acc[k];
        out[k] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
    for (x, y) in ta.iter().zip(tb) {
        let v = f(*x, *y);
        for k in 0..K {
            out[k] += v[k];
        }
    }
    out
}

/// The loops over one plane (hw values of one image and channel), each
/// compiled for the CPU's widest vectors ([`crate::kernels::dispatch`]).
mod plane {
    use super::sum8;
    use crate::kernels::dispatch;

    /// Σ v.
    pub(super) fn sum(p: &[f32]) -> f64 {
        dispatch!(|| {
            #[inline(always)]
            fn go(p: &[f32]) -> f64 {
                sum8(p, p, |v, _| [v as f64])[0]
            }
            go(p)
        })
    }

    /// Σ (v − m)².
    pub(super) fn centred_squares(p: &[f32], m: f64) -> f64 {
        dispatch!(|| {
            #[inline(always)]
            fn go(p: &[f32], m: f64) -> f64 {
                sum8(p, p, |v, _| [(v as f64 - m) * (v as f64 - m)])[0]
            }
            go(p, m)
        })
    }

    /// out = v·a + b, then max(0, ·) with `relu`.
    pub(super) fn affine(out: &mut [f32], x: &[f32], (a, b): (f32, f32), relu: bool) {
        dispatch!(|| {
            #[inline(always)]
            fn go(out: &mut [f32], x: &[f32], (a, b): (f32, f32), relu: bool) {
                if relu {
                    for (d, v) in out.iter_mut().zip(x) {
                        *d = (v * a + b).max(0.0);
                    }
                } else {
                    for (d, v) in out.iter_mut().zip(x) {
                        *d = v * a + b;
                    }
                }
            }
            go(out, x, (a, b), relu)
        })
    }

    /// (Σ g, Σ g·(v − m)), g counted only where v·a + b > 0 with a `mask`
    /// (a, b). In sum8's lanes and order; on AVX-512 by intrinsics (the
    /// compiler keeps the masked form scalar).
    pub(super) fn grad_sums(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::simd_level() == crate::kernels::SimdLevel::Avx512 {
            // SAFETY: the CPU has AVX-512 F and VL (simd_level).
            return unsafe { grad_sums_avx512(g, v, m, mask) };
        }
        dispatch!(|| {
            #[inline(always)]
            fn go(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
                match mask {
                    Some((a, b)) => sum8(g, v, |g, v| {
                        let g = if v * a + b > 0.0 { g } else { 0.0 };
                        [g as f64, g as f64 * (v as f64 - m)]
                    }),
                    None => sum8(g, v, |g, v| [g as f64, g as f64 * (v as f64 - m)]),
                }
            }
            go(g, v, m, mask)
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn grad_sums_avx512(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
        use std::arch::x86_64::*;
        let n = g.len().min(v.len());
        let body = n / 8 * 8;
        let (mut s0, mut s1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let mv = _mm512_set1_pd(m);
        let (a, b) = mask.unwrap_or((0.0, 0.0));
        let (av, bv, zero) = (_mm256_set1_ps(a), _mm256_set1_ps(b), _mm256_setzero_ps());
        for i in (0..body).step_by(8) {
            let mut gf = _mm256_loadu_ps(g.as_ptr().add(i));
            let vf = _mm256_loadu_ps(v.as_ptr().add(i));
            if mask.is_some() {
                // v·a + b > 0 (ordered: NaN drops g), as the scalar form.
                let t = _mm256_add_ps(_mm256_mul_ps(vf, av), bv);
                gf = _mm256_maskz_mov_ps(_mm256_cmp_ps_mask::<_CMP_GT_OQ>(t, zero), gf);
            }
            let gd = _mm512_cvtps_pd(gf);
            s0 = _mm512_add_pd(s0, gd);
            s1 = _mm512_add_pd(
                s1,
                _mm512_mul_pd(gd, _mm512_sub_pd(_mm512_cvtps_pd(vf), mv)),
            );
        }
        let (mut l0, mut l1) = ([0f64; 8], [0f64; 8]);
        _mm512_storeu_pd(l0.as_mut_ptr(), s0);
        _mm512_storeu_pd(l1.as_mut_ptr(), s1);
        let tree = |a: [f64; 8]| ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        let mut out = [tree(l0), tree(l1)];
        for i in body..n {
            let (gi, vi) = (g[i], v[i]);
            let gi = match mask {
                Some((a, b)) if vi * a + b > 0.0 => gi,
                Some(_) => 0.0,
                None => gi,
            };
            out[0] += gi as f64;
            out[1] += gi as f64 * (vi as f64 - m);
        }
        out
    }

    /// out = k·g − a − (v − μ)·m (the coefficients (k, a, m) and μ of one
    /// channel), g masked as in [`grad_sums`].
    pub(super) fn input_grad(
        out: &mut [f32],
        g: &[f32],
        v: &[f32],
        coef: ((f32, f32, f64), f64),
        mask: Option<(f32, f32)>,
    ) {
        dispatch!(|| {
            #[inline(always)]
            fn go(
                out: &mut [f32],
                g: &[f32],
                v: &[f32],
                ((k, a, m), mu): ((f32, f32, f64), f64),
                mask: Option<(f32, f32)>,
            ) {
                match mask {
                    Some((sc, sh)) => {
                        for ((d, g), v) in out.iter_mut().zip(g).zip(v) {
                            let g = if v * sc + sh > 0.0 { *g } else { 0.0 };
                            *d = k * g - a - ((*v as f64 - mu) * m) as f32;
                        }
                    }
                    None => {
                        for ((d, g), v) in out.iter_mut().zip(g).zip(v) {
                            *d = k * g - a - ((*v as f64 - mu) * m) as f32;
                        }
                    }
                }
            }
            go(out, g, v, coef, mask)
        })
    }
}

/// The gradient at the fused op's output, as the backward passes read it
/// one plane (hw values) at a time.
#[derive(Clone, Copy)]
enum Dy<'a> {
    /// dy itself (B, C, H, W).
    Dense(&'a [f32]),
    /// After pooling: each plane's `per` pooled gradients and their
    /// winners' offsets; dy is g at the winners and zero elsewhere, as
    /// [`crate::nn::max_pool2d`]'s backward would write it.
    Pooled {
        g: &'a [f32],
        win: &'a [u32],
        per: usize,
    },
}

impl<'a> Dy<'a> {
    /// `g` dense, or pooled `per` to a plane with these winners.
    fn of(g: &'a [f32], win: &'a [u32], per: Option<usize>) -> Self {
        match per {
            Some(per) => Dy::Pooled { g, win, per },
            None => Dy::Dense(g),
        }
    }

    /// Plane p's hw values: a view, or expanded into `buf`.
    fn plane<'b>(&self, p: usize, hw: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            Dy::Dense(d) => &d[p * hw..(p + 1) * hw],
            Dy::Pooled { g, win, per } => {
                buf.clear();
                buf.resize(hw, 0.0);
                let at = p * per..(p + 1) * per;
                for (v, w) in g[at.clone()].iter().zip(&win[at]) {
                    buf[*w as usize] = *v;
                }
                buf
            }
        }
    }
}

/// The per-channel passes of the fused op over x (B, C, H, W) flattened:
/// channel ch is B planes of hw values, plane i at (i·C + ch)·hw. Sums
/// are in f64: each plane's by [`sum8`], the planes added in order (the
/// same on every run).
#[derive(Clone, Copy)]
struct Planes {
    b: usize,
    c: usize,
    hw: usize,
}

impl Planes {
    /// The offsets of channel ch's planes.
    fn of(self, ch: usize) -> impl Iterator<Item = usize> {
        (0..self.b).map(move |i| (i * self.c + ch) * self.hw)
    }

    /// f(ch) for every channel, split over the threads when x is large
    /// (each channel's value is computed the same way either way).
    fn per_channel<R: Send>(self, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
        use rayon::prelude::*;
        if crate::kernels::split_work(self.b * self.c * self.hw) {
            (0..self.c).into_par_iter().map(f).collect()
        } else {
            (0..self.c).map(f).collect()
        }
    }

    /// out[i] = f(image i's values of every input), image by image, split
    /// over the threads when large.
    fn per_image(self, out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync + Send) {
        use rayon::prelude::*;
        let per = (self.c * self.hw).max(1);
        if crate::kernels::split_work(out.len()) {
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(i, o)| f(i, o));
        } else {
            out.chunks_mut(per).enumerate().for_each(|(i, o)| f(i, o));
        }
    }

    /// Σ x per channel.
    fn sums(self, x: &[f32]) -> Vec<f64> {
        self.per_channel(|ch| self.of(ch).map(|o| plane::sum(&x[o..o + self.hw])).sum())
    }

    /// Σ (x − μ)² per channel.
    fn centred_squares(self, x: &[f32], mean: &[f64]) -> Vec<f64> {
        self.per_channel(|ch| {
            let m = mean[ch];
            self.of(ch)
                .map(|o| plane::centred_squares(&x[o..o + self.hw], m))
                .sum()
        })
    }

    /// y = (x − μ) / √(σ² + ε) · γ + β as x·scale + shift in f32 (the
    /// [`affine`] pair); then max(0, y) with `relu`.
    fn normalise(self, x: &[f32], (scale, shift): &Affine, relu: bool) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        let per = self.c * self.hw;
        self.per_image(&mut y, |i, out| {
            let x = &x[i * per..][..per];
            for (ch, (o, s)) in out.chunks_mut(self.hw).zip(x.chunks(self.hw)).enumerate() {
                plane::affine(o, s, (scale[ch], shift[ch]), relu);
            }
        });
        y
    }

    /// [`normalise`](Self::normalise) followed by k × k max pooling
    /// ([`crate::nn::max_pool2d`]'s windows and winner rule), without
    /// writing the activation before the pooling: (pooled y, each output's
    /// winner as its offset in its plane).
    fn normalise_pool(
        self,
        x: &[f32],
        (scale, shift): &Affine,
        relu: bool,
        (h, w, k): (usize, usize, usize),
    ) -> (Vec<f32>, Vec<u32>) {
        use rayon::prelude::*;
        let per = (h / k) * (w / k);
        let mut y = vec![0f32; self.b * self.c * per];
        let mut win = vec![0u32; y.len()];
        if per == 0 {
            return (y, win);
        }
        let image = self.c * self.hw;
        let one = |(i, (y, win)): (usize, (&mut [f32], &mut [u32]))| {
            let x = &x[i * image..][..image];
            let planes = y
                .chunks_mut(per)
                .zip(win.chunks_mut(per))
                .zip(x.chunks(self.hw));
            for (ch, ((y, win), plane)) in planes.enumerate() {
                let (a, b) = (scale[ch], shift[ch]);
                // The values normalise writes: v·a + b, then max(0, ·).
                let value = |at: usize| {
                    let v = plane[at] * a + b;
                    if relu {
                        v.max(0.0)
                    } else {
                        v
                    }
                };
                super::pool::pool_plane(value, (h, w, k), y, win);
            }
        };
        let per_image = self.c * per;
        if crate::kernels::split_work(x.len()) {
            y.par_chunks_mut(per_image)
                .zip(win.par_chunks_mut(per_image))
                .enumerate()
                .for_each(one);
        } else {
            y.chunks_mut(per_image)
                .zip(win.chunks_mut(per_image))
                .enumerate()
                .for_each(one);
        }
        (y, win)
    }

    /// (Σ dy, Σ dy·x̂) per channel, x̂ = (x − μ)·inv.
    /// With a `mask` (ReLU's, from the forward's affine pair) dy counts
    /// only where x·scale + shift > 0.
    fn grad_sums(
        self,
        x: &[f32],
        dy: Dy<'_>,
        mean: &[f64],
        inv: &[f64],
        mask: Option<&Affine>,
    ) -> (Vec<f64>, Vec<f64>) {
        self.per_channel(|ch| {
            let m = mean[ch];
            let mut buf = Vec::new();
            let [sdy, sdxm] = self.of(ch).fold([0f64; 2], |acc, o| {
                let g = dy.plane(o / self.hw.max(1), self.hw, &mut buf);
                let v = &x[o..o + self.hw];
                let s = plane::grad_sums(g, v, m, mask.map(|(a, b)| (a[ch], b[ch])));
                [acc[0] + s[0], acc[1] + s[1]]
            });
            (sdy, sdxm * inv[ch])
        })
        .into_iter()
        .unzip()
    }

    /// dx = γ·inv·(dy − Σdy/N − x̂·Σ(dy·x̂)/N), the sums over all N values
    /// of the channel (every rank's); dy masked as in [`Planes::grad_sums`].
    #[allow(clippy::too_many_arguments)]
    fn input_grad(
        self,
        x: &[f32],
        dy: Dy<'_>,
        mean: &[f64],
        inv: &[f64],
        gamma: &[f32],
        (sdy, sdyx, n): (&[f64], &[f64], f64),
        mask: Option<&Affine>,
    ) -> Vec<f32> {
        // Per channel: k = γ·inv, a = k·Σdy/N, m = k·Σ(dy·x̂)/N·inv.
        let coef: Vec<(f32, f32, f64)> = (0..self.c)
            .map(|ch| {
                let k = gamma[ch] as f64 * inv[ch];
                (
                    k as f32,
                    (k * sdy[ch] / n) as f32,
                    k * sdyx[ch] / n * inv[ch],
                )
            })
            .collect();
        let mut dx = vec![0f32; x.len()];
        let per = self.c * self.hw;
        self.per_image(&mut dx, |i, out| {
            let x = &x[i * per..][..per];
            let mut buf = Vec::new();
            for (ch, (o, v)) in out.chunks_mut(self.hw).zip(x.chunks(self.hw)).enumerate() {
                let g = dy.plane(i * self.c + ch, self.hw, &mut buf);
                let mask = mask.map(|(sc, sh)| (sc[ch], sh[ch]));
                plane::input_grad(o, g, v, (coef[ch], mean[ch]), mask);
            }
        });
        dx
    }
}

#[cfg(test)]
mod rate {
    use super::*;
    use crate::kernels::{set_simd_level, SimdLevel};

    #[test]
    #[ignore = "a timing, run by hand"]
    fn passes() {
        let p = Planes {
            b: 32,
            c: 64,
            hw: 1024,
        };
        let n = p.b * p.c * p.hw;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let dy: Vec<f32> = (0..n)
            .map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let (mean, inv) = (vec![0.01f64; p.c], vec![1.3f64; p.c]);
        let aff: Affine = (vec![1.1f32; p.c], vec![0.1f32; p.c]);
        let gamma = vec![0.9f32; p.c];
        for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
            set_simd_level(level);
            let t = |f: &mut dyn FnMut()| {
                let mut best = f64::MAX;
                for _ in 0..7 {
                    let s = std::time::Instant::now();
                    f();
                    best = best.min(s.elapsed().as_secs_f64());
                }
                best * 1e3
            };
            let a = t(&mut || drop(std::hint::black_box(p.sums(&x))));
            let b = t(&mut || drop(std::hint::black_box(p.centred_squares(&x, &mean))));
            let c = t(&mut || drop(std::hint::black_box(p.normalise(&x, &aff, true))));
            let d = t(&mut || {
                drop(std::hint::black_box(p.grad_sums(
                    &x,
                    Dy::Dense(&dy),
                    &mean,
                    &inv,
                    Some(&aff),
                )))
            });
            let sums = (vec![0.5f64; p.c], vec![0.25f64; p.c]);
            let e = t(&mut || {
                drop(std::hint::black_box(p.input_grad(
                    &x,
                    Dy::Dense(&dy),
                    &mean,
                    &inv,
                    &gamma,
                    (&sums.0, &sums.1, n as f64),
                    Some(&aff),
                )))
            });
            eprintln!(
                "{level:?}: sums {a:.2} ms, centred {b:.2}, normalise+relu {c:.2}, grad sums {d:.2}, input grad {e:.2}"
            );
        }
        set_simd_level(SimdLevel::Avx512);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Communicator, HOST};

    /// Every plane pass gives the same bits at every vector width: odd
    /// lengths (tails), values with NaN, and the ReLU mask both ways.
    #[test]
    fn plane_passes_are_the_same_at_every_simd_level() {
        for n in [1usize, 7, 8, 9, 31, 64, 1000] {
            let mut x = crate::kernels::test_values(11, n);
            if n > 3 {
                x[3] = f32::NAN;
            }
            let g = crate::kernels::test_values(12, n);
            // m not a short binary fraction: the products round (an FMA would differ).
            let (m, mask) = (0.1f64, Some((1.5f32, -0.25f32)));
            let level = |what: &str, f: &dyn Fn() -> Vec<f64>| {
                crate::kernels::assert_same_at_every_level(what, f, |r| {
                    r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                })
            };
            level("sum", &|| vec![plane::sum(&g)]);
            level("centred squares", &|| vec![plane::centred_squares(&g, m)]);
            level("grad sums, masked", &|| {
                plane::grad_sums(&g, &x, m, mask).to_vec()
            });
            level("grad sums", &|| plane::grad_sums(&g, &x, m, None).to_vec());
            for relu in [false, true] {
                level("affine", &|| {
                    let mut o = vec![0f32; n];
                    plane::affine(&mut o, &x, (1.5, -0.25), relu);
                    o.iter().map(|v| *v as f64).collect()
                });
            }
            for mask in [None, mask] {
                level("input grad", &|| {
                    let mut o = vec![0f32; n];
                    plane::input_grad(&mut o, &g, &x, ((0.5, 0.25, 0.75), m), mask);
                    o.iter().map(|v| *v as f64).collect()
                });
            }
        }
    }
    use crate::nn::{max_pool2d, relu};
    use candle_core::Var;

    /// How the layer runs: alone, or across the ranks of `group`; batch
    /// norm then ReLU as two layers or as `forward_relu`; the pooling after
    /// as its own layer or in `forward_relu_pool` (with `fused_relu`).
    #[derive(Clone, Copy)]
    struct How<'a> {
        group: Option<&'a Communicator>,
        fused_relu: bool,
        fused_pool: bool,
    }

    /// y and every gradient of batch norm → ReLU → max pooling on `x`
    /// (the window k from the sizes of x and g).
    fn run(x: &Tensor, g: &Tensor, how: How) -> Result<Vec<Vec<f32>>> {
        let k = x.dims()[2] / g.dims()[2];
        let store = ParamStore::new(&HOST, 7);
        let mut bn = BatchNorm2d::new(&store, "bn", x.dims()[1])?;
        if let Some(c) = how.group {
            bn = bn.multi_node(Context::new(c));
        }
        let xv = Var::from_tensor(x)?;
        let y = if how.fused_pool {
            bn.forward_relu_pool(xv.as_tensor(), true, k)?
        } else if how.fused_relu {
            max_pool2d(&bn.forward_relu(xv.as_tensor(), true)?, k)?
        } else {
            max_pool2d(&relu(&bn.forward(xv.as_tensor(), true)?)?, k)?
        };
        let grads = y.mul(g)?.sum_all()?.backward()?;
        let dx = grads.get(xv.as_tensor()).cloned();
        let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        let missing = || Error::Usage("no gradient".into());
        Ok(vec![
            flat(&y)?,
            flat(&dx.ok_or_else(missing)?)?,
            flat(bn.weight.grad().ok_or_else(missing)?)?,
            flat(bn.bias.grad().ok_or_else(missing)?)?,
        ])
    }

    fn same(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
        for (name, (p, q)) in ["y", "dx", "dγ", "dβ"].iter().zip(a.iter().zip(b)) {
            assert!(
                p.len() == q.len() && p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits()),
                "{name} differs: {what}"
            );
        }
    }

    fn inputs() -> Result<(Tensor, Tensor)> {
        // Large enough to split over threads (kernels::split_work), odd
        // sizes, about half the values below zero after normalisation.
        Ok((
            Tensor::randn(0.5f32, 2.0, (5, 24, 18, 18), &HOST)?,
            Tensor::randn(0f32, 1.0, (5, 24, 9, 9), &HOST)?,
        ))
    }

    #[test]
    fn passes_split_over_threads_equal_one_thread_bit_for_bit() -> Result<()> {
        if !crate::kernels::fast(&HOST) {
            return Ok(());
        }
        let (x, g) = inputs()?;
        if candle_core::utils::get_num_threads() < 2 {
            println!("one thread here: the split passes are not exercised");
        }
        for (fused_relu, fused_pool) in [(false, false), (true, false), (true, true)] {
            let how = How {
                group: None,
                fused_relu,
                fused_pool,
            };
            let split = run(&x, &g, how)?;
            let one = crate::kernels::serial(|| run(&x, &g, how))?;
            same(
                &split,
                &one,
                &format!("split vs one thread, fused ReLU {fused_relu}"),
            );
        }
        Ok(())
    }

    /// (fused, two layers) on x, alone or across `group`.
    type Pair = (Vec<Vec<f32>>, Vec<Vec<f32>>);
    fn fused_and_two(x: &Tensor, g: &Tensor, group: Option<&Communicator>) -> Result<Pair> {
        let how = |fused_relu| How {
            group,
            fused_relu,
            fused_pool: false,
        };
        Ok((run(x, g, how(true))?, run(x, g, how(false))?))
    }

    /// Batch norm, ReLU and the pooling as one op against the three layers,
    /// bit for bit: y, dx, dγ, dβ; windows of 2 and 3, sizes they divide
    /// and sizes they do not (the last rows and columns dropped), one rank
    /// and two thread ranks with their own images (the group's path).
    #[test]
    fn pooling_fused_into_batch_norm_equals_the_three_layers_bit_for_bit() -> Result<()> {
        for (h, w, k) in [(18, 18, 2), (19, 17, 2), (19, 17, 3), (4, 4, 4)] {
            let x = Tensor::randn(0.5f32, 2.0, (5, 24, h, w), &HOST)?;
            let g = Tensor::randn(0f32, 1.0, (5, 24, h / k, w / k), &HOST)?;
            fn pair(x: &Tensor, g: &Tensor, group: Option<&Communicator>) -> Result<Pair> {
                // One op, or batch norm, ReLU and pooling as three layers.
                let how = |fused_pool: bool| How {
                    group,
                    fused_relu: false,
                    fused_pool,
                };
                Ok((run(x, g, how(true))?, run(x, g, how(false))?))
            }
            let (one, three) = pair(&x, &g, None)?;
            same(&one, &three, &format!("one rank, {h}×{w}, k {k}"));
            let rows = [0..3, 3..5];
            let per_rank = crate::comm::run("local", 2, |c| {
                let r = rows[c.rank()].clone();
                let mine = |t: &Tensor| t.narrow(0, r.start, r.len());
                pair(&mine(&x)?, &mine(&g)?, Some(&c))
            })?;
            for (r, (one, three)) in per_rank.iter().enumerate() {
                same(one, three, &format!("rank {r} of 2, {h}×{w}, k {k}"));
            }
        }
        Ok(())
    }

    #[test]
    fn relu_fused_into_batch_norm_equals_the_two_layers_bit_for_bit() -> Result<()> {
        let (x, g) = inputs()?;
        let (one, two) = fused_and_two(&x, &g, None)?;
        same(&one, &two, "one rank");
        // Across 2 thread ranks, each with its own images (3 and 2).
        let rows = [0..3, 3..5];
        let per_rank = crate::comm::run("local", 2, |c| {
            let r = rows[c.rank()].clone();
            let mine = |t: &Tensor| t.narrow(0, r.start, r.len());
            fused_and_two(&mine(&x)?, &mine(&g)?, Some(&c))
        })?;
        for (r, (one, two)) in per_rank.iter().enumerate() {
            same(one, two, &format!("rank {r} of 2"));
        }
        Ok(())
    }
}
