//! The exact convolution with its input channels split
//! ([`InputParallelConv2d`]): scatter-to, conv, reduce-from, + b; or on
//! sharded input, reduce-scatter to sharded output.

use super::common::{bias_block, bias_rows, channels, given, weight_block, Spec};
use super::config::ConvConfig;
use crate::comm::chunk_range;
use crate::functions::{allreduce_replicated, reduce_scatter, split_to_shards, Context};
use crate::links::Features;
use crate::nn::{Conv2d, Param, ParamStore, Shard, Whole};
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
    /// Layer `layer` (its seed) of `cin` → `cout` channels, a kernel of
    /// `k` (3 or (3, 5)), named `name` in `store`: this rank's input chunk
    /// of the global weight, the whole bias.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        channels: (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        Self::seeded(ctx, store, name, layer, channels, cfg, false)
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
        name: &str,
        layer: usize,
        channels: (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        Self::seeded(ctx, store, name, layer, channels, cfg, true)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank: rank r keeps input channels C_r of the
    /// weight, and the whole bias (its chunk O_r when `sharded`, the form
    /// of [`Self::new_sharded`]).
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
        output: Features,
    ) -> Result<Self> {
        let sharded = output == Features::Sharded;
        let s = given("InputParallelConv2d::from_weights", weight, bias)?;
        let mine = chunk_range(s.cin, ctx.size(), ctx.rank());
        let w = weight.narrow(1, mine.start, mine.len())?.contiguous()?;
        let rows = if sharded {
            chunk_range(s.cout, ctx.size(), ctx.rank())
        } else {
            0..s.cout
        };
        let b = bias_rows(bias, &rows)?;
        Self::assemble(ctx, store, name, &s, w, b, stride, padding, sharded)
    }

    fn seeded(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        (cin, cout): (usize, usize),
        cfg: ConvConfig,
        sharded: bool,
    ) -> Result<Self> {
        let s = Spec {
            cin,
            cout,
            k: cfg.kernel,
        };
        let mine = chunk_range(cin, ctx.size(), ctx.rank());
        let fan_in = cin * s.kk();
        let w = weight_block(store, layer, &s, 0..cout, mine, fan_in)?;
        let rows = if sharded {
            chunk_range(cout, ctx.size(), ctx.rank())
        } else {
            0..cout
        };
        let b = bias_block(store, layer, rows, fan_in, &cfg)?;
        Self::assemble(ctx, store, name, &s, w, b, cfg.stride, cfg.padding, sharded)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        s: &Spec,
        w: Tensor,
        b: Option<Tensor>,
        stride: usize,
        padding: usize,
        sharded: bool,
    ) -> Result<Self> {
        let (shard, _) = Shard::balanced(1, s.cin, ctx.size(), ctx.rank());
        let weight = store.pp(name).add("weight", &w, Some(shard))?;
        let bias = match b {
            None => None,
            Some(b) if !sharded => Some(store.pp(name).add("bias", &b, None)?),
            Some(b) => {
                let (shard, _) = Shard::balanced(0, s.cout, ctx.size(), ctx.rank());
                Some(store.pp(name).add("bias", &b, Some(shard))?)
            }
        };
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
            let y = reduce_scatter(&self.ctx, &self.conv.forward(x)?, ReduceOp::Sum, 1)?;
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
