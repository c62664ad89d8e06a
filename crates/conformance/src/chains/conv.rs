//! The channel-parallel chains: the one-device convolution from its
//! definition ([`reference_conv2d`]), each layer's form and how it is built
//! on a rank, and the chain run against one device in f64.

use super::common::{close_slice, grad_of, param_grad, SEED, TOL};
use crate::autograd::{close, seeded, weighted};
use crate::channel_parallel::own_channels;
use crate::{fail, miss};
use candle_core::{DType, Tensor, Var};
use shardnet::comm::chunk_range;
use shardnet::functions::{allgather_replicated, split_to_shards, Context};
use shardnet::links::{
    ChannelConv2d, ChannelSplit, ConvConfig, Features, InputParallelConv2d, KernelSize,
    OutputParallelConv2d, ParallelConvolution2D,
};
use shardnet::nn::{Param, ParamStore, Whole};
use shardnet::Result;

const B: usize = 2;
/// The input's side: 7 high, 6 wide.
const H: usize = 7;
const W: usize = 6;
/// Channel widths through a chain: 3 → 5 → 2 → 6 (2 leaves ranks 2 and 3
/// of 4 without channels).
const WIDTHS: [usize; 4] = [3, 5, 2, 6];
/// (kernel, stride, padding) of the layers: 7×6 → 7×7 → 4×4 (remainders
/// 1 and 0) → 4×2.
const CONVS: [((usize, usize), usize, usize); 3] = [((3, 2), 1, 1), ((2, 3), 2, 1), ((1, 3), 1, 0)];

/// The one-device 2-D convolution from its definition, in any dtype:
/// y = Σ_{i,j} W[:, :, i, j] · x_pad[:, :, i + s·oy, j + s·ox] (+ b),
/// x (B, C, H, W), W (O, C, kh, kw). Differentiable in x, W and b by
/// candle's index-select, matmul and broadcast backward.
pub fn reference_conv2d(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: usize,
    pad: usize,
) -> Result<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let (o, _, kh, kw) = w.dims4()?;
    let (ho, wo) = (
        (h + 2 * pad - kh) / stride + 1,
        (wd + 2 * pad - kw) / stride + 1,
    );
    let xp = x.pad_with_zeros(2, pad, pad)?.pad_with_zeros(3, pad, pad)?;
    let dev = x.device();
    let mut y = Tensor::zeros((n, ho, wo, o), x.dtype(), dev)?;
    for i in 0..kh {
        let rows: Vec<u32> = (0..ho).map(|k| (i + stride * k) as u32).collect();
        let rows = Tensor::new(rows.as_slice(), dev)?;
        for j in 0..kw {
            let cols: Vec<u32> = (0..wo).map(|k| (j + stride * k) as u32).collect();
            let cols = Tensor::new(cols.as_slice(), dev)?;
            // (B, C, Ho, Wo) → (B·Ho·Wo, C) · (C, O)
            let patch = xp.index_select(&rows, 2)?.index_select(&cols, 3)?;
            let patch = patch.permute((0, 2, 3, 1))?.reshape((n * ho * wo, c))?;
            let wij = w.narrow(2, i, 1)?.narrow(3, j, 1)?.reshape((o, c))?;
            let part = patch.matmul(&wij.t()?)?.reshape((n, ho, wo, o))?;
            y = (y + part)?;
        }
    }
    let y = y.permute((0, 3, 1, 2))?;
    Ok(match b {
        Some(b) => y.broadcast_add(&b.reshape((1, o, 1, 1))?)?,
        None => y,
    })
}

/// A channel-parallel layer's form in a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Conv {
    /// A plain, replicated `Conv2d` (a user's own layer).
    Plain,
    /// ChainerMN's grouped convolution, each rank its own loss.
    Grouped,
    /// The grouped convolution with one loss on every rank.
    GroupedOneLoss,
    /// Output channels split, gathered.
    Output,
    /// Input channels split.
    Input,
    /// Output channels split, left sharded.
    OutputSharded,
    /// Input channels split, on sharded input, leaving sharded output.
    InputSharded,
}

impl Conv {
    fn takes_sharded(self) -> bool {
        self == Conv::InputSharded
    }
    fn gives_sharded(self) -> bool {
        matches!(self, Conv::OutputSharded | Conv::InputSharded)
    }
}

/// Layer k's whole weight (O, C, kh, kw) and bias, from seeds (f32).
fn given_conv(k: usize) -> Result<(Tensor, Tensor)> {
    let ((kh, kw), ..) = CONVS[k];
    let (cin, cout) = (WIDTHS[k], WIDTHS[k + 1]);
    let w = (seeded(200 + k as u64, &[cout, cin, kh, kw], DType::F32)? * 0.5)?;
    let b = (seeded(210 + k as u64, &[cout], DType::F32)? * 0.1)?;
    Ok((w, b))
}

struct ConvLayer {
    form: Conv,
    conv: ChannelConv2d,
    stride: usize,
    pad: usize,
}

