//! The exact convolution with its input channels split
//! ([`InputParallelConv2d`]): scatter-to, conv, reduce-from, + b; or on
//! sharded input, reduce-scatter to sharded output.

use super::common::{channels, given, seeded, Spec};
use super::config::ConvConfig;
use crate::comm::chunk_range;
use crate::functions::{allreduce_replicated, reduce_scatter_of, split_to_shards, Context};
use crate::links::Features;
use crate::nn::{Conv2d, Param, ParamStore, WeightsFrom, Whole};
use crate::{ReduceOp, Result};
use candle_core::Tensor;

/// The exact convolution with its input channels split (see the module
/// doc).
#[derive(Clone)]
pub struct InputParallelConv2d {
    ctx: Context,
    /// This rank's input channels of W (O, C_r, k, k), no bias.
    pub conv: Conv2d,
    /// b: (O), whole on every rank; (O_r), this rank's chunk, in the sharded
    /// form ([`Self::new_sharded`]).
    pub bias: Option<Param>,
    in_channels: usize,
    sharded: bool,
}

impl InputParallelConv2d {
    /// `cin` → `cout` channels as `cfg` says, its `weight` and `bias` in
    /// `store` (scope it: `store.pp("conv1")`): this rank's input chunk of
    /// the global weight, the whole bias.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        ch: (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        Self::seeded(ctx, store, ch, cfg, false)
    }

    /// The layer on channel-sharded activations: its input is already this
    /// rank's chunk C_r (B, C_r, H, W), and the partial outputs are summed
    /// by a reduce-scatter that leaves each rank its chunk O_r
    /// (B, O_r, Ho, Wo) — exactly the input chunk of a next such layer with
    /// O input channels; the bias is sharded the same way. Per-channel
    /// layers between two of them run on 1/n of the channels, and no
    /// allgather is needed until the activations leave the chain. Forward:
    /// reduce-scatter of y (≈ y·(n−1)/n); backward: allgather of dy
    /// (≈ y·(n−1)/n).
    pub fn new_sharded(
        ctx: &Context,
        store: &ParamStore,
        ch: (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        Self::seeded(ctx, store, ch, cfg, true)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank: rank r keeps input channels C_r of the
    /// weight, and the whole bias (its chunk O_r when `output` is
    /// [`Features::Sharded`], the form of [`Self::new_sharded`]).
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
        output: Features,
    ) -> Result<Self> {
        let s = given("InputParallelConv2d::from_weights", weight, bias)?;
        let src = WeightsFrom::Given { weight, bias };
        let sharded = output == Features::Sharded;
        Self::build(ctx, store, &s, src, (stride, padding), sharded)
    }

    fn seeded(
        ctx: &Context,
        store: &ParamStore,
        (cin, cout): (usize, usize),
        cfg: ConvConfig,
        sharded: bool,
    ) -> Result<Self> {
        let s = Spec {
            cin,
            cout,
            k: cfg.kernel,
        };
        let src = seeded(&s, &cfg);
        Self::build(ctx, store, &s, src, (cfg.stride, cfg.padding), sharded)
    }

    fn build(
        ctx: &Context,
        store: &ParamStore,
        s: &Spec,
        src: WeightsFrom,
        (stride, padding): (usize, usize),
        sharded: bool,
    ) -> Result<Self> {
        let (n, r) = (ctx.size(), ctx.rank());
        let (w, b) = src.params(&s.shape());
        let weight = w.split(1, n, r).build(store)?;
        let bias = b
            .map(|b| if sharded { b.split(0, n, r) } else { b }.build(store))
            .transpose()?;
        Ok(InputParallelConv2d {
            ctx: ctx.clone(),
            conv: Conv2d::new(weight, None, stride, padding)?,
            bias,
            in_channels: s.cin,
            sharded,
        })
    }

    /// The whole weight (O, C, kh, kw) and bias (O) and their gradients, on
    /// rank `root` (every rank with `None`; `None` on the others).
    /// Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.ctx, self.conv.weight(), self.bias.as_ref(), root)
    }

    /// Its parameters on this rank.
    pub fn params(&self) -> Vec<Param> {
        self.conv
            .params()
            .into_iter()
            .chain(self.bias.clone())
            .collect()
    }

    /// y (B, O, Ho, Wo) for the replicated x (B, C, H, W); in the sharded
    /// form ([`Self::new_sharded`]), y_r (B, O_r, Ho, Wo) for x_r (B, C_r, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.sharded {
            let mine = chunk_range(self.in_channels, self.ctx.size(), self.ctx.rank());
            channels("InputParallelConv2d (sharded input)", x, mine.len())?;
            // The partial sums (every output channel: whole-sized) are
            // freed once reduced; backward keeps x_r alone.
            let need_dx = x.track_op();
            let y = reduce_scatter_of(&self.ctx, x, ReduceOp::Sum, 1, |x| {
                let (y, conv) = self.conv.forward_apart(x)?;
                Ok((y, move |dy: &Tensor| conv.backward(dy, need_dx)))
            })?;
            return match &self.bias {
                Some(b) => {
                    let o = b.value().dims()[0];
                    Ok(y.broadcast_add(&b.tracked()?.reshape((1, o, 1, 1))?)?)
                }
                None => Ok(y),
            };
        }
        channels("InputParallelConv2d", x, self.in_channels)?;
        let mine = split_to_shards(&self.ctx, x, 1)?;
        let y = allreduce_replicated(&self.ctx, &self.conv.forward(&mine)?, ReduceOp::Sum)?;
        match &self.bias {
            Some(b) => {
                let o = b.value().dims()[0];
                Ok(y.broadcast_add(&b.tracked()?.reshape((1, o, 1, 1))?)?)
            }
            None => Ok(y),
        }
    }
}

crate::nn::candle_module!(InputParallelConv2d);
