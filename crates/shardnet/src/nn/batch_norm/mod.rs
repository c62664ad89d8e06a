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
//! Communication per training call on the CPU's fused path: one allgather of
//! 2C + 1 values (each rank's count, Σx and Σ(x − x̄)² about its own mean,
//! merged in rank order) and, in the backward, one allreduce of 2C; on the
//! generic path, the count and two allreduces of C values forward and their
//! mirrors backward. Ranks may hold different batch sizes, even none.
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

mod op;
#[cfg(test)]
mod tests;

use super::{Init, Param, ParamStore, ShardedParam};
use crate::comm::ReduceOp;
use crate::functions::{allreduce, backward, communicating, Context};
use crate::kernels::batch_norm::{affine, Dy, Planes};
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use op::{add_grad, allgather_f64, allreduce_f64, f32s, fused, merge, with_f32s, FusedOp, Part};
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
        let weight =
            store
                .pp(name)
                .add("weight", &Tensor::ones(channels, DType::F32, dev)?, None)?;
        let bias = store
            .pp(name)
            .add("bias", &Tensor::zeros(channels, DType::F32, dev)?, None)?;
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
        let store = store.pp(name);
        let param = |what, v| {
            ShardedParam::new(what, &[global], Init::Constant(v))
                .split_at(0, own.clone())
                .build(&store)
        };
        Self::from_params(param("weight", 1.0)?, param("bias", 0.0)?)
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
                name: format!("{}{layer}.running_{what}", super::BUFFER_PREFIX),
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
            if x.elem_count() == 0 {
                return self.empty_in_group(x, &mean, n);
            }
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

    /// Training on a rank of the group that holds no images, given the
    /// group's μ: the same two allreduces as its peers, forward and
    /// backward, in the same order. candle drops the second operand of a
    /// binary op whose result is empty (x − μ would forget μ), so the empty
    /// y is broadcast from a zero that holds μ, σ², γ, β and x in the graph,
    /// and the Σ(x − μ)² sent carries μ as the peers' does.
    fn empty_in_group(&self, x: &Tensor, mean: &Tensor, n: usize) -> Result<Tensor> {
        use crate::functions::zero_of;
        let local = x.sum_keepdim(3)?.sum_keepdim(2)?.sum_keepdim(0)?;
        let var = (self.sum(&local.broadcast_add(&zero_of(mean)?)?)? / n as f64)?;
        self.update_running(mean, &var, n)?;
        let zero = (zero_of(mean)? + zero_of(&var)?)?;
        let zero = ((zero + zero_of(&self.weight.tracked()?)?)? + zero_of(&self.bias.tracked()?)?)?;
        Ok((zero + zero_of(x)?)?.broadcast_as(x.shape())?)
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
        let op = FusedOp::new((&self.weight, &self.bias), self.eps, (relu, pool), &stats);
        let y = x.contiguous()?.apply_op1(op)?;
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
    /// sums exchanged in f64 between them, one message each way (forward:
    /// every rank's count, Σx and Σ(x − x̄)² about its own mean gathered
    /// and merged, as PyTorch's `SyncBatchNorm` gathers each rank's mean,
    /// inverse deviation and count; backward: Σdy and Σdy·x̂ allreduced), so every rank
    /// normalises with the whole batch's statistics. dγ and dβ get this
    /// rank's sums (data parallelism sums them over the ranks).
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
        // x and dy are read where they lie, as the one-rank op reads them
        // (no copy of either).
        let y = communicating(group, "batch norm", &x, || {
            with_f32s(&x, |xs| {
                // This rank's count, Σx and Σ(x − x̄)² about its own mean,
                // every rank's gathered in one message and merged
                // ([`merge`]): one wait for the peers, not two.
                let local = (b * pl.hw) as f64;
                let sums = pl.sums(xs);
                let own: Vec<f64> = sums.iter().map(|s| s / local.max(1.0)).collect();
                let mut mine = Vec::with_capacity(2 * c + 1);
                mine.push(local);
                mine.extend(&sums);
                mine.extend(pl.centred_squares(xs, &own));
                let what = format!("BatchNorm2d {name}: the batch statistics of {c} channels");
                let all = allgather_f64(&comm, mine, &what)?;
                // One row per rank (the allgather checked every length).
                let rows: Vec<&[f64]> = all.chunks_exact(2 * c + 1).collect();
                let n: f64 = rows.iter().map(|r| r[0]).sum();
                if n == 0.0 {
                    return Err(Error::Usage(format!(
                        "BatchNorm2d {name}: batch statistics of an empty batch (no rank of the \
                         group holds an image)"
                    )));
                }
                let (mean, var): (Vec<f64>, Vec<f64>) = (0..c)
                    .map(|ch| {
                        let parts = rows.iter().map(move |r| Part {
                            n: r[0],
                            sum: r[1 + ch],
                            m2: r[1 + c + ch],
                        });
                        let (_, mean, m2) = merge(parts);
                        (mean, m2 / n)
                    })
                    .unzip();
                let gamma = f32s(gamma_p.value())?;
                let affine = affine(&mean, &var, &gamma, &f32s(beta_p.value())?, eps);
                let (y, winners) = match pool {
                    Some(k) => {
                        let (y, win) = pl.normalise_pool(xs, &affine, relu, (h, w, k));
                        (Tensor::from_vec(y, (b, c, h / k, w / k), x.device())?, win)
                    }
                    None => {
                        let y = pl.normalise(xs, &affine, relu);
                        (Tensor::from_vec(y, (b, c, h, w), x.device())?, Vec::new())
                    }
                };
                let mask = relu.then_some(affine);
                let inv: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
                stats = Some((mean.clone(), var, n as usize));
                let x = x.clone();
                let (comm, gamma_p, beta_p) = (comm.clone(), gamma_p.clone(), beta_p.clone());
                let back = backward(move |g| {
                    let g = g.contiguous()?;
                    with_f32s(&x, |xs| {
                        with_f32s(&g, |g| {
                            let dy = Dy::of(g, &winners, pool.map(|k| (h / k) * (w / k)));
                            let mask = mask.as_ref();
                            let (sdy, sdyx) = pl.grad_sums(xs, dy, &mean, &inv, mask);
                            let both = allreduce_f64(&comm, [&sdy[..], &sdyx[..]].concat())?;
                            let (gdy, gdyx) = both.split_at(c);
                            let sums = (gdy, gdyx, n);
                            let dx = pl.input_grad(xs, dy, &mean, &inv, &gamma, sums, mask);
                            add_grad(&gamma_p, sdyx.iter().map(|v| *v as f32).collect())?;
                            add_grad(&beta_p, sdy.iter().map(|v| *v as f32).collect())?;
                            Ok(Some(Tensor::from_vec(dx, (b, c, h, w), x.device())?))
                        })
                    })
                });
                Ok((y, back))
            })
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

/// Batch normalisation as a candle-nn module: `train` picks the batch's
/// statistics (and updates the running ones) or the running statistics.
impl candle_nn::ModuleT for BatchNorm2d {
    fn forward_t(&self, xs: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        Ok(BatchNorm2d::forward(self, xs, train)?)
    }
}
