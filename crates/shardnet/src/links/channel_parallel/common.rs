//! What the channel-parallel layers share: one convolution's shape
//! ([`Spec`]), its weight and bias as [`ShardedParam`]s (seeded or a
//! user's, whole until a layer splits them), the check of a user's whole
//! weights, and the input's channel check.

use super::config::{ConvConfig, KernelSize};
use crate::nn::{Init, ShardedParam};
use crate::{Error, Result};
use candle_core::Tensor;

/// The shape of one convolution: channels in and out, its kernel, stride
/// and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Spec {
    pub(super) cin: usize,
    pub(super) cout: usize,
    pub(super) k: KernelSize,
}

impl Spec {
    pub(super) fn kk(&self) -> usize {
        self.k.h * self.k.w
    }
}

/// Where a convolution's weight and bias come from: seeded (the layer's
/// index, the bound's fan-in, with a bias or not) or a user's whole
/// tensors.
#[derive(Clone, Copy)]
pub(super) enum Source<'a> {
    Seeded {
        layer: usize,
        fan_in: usize,
        bias: bool,
    },
    Given {
        weight: &'a Tensor,
        bias: Option<&'a Tensor>,
    },
}

impl Source<'_> {
    /// Seeded as `cfg` says, with the whole convolution's fan-in.
    pub(super) fn seeded(s: &Spec, cfg: &ConvConfig) -> Source<'static> {
        Source::Seeded {
            layer: cfg.layer,
            fan_in: s.cin * s.kk(),
            bias: cfg.bias,
        }
    }
}

/// The weight (O, C, kh, kw) and bias (O) of `s` from `src`, whole: each
/// layer splits them its way.
pub(super) fn conv_params<'a>(
    s: &Spec,
    src: Source<'a>,
) -> (ShardedParam<'a>, Option<ShardedParam<'a>>) {
    let shape = [s.cout, s.cin, s.k.h, s.k.w];
    match src {
        Source::Seeded {
            layer,
            fan_in,
            bias,
        } => (
            ShardedParam::new("weight", &shape, Init::fan_in(layer, 0, fan_in)),
            bias.then(|| ShardedParam::new("bias", &[s.cout], Init::fan_in(layer, 1, fan_in))),
        ),
        Source::Given { weight, bias } => (
            ShardedParam::new("weight", &shape, Init::Whole(weight)),
            bias.map(|b| ShardedParam::new("bias", &[s.cout], Init::Whole(b))),
        ),
    }
}

/// The spec of a user's whole weight (O, C, kh, kw) and bias (O), checked.
pub(super) fn given(name: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<Spec> {
    let [cout, cin, kh, kw] = weight.dims()[..] else {
        return Err(Error::Usage(format!(
            "{name}: a whole weight of shape {:?}; expected (out channels, in channels, \
             kernel height, kernel width)",
            weight.dims()
        )));
    };
    crate::nn::check_bias(name, bias, cout)?;
    Ok(Spec {
        cin,
        cout,
        k: KernelSize { h: kh, w: kw },
    })
}

pub(super) fn channels(name: &str, x: &Tensor, want: usize) -> Result<()> {
    match x.dims() {
        [_, c, _, _] if *c == want => Ok(()),
        d => Err(Error::Usage(format!(
            "{name}: input of shape {d:?}, expected (batch, {want}, height, width)"
        ))),
    }
}
