//! The exact convolution with its output channels split
//! ([`OutputParallelConv2d`]): copy-to, conv, gather-from, or left sharded.

use super::common::{channels, given, seeded, Spec};
use super::config::ConvConfig;
use crate::functions::{allgather_replicated, copy_to_shards, Context};
use crate::nn::{Conv2d, Param, ParamStore, WeightsFrom, Whole};
use crate::Result;
use candle_core::Tensor;

/// The exact convolution with its output channels split (see the module
/// doc).
#[derive(Clone)]
pub struct OutputParallelConv2d {
    ctx: Context,
    /// This rank's output channels of W (O_r, C, k, k) and b (O_r).
    pub conv: Conv2d,
    in_channels: usize,
    /// Gather the ranks' output channels (the whole y on every rank);
    /// `false` leaves each rank its chunk O_r (see [`Self::sharded_output`]).
    pub gather_output: bool,
}

impl OutputParallelConv2d {
    /// `cin` → `cout` channels as `cfg` says, its `weight` and `bias` in
    /// `store` (scope it: `store.pp("conv1")`): this rank's output chunk of
    /// the global weight and bias.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        (cin, cout): (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        let s = Spec {
            cin,
            cout,
            k: cfg.kernel,
        };
        let src = seeded(&s, &cfg);
        Self::build(ctx, store, &s, src, cfg.stride, cfg.padding)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank: rank r keeps output channels O_r.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let s = given("OutputParallelConv2d::from_weights", weight, bias)?;
        let src = WeightsFrom::Given { weight, bias };
        Self::build(ctx, store, &s, src, stride, padding)
    }

    fn build(
        ctx: &Context,
        store: &ParamStore,
        s: &Spec,
        src: WeightsFrom,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let (n, r) = (ctx.size(), ctx.rank());
        let (w, b) = src.params(&s.shape());
        let weight = w.split(0, n, r).build(store)?;
        let bias = b.map(|b| b.split(0, n, r).build(store)).transpose()?;
        Ok(OutputParallelConv2d {
            ctx: ctx.clone(),
            conv: Conv2d::new(weight, bias, stride, padding)?,
            in_channels: s.cin,
            gather_output: true,
        })
    }

    /// The whole weight (O, C, kh, kw) and bias (O) and their gradients, on
    /// rank `root` (every rank with `None`; `None` on the others).
    /// Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.ctx, self.conv.weight(), self.conv.bias(), root)
    }

    /// The same layer leaving each rank its chunk of output channels
    /// (B, O_r, Ho, Wo): per-channel layers after it (batch norm, ReLU,
    /// pooling) then run on 1/n of the channels, and one gather-from after
    /// them rebuilds the whole tensor (smaller, after a pooling).
    pub fn sharded_output(mut self) -> Self {
        self.gather_output = false;
        self
    }

    /// Its parameters on this rank.
    pub fn params(&self) -> Vec<Param> {
        self.conv.params()
    }

    /// y (B, O, Ho, Wo) for the replicated x (B, C, H, W); with
    /// [`Self::sharded_output`], this rank's channels of it (B, O_r, Ho, Wo).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        channels("OutputParallelConv2d", x, self.in_channels)?;
        // An input that needs no gradient (the images) needs no allreduce
        // of it either; every rank holds the same x, so all decide alike.
        let x = if x.track_op() {
            copy_to_shards(&self.ctx, x)?
        } else {
            x.clone()
        };
        let y = self.conv.forward(&x)?;
        if self.gather_output {
            allgather_replicated(&self.ctx, &y, 1)
        } else {
            Ok(y)
        }
    }
}

crate::nn::candle_module!(OutputParallelConv2d);
