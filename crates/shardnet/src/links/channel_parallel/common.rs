//! What the channel-parallel layers share: one convolution's shape
//! ([`Spec`]), the blocks of a layer's global weight and bias drawn from its
//! seed, the check of a user's whole weights, and the input's channel
//! check.

use super::config::{ConvConfig, KernelSize};
use crate::nn::{init, ParamStore};
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

/// The block (rows × input channels) of layer `layer`'s global weight
/// (cout, cin·kh·kw), as (rows, channels, kh, kw), with bound 1/√fan_in.
pub(super) fn weight_block(
    store: &ParamStore,
    layer: usize,
    s: &Spec,
    rows: std::ops::Range<usize>,
    channels: std::ops::Range<usize>,
    fan_in: usize,
) -> Result<Tensor> {
    let kk = s.kk();
    let seed = init::layer_seed(store.seed(), layer, 0);
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let (r, c) = (rows.len(), channels.len());
    let cols = channels.start * kk..channels.end * kk;
    init::uniform_block(seed, rows, cols, s.cin * kk, bound, store.device())?
        .reshape((r, c, s.k.h, s.k.w))
        .map_err(Into::into)
}

/// Rows `rows` of layer `layer`'s global bias (cout), bound 1/√fan_in.
pub(super) fn bias_block(
    store: &ParamStore,
    layer: usize,
    rows: std::ops::Range<usize>,
    fan_in: usize,
    cfg: &ConvConfig,
) -> Result<Option<Tensor>> {
    if !cfg.bias {
        return Ok(None);
    }
    let seed = init::layer_seed(store.seed(), layer, 1);
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let n = rows.len();
    Ok(Some(
        init::uniform_block(seed, rows, 0..1, 1, bound, store.device())?.reshape(n)?,
    ))
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

/// Rows `rows` of a whole bias, if any.
pub(super) fn bias_rows(
    b: Option<&Tensor>,
    rows: &std::ops::Range<usize>,
) -> Result<Option<Tensor>> {
    b.map(|b| Ok(b.narrow(0, rows.start, rows.len())?.contiguous()?))
        .transpose()
}

pub(super) fn channels(name: &str, x: &Tensor, want: usize) -> Result<()> {
    match x.dims() {
        [_, c, _, _] if *c == want => Ok(()),
        d => Err(Error::Usage(format!(
            "{name}: input of shape {d:?}, expected (batch, {want}, height, width)"
        ))),
    }
}
