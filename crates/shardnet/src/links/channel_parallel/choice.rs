//! [`ChannelConv2d`]: one of the channel-parallel layers, or the whole
//! convolution, chosen by a [`ChannelSplit`]: what a model holds where a
//! `Conv2d` stands.

use super::common::{given, seeded, Spec};
use super::config::{ChannelSplit, ConvConfig};
use super::grouped::ParallelConvolution2D;
use super::input::InputParallelConv2d;
use super::output::OutputParallelConv2d;
use crate::functions::Context;
use crate::links::Features;
use crate::nn::{Conv2d, Param, ParamStore, WeightsFrom, Whole};
use crate::Result;
use candle_core::Tensor;

/// Any of the above, or the whole convolution: what a model holds where a
/// [`Conv2d`] stands, chosen by a [`ChannelSplit`].
#[derive(Clone)]
pub enum ChannelConv2d {
    /// The whole convolution on every rank.
    Whole(Conv2d),
    /// [`ParallelConvolution2D`].
    Grouped(ParallelConvolution2D),
    /// [`OutputParallelConv2d`].
    Output(OutputParallelConv2d),
    /// [`InputParallelConv2d`].
    Input(InputParallelConv2d),
}

impl ChannelConv2d {
    /// `cin` → `cout` channels as `cfg` says, split as `split` over the
    /// ranks of `ctx`, its parameters in `store` (scope it:
    /// `store.pp("conv1")`). The whole convolution takes the same initial
    /// values as the exact splits.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        split: ChannelSplit,
        ch: (usize, usize),
        cfg: ConvConfig,
    ) -> Result<Self> {
        Ok(match split {
            ChannelSplit::None => {
                let s = Spec {
                    cin: ch.0,
                    cout: ch.1,
                    k: cfg.kernel,
                };
                Self::whole_conv(store, &s, seeded(&s, &cfg), cfg.stride, cfg.padding)?
            }
            ChannelSplit::Grouped => {
                ChannelConv2d::Grouped(ParallelConvolution2D::new(ctx, store, ch, cfg)?)
            }
            ChannelSplit::Output => {
                ChannelConv2d::Output(OutputParallelConv2d::new(ctx, store, ch, cfg)?)
            }
            ChannelSplit::Input => {
                ChannelConv2d::Input(InputParallelConv2d::new(ctx, store, ch, cfg)?)
            }
        })
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O), the
    /// same on every rank, split as `split` (each form's `from_weights`).
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        split: ChannelSplit,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        Ok(match split {
            ChannelSplit::None => {
                let s = given("ChannelConv2d::from_weights", weight, bias)?;
                Self::whole_conv(
                    store,
                    &s,
                    WeightsFrom::Given { weight, bias },
                    stride,
                    padding,
                )?
            }
            ChannelSplit::Grouped => ChannelConv2d::Grouped(ParallelConvolution2D::from_weights(
                ctx, store, weight, bias, stride, padding,
            )?),
            ChannelSplit::Output => ChannelConv2d::Output(OutputParallelConv2d::from_weights(
                ctx, store, weight, bias, stride, padding,
            )?),
            ChannelSplit::Input => ChannelConv2d::Input(InputParallelConv2d::from_weights(
                ctx,
                store,
                weight,
                bias,
                stride,
                padding,
                Features::Whole,
            )?),
        })
    }

    fn whole_conv(
        store: &ParamStore,
        s: &Spec,
        src: WeightsFrom,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let (w, b) = src.params(&s.shape());
        let weight = w.build(store)?;
        let bias = b.map(|b| b.build(store)).transpose()?;
        Ok(ChannelConv2d::Whole(Conv2d::new(
            weight, bias, stride, padding,
        )?))
    }

    /// The whole weight and bias and their gradients on rank `root` (every
    /// rank with `None`), whichever the split (each form's `whole`; the
    /// whole convolution's own on root). Collective.
    pub fn whole(&self, ctx: &Context, root: Option<usize>) -> Result<Option<Whole>> {
        match self {
            ChannelConv2d::Whole(c) => Whole::gather(ctx, c.weight(), c.bias(), root),
            ChannelConv2d::Grouped(c) => c.whole(root),
            ChannelConv2d::Output(c) => c.whole(root),
            ChannelConv2d::Input(c) => c.whole(root),
        }
    }

    /// y for the replicated x.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            ChannelConv2d::Whole(c) => c.forward(x),
            ChannelConv2d::Grouped(c) => c.forward(x),
            ChannelConv2d::Output(c) => c.forward(x),
            ChannelConv2d::Input(c) => c.forward(x),
        }
    }

    /// Its parameters on this rank.
    pub fn params(&self) -> Vec<Param> {
        match self {
            ChannelConv2d::Whole(c) => c.params(),
            ChannelConv2d::Grouped(c) => c.params(),
            ChannelConv2d::Output(c) => c.params(),
            ChannelConv2d::Input(c) => c.params(),
        }
    }
}

crate::nn::candle_module!(ChannelConv2d);
