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
use crate::functions::{allreduce, Context};
use crate::{Error, Result};
use candle_core::{DType, Tensor};
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
            .broadcast_mul(&per_channel(self.weight.value())?)?;
        Ok(x.broadcast_sub(&mean)?
            .broadcast_mul(&scale)?
            .broadcast_add(&per_channel(self.bias.value())?)?)
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
        let mean = mean.detach().reshape(c)?;
        let var = (var.detach().reshape(c)? * unbiased)?;
        let new_mean = ((&r.0 * (1.0 - m))? + (mean * m)?)?;
        let new_var = ((&r.1 * (1.0 - m))? + (var * m)?)?;
        *r = (new_mean, new_var);
        Ok(())
    }
}