fn build_conv(
    c: &Context,
    store: &ParamStore,
    k: usize,
    form: Conv,
    given: bool,
) -> Result<ConvLayer> {
    let ((kh, kw), stride, pad) = CONVS[k];
    let (cin, cout) = (WIDTHS[k], WIDTHS[k + 1]);
    let name = format!("conv{k}");
    let kernel = KernelSize { h: kh, w: kw };
    let cfg = ConvConfig {
        kernel,
        stride,
        padding: pad,
        bias: true,
        layer: k,
    };
    let weights = given_conv(k)?;
    let store = &store.pp(&name);
    let (w, b) = (&weights.0, Some(&weights.1));
    let split = match form {
        Conv::Plain => ChannelSplit::None,
        Conv::Grouped | Conv::GroupedOneLoss => ChannelSplit::Grouped,
        Conv::Output | Conv::OutputSharded => ChannelSplit::Output,
        Conv::Input | Conv::InputSharded => ChannelSplit::Input,
    };
    let conv = match form {
        Conv::InputSharded => ChannelConv2d::Input(if given {
            InputParallelConv2d::from_weights(c, store, w, b, stride, pad, Features::Sharded)?
        } else {
            InputParallelConv2d::new_sharded(c, store, (cin, cout), cfg)?
        }),
        Conv::OutputSharded => ChannelConv2d::Output(
            if given {
                OutputParallelConv2d::from_weights(c, store, w, b, stride, pad)?
            } else {
                OutputParallelConv2d::new(c, store, (cin, cout), cfg)?
            }
            .sharded_output(),
        ),
        Conv::GroupedOneLoss => ChannelConv2d::Grouped(
            if given {
                ParallelConvolution2D::from_weights(c, store, w, b, stride, pad)?
            } else {
                ParallelConvolution2D::new(c, store, (cin, cout), cfg)?
            }
            .replicated(),
        ),
        _ if given => ChannelConv2d::from_weights(c, store, split, w, b, stride, pad)?,
        _ => ChannelConv2d::new(c, store, split, (cin, cout), cfg)?,
    };
    Ok(ConvLayer {
        form,
        conv,
        stride,
        pad,
    })
}

/// (parameter, its slice of the one-device gradient) of a layer on this
/// rank, from the one-device weight and bias gradients.
fn own_params(
    c: &Context,
    l: &ConvLayer,
    dw: &Tensor,
    db: &Tensor,
) -> Result<Vec<(Param, Tensor)>> {
    let (n, r) = (c.size(), c.rank());
    let slice = |p: &Param, full: &Tensor| -> Result<Tensor> {
        Ok(match p.shard() {
            Some(s) => full.narrow(s.dim, s.offset, p.value().dims()[s.dim])?,
            None => full.clone(),
        })
    };
    Ok(match &l.conv {
        ChannelConv2d::Whole(conv) => {
            let mut v = vec![(conv.weight().clone(), dw.clone())];
            v.extend(conv.bias().map(|b| (b.clone(), db.clone())));
            v
        }
        ChannelConv2d::Grouped(g) => {
            let out = chunk_range(dw.dims()[0], n, r);
            let idx: Vec<u32> = g.channel_indices().to_vec();
            let rows = dw.narrow(0, out.start, out.len())?;
            let mine = if idx.is_empty() {
                rows.narrow(1, 0, 0)?
            } else {
                rows.index_select(&Tensor::new(idx.as_slice(), dw.device())?, 1)?
            };
            let mut v = vec![(g.conv.weight().clone(), mine)];
            if let Some(b) = g.conv.bias() {
                v.push((b.clone(), db.narrow(0, out.start, out.len())?));
            }
            v
        }
        ChannelConv2d::Output(o) => {
            let mut v = vec![(o.conv.weight().clone(), slice(o.conv.weight(), dw)?)];
            if let Some(b) = o.conv.bias() {
                v.push((b.clone(), slice(b, db)?));
            }
            v
        }
        ChannelConv2d::Input(i) => {
            let mut v = vec![(i.conv.weight().clone(), slice(i.conv.weight(), dw)?)];
            if let Some(b) = &i.bias {
                v.push((b.clone(), slice(b, db)?));
            }
            v
        }
    })
}

/// The layer's dense one-device form: a grouped convolution's weights sit
/// at (output chunk r, input channels ≡ r mod n), zeros elsewhere.
fn group_mask(n: usize, cin: usize, cout: usize, dw: &Tensor) -> Result<Tensor> {
    let mut m = vec![0f64; cout * cin];
    for r in 0..n {
        for o in chunk_range(cout, n, r) {
            for ch in (r..cin).step_by(n) {
                m[o * cin + ch] = 1.0;
            }
        }
    }
    let (.., kh, kw) = dw.dims4()?;
    let m = Tensor::from_vec(m, (cout, cin, 1, 1), dw.device())?;
    Ok(m.broadcast_as((cout, cin, kh, kw))?.contiguous()?)
}

