//! What the channel-parallel layers share: one convolution's shape
//! ([`Spec`]), a seeded layer's [`WeightsFrom`], the check of a user's
//! whole weights, and the input's channel check.

use super::config::{ConvConfig, KernelSize};
use crate::nn::WeightsFrom;
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

    /// The weight's global shape (O, C, kh, kw).
    pub(super) fn shape(&self) -> [usize; 4] {
        [self.cout, self.cin, self.k.h, self.k.w]
    }
}

/// Seeded as `cfg` says, with the whole convolution's fan-in.
pub(super) fn seeded(s: &Spec, cfg: &ConvConfig) -> WeightsFrom<'static> {
    WeightsFrom::Seeded {
        layer: cfg.layer,
        fan_in: s.cin * s.kk(),
        bias: cfg.bias,
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