pub(super) fn conv_chain(c: &Context, forms: &[Conv]) -> Result<()> {
    let (n, r) = (c.size(), c.rank());
    let store = ParamStore::new(c.device(), SEED);
    let given = forms.len() == 3;
    let layers = forms
        .iter()
        .enumerate()
        .map(|(k, f)| build_conv(c, &store, k, *f, given))
        .collect::<Result<Vec<_>>>()?;
    let own_losses = forms.contains(&Conv::Grouped);
    let x = Var::from_tensor(&seeded(220, &[B, WIDTHS[0], H, W], DType::F32)?)?;

    // The chain on the ranks.
    let mut h = x.as_tensor().clone();
    let mut sharded = false;
    for (k, l) in layers.iter().enumerate() {
        if k > 0 {
            h = h.tanh()?;
        }
        if sharded && !l.form.takes_sharded() {
            h = allgather_replicated(c, &h, 1)?;
        } else if !sharded && l.form.takes_sharded() {
            h = split_to_shards(c, &h, 1)?;
        }
        h = l.conv.forward(&h)?;
        sharded = l.form.gives_sharded();
    }
    if sharded {
        h = allgather_replicated(c, &h, 1)?;
    }
    let seed = |rank: usize| 230 + if own_losses { rank as u64 } else { 0 };
    let grads = weighted(&h, seed(r))?.backward()?;
    let dx = grad_of(&grads, &x)?;

    // One device, from the gathered whole weights (checked against the
    // given ones where the chain was built from them).
    let mut wholes: Vec<Whole> = Vec::new();
    for (k, l) in layers.iter().enumerate() {
        let Some(whole) = l.conv.whole(c, None)? else {
            return Err(fail("whole(None) gave nothing".into()));
        };
        if given {
            let (w, b) = given_conv(k)?;
            let w = match l.form {
                Conv::Grouped | Conv::GroupedOneLoss => {
                    let m = group_mask(n, WIDTHS[k], WIDTHS[k + 1], &w.to_dtype(DType::F64)?)?;
                    (w.to_dtype(DType::F64)? * m)?
                }
                _ => w.to_dtype(DType::F64)?,
            };
            close(&format!("layer {k}: whole weight"), &whole.weight, &w, 0.0)?;
            if let Some(got) = &whole.bias {
                close(&format!("layer {k}: whole bias"), got, &b, 0.0)?;
            }
        }
        wholes.push(whole);
    }
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let mut ws = Vec::new();
    let mut h64 = x64.as_tensor().clone();
    for (k, (l, whole)) in layers.iter().zip(&wholes).enumerate() {
        if k > 0 {
            h64 = h64.tanh()?;
        }
        let w = Var::from_tensor(&whole.weight.to_dtype(DType::F64)?)?;
        let b = match &whole.bias {
            Some(b) => b.to_dtype(DType::F64)?,
            None => Tensor::zeros(WIDTHS[k + 1], DType::F64, c.device())?,
        };
        let b = Var::from_tensor(&b)?;
        h64 = reference_conv2d(&h64, w.as_tensor(), Some(b.as_tensor()), l.stride, l.pad)?;
        ws.push((w, b));
    }
    let mut total = weighted(&h64, seed(0))?;
    if own_losses {
        for rank in 1..n {
            total = (total + weighted(&h64, seed(rank))?)?;
        }
    }
    let g = total.backward()?;

    close("output", &h, &h64, TOL)?;
    let want_dx = grad_of(&g, &x64)?;
    let want_dx = if own_losses && forms[0] == Conv::Grouped {
        own_channels(&want_dx, n, r)?
    } else {
        want_dx
    };
    close("dL/dx as this rank sees it", &dx, &want_dx, TOL)?;
    for (k, (l, (w, b))) in layers.iter().zip(&ws).enumerate() {
        let (dw, db) = (grad_of(&g, w)?, grad_of(&g, b)?);
        for (p, want) in own_params(c, l, &dw, &db)? {
            let whole = if p.name().ends_with(".bias") {
                &db
            } else {
                &dw
            };
            close_slice(
                &format!("layer {k} ({:?}): this rank's {}", l.form, p.name()),
                &param_grad(&p)?,
                &want,
                whole,
            )?;
        }
        let dense_dw = match l.form {
            Conv::Grouped | Conv::GroupedOneLoss => {
                (&dw * group_mask(n, WIDTHS[k], WIDTHS[k + 1], &dw)?)?
            }
            _ => dw.clone(),
        };
        let Some(whole) = l.conv.whole(c, Some(0))? else {
            if r == 0 {
                miss(format!("layer {k}: whole(Some(0)) gave nothing on rank 0"));
            }
            continue;
        };
        match (&whole.weight_grad, &whole.bias_grad) {
            (Some(gw), Some(gb)) => {
                close(
                    &format!("layer {k}: whole weight gradient"),
                    gw,
                    &dense_dw,
                    TOL,
                )?;
                close(&format!("layer {k}: whole bias gradient"), gb, &db, TOL)?;
            }
            _ => miss(format!("layer {k}: whole gradients missing")),
        }
    }
    Ok(())
}
