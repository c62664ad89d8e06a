//! Channel-parallel convolutions: one convolution's channels split over the
//! ranks of a communicator. Each drops in wherever a [`Conv2d`] stands:
//! every rank passes the same (replicated) input x (B, C, H, W) and gets the
//! same output y (B, O, Ho, Wo) — except the sharded forms at the end of the
//! table, which take or give a rank's own channels.
//!
//! Rank r of n holds chunk r of a channel count N: N/n channels, one more on
//! the first N mod n ranks ([`chunk_range`]; ChainerMN's `_channel_size`).
//! A rank may hold none (fewer channels than ranks).
//!
//! | layer | rank r holds | forward | backward | bytes per rank, fwd / bwd |
//! |-------|--------------|---------|----------|---------------------------|
//! | [`ParallelConvolution2D`] (ChainerMN's, grouped) | input channels r, r+n, r+2n, …; output chunk O_r | conv(x[:, r::n]) on its channels only, allgather along channels | reduce-scatter of dy (sum of every rank's), dx only on its input channels | ≈ y·(n−1)/n / ≈ y·(n−1)/n |
//! | [`ParallelConvolution2D::replicated`] | as above | copy-to(x), then as above, gather-from | dy_r: its slice; dx: allreduce of the ranks' parts (the whole dL/dx on every rank) | ≈ y·(n−1)/n / ≈ 2x·(n−1)/n |
//! | [`OutputParallelConv2d`] (exact) | all input channels; output chunk O_r of W and b | copy-to(x), conv, gather-from along channels | dy_r: its slice, no communication; dx: allreduce | ≈ y·(n−1)/n / ≈ 2x·(n−1)/n |
//! | [`InputParallelConv2d`] (exact) | input chunk C_r of W; b whole | scatter-to(x) along channels, conv without bias, reduce-from, + b | dx_r = conv input gradient, allgather of the slices | ≈ 2y·(n−1)/n / ≈ x·(n−1)/n |
//!
//! | [`OutputParallelConv2d::sharded_output`] | as above | copy-to(x), conv: y_r, its output channels only | dx: allreduce | 0 / ≈ 2x·(n−1)/n |
//! | [`InputParallelConv2d::new_sharded`] | input chunk C_r of W, output chunk of b | conv(x_r) on its channels, reduce-scatter along channels: y_r | allgather of dy | ≈ y·(n−1)/n / ≈ y·(n−1)/n |
//!
//! (x, y: the bytes of the input and output on one rank; ring algorithms.)
//! The sharded forms keep activations split by channels, so per-channel
//! layers after them (batch normalisation, ReLU, pooling) run on 1/n of the
//! channels; `shardnet train vgg16` uses them for `output` (gathered after
//! each block, after its pooling) and `input` (never gathered until the
//! classifier: C_r out of one layer is C_r into the next).
//! Region ops as in [`crate::links::ColumnParallelLinear`]: copy-to =
//! [`copy_to_shards`], gather-from = [`allgather_replicated`], scatter-to =
//! [`split_to_shards`], reduce-from = [`allreduce_replicated`].
//!
//! **What each computes.** The two exact layers equal the one-device
//! convolution (to rounding) in values and every gradient, for any split.
//! [`ParallelConvolution2D`] is ChainerMN's layer as written: each rank
//! convolves only its interleaved subset of input channels, so the whole is
//! a *grouped* convolution (n groups, group r = input channels ≡ r mod n →
//! output chunk r), not the full convolution; it has 1/n of the
//! multiply-adds and parameters. Its allgather's backward sums every rank's
//! gradient (reduce-scatter), which is right when each rank computes its
//! own loss from y; when every rank computes the same loss (the rest of the
//! network replicated, as in ChainerMN's VGG16), the gradients reaching
//! its weights are n times those of the one-device grouped convolution —
//! ChainerMN's behaviour, kept; [`ParallelConvolution2D::replicated`] gives
//! the split backward instead.
//!
//! Weights are initialised from the *global* tensor (O, C·kh·kw) of each
//! layer's seed ([`init::uniform_block`] of [`init::layer_seed`]), bound
//! 1/√fan_in, so the exact layers train the same model on any number of
//! ranks.
//!
//! ```
//! use candle_core::{DType, Tensor};
//! use shardnet::functions::Context;
//! use shardnet::links::{ChannelSplit, ChannelConv2d};
//! use shardnet::nn::ParamStore;
//!
//! let outs = shardnet::comm::launch(3, |comm| {
//!     let ctx = Context::new(&comm);
//!     let store = ParamStore::new(comm.device(), 7);
//!     // 3 → 5 channels, 3×3, padding 1: rank 0 and 1 hold 2 output channels, rank 2 one.
//!     let conv = ChannelConv2d::new(&ctx, &store, ChannelSplit::Output, "conv", 0, 3, 5, 3, 1, 1, true)?;
//!     let x = Tensor::ones((2, 3, 8, 8), DType::F32, comm.device())?;
//!     let y = conv.forward(&x)?; // the whole (2, 5, 8, 8) on every rank
//!     y.sum_all()?.backward()?;
//!     // The gradients are in the parameters, on either path.
//!     assert!(conv.params().iter().all(|p| p.grad().is_some()));
//!     Ok(y.dims().to_vec())
//! })?;
//! assert!(outs.iter().all(|d| d == &[2, 5, 8, 8]));
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::comm::chunk_range;
use crate::functions::{
    allgather, allgather_replicated, allreduce_replicated, copy_to_shards, reduce_scatter,
    split_to_shards, Context,
};
use crate::nn::{gather_grad, gather_shard, init, Conv2d, Param, ParamStore, Shard, Whole};
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;
use std::str::FromStr;

/// How a convolution's channels are split over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ChannelSplit {
    /// Not split: every rank holds the whole convolution (replicated).
    None,
    /// ChainerMN's `ParallelConvolution2D`: a grouped convolution over
    /// interleaved input channels.
    Grouped,
    /// Exact, output channels split ([`OutputParallelConv2d`]).
    Output,
    /// Exact, input channels split ([`InputParallelConv2d`]).
    Input,
}

impl FromStr for ChannelSplit {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(ChannelSplit::None),
            "grouped" => Ok(ChannelSplit::Grouped),
            "output" => Ok(ChannelSplit::Output),
            "input" => Ok(ChannelSplit::Input),
            _ => Err(format!(
                "unknown channel split {s:?}: give none, grouped, output or input"
            )),
        }
    }
}

impl std::fmt::Display for ChannelSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChannelSplit::None => "none",
            ChannelSplit::Grouped => "grouped",
            ChannelSplit::Output => "output",
            ChannelSplit::Input => "input",
        })
    }
}

/// A kernel's height and width: `3` is 3×3, `(3, 5)` 3 high and 5 wide
/// (as [`Conv2d`] takes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSize {
    /// Rows.
    pub h: usize,
    /// Columns.
    pub w: usize,
}

impl From<usize> for KernelSize {
    fn from(k: usize) -> Self {
        KernelSize { h: k, w: k }
    }
}

impl From<(usize, usize)> for KernelSize {
    fn from((h, w): (usize, usize)) -> Self {
        KernelSize { h, w }
    }
}

/// The shape of one convolution: channels in and out, its kernel, stride
/// and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spec {
    cin: usize,
    cout: usize,
    k: KernelSize,
}

impl Spec {
    fn kk(&self) -> usize {
        self.k.h * self.k.w
    }
}

/// The block (rows × input channels) of layer `layer`'s global weight
/// (cout, cin·kh·kw), as (rows, channels, kh, kw), with bound 1/√fan_in.
fn weight_block(
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
fn bias_block(
    store: &ParamStore,
    layer: usize,
    rows: std::ops::Range<usize>,
    fan_in: usize,
) -> Result<Tensor> {
    let seed = init::layer_seed(store.seed(), layer, 1);
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let n = rows.len();
    init::uniform_block(seed, rows, 0..1, 1, bound, store.device())?
        .reshape(n)
        .map_err(Into::into)
}

/// The spec of a user's whole weight (O, C, kh, kw) and bias (O), checked.
fn given(name: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<Spec> {
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
fn bias_rows(b: Option<&Tensor>, rows: &std::ops::Range<usize>) -> Result<Option<Tensor>> {
    b.map(|b| Ok(b.narrow(0, rows.start, rows.len())?.contiguous()?))
        .transpose()
}

fn channels(name: &str, x: &Tensor, want: usize) -> Result<()> {
    match x.dims() {
        [_, c, _, _] if *c == want => Ok(()),
        d => Err(Error::Usage(format!(
            "{name}: input of shape {d:?}, expected (batch, {want}, height, width)"
        ))),
    }
}

/// ChainerMN's `ParallelConvolution2D` (see the module doc): rank r
/// convolves input channels r, r+n, … into its chunk of output channels;
/// the chunks are allgathered along the channels.
#[derive(Clone)]
pub struct ParallelConvolution2D {
    ctx: Context,
    /// This rank's convolution: (O_r, |input channels ≡ r mod n|, kh, kw).
    pub conv: Conv2d,
    /// This rank's input channels, as numbers and as an index tensor.
    channels: Vec<u32>,
    indices: Tensor,
    in_channels: usize,
    out_channels: usize,
    replicated: bool,
}

impl ParallelConvolution2D {
    /// Layer `layer` (its seed) of `cin` → `cout` channels, a kernel of
    /// `k` (3 or (3, 5)), named `name` in `store`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        (cin, cout): (usize, usize),
        k: impl Into<KernelSize>,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        let s = Spec {
            cin,
            cout,
            k: k.into(),
        };
        let (n, r) = (ctx.size(), ctx.rank());
        let out = chunk_range(cout, n, r);
        // The group's own fan-in: its input channels r, r+n, … (at least 1).
        let fan_in = (r..cin).step_by(n).count() * s.kk();
        let full = weight_block(store, layer, &s, out.clone(), 0..cin, fan_in)?;
        let b = if bias {
            Some(bias_block(store, layer, out, fan_in)?)
        } else {
            None
        };
        Self::assemble(ctx, store, name, &s, &full, b, stride, padding)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank, as one device's dense convolution holds
    /// them: rank r keeps output rows O_r and input channels r, r+n, …
    /// (the weights outside the groups are not used: see the module doc).
    /// [`Self::whole`] gives them back in this form.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let s = given("ParallelConvolution2D::from_weights", weight, bias)?;
        let out = chunk_range(s.cout, ctx.size(), ctx.rank());
        let rows = weight.narrow(0, out.start, out.len())?;
        let b = bias_rows(bias, &out)?;
        Self::assemble(ctx, store, name, &s, &rows, b, stride, padding)
    }

    /// This rank's group from its output rows of the dense weight
    /// (O_r, C, kh, kw) and bias.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        s: &Spec,
        rows: &Tensor,
        bias: Option<Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let (n, r) = (ctx.size(), ctx.rank());
        let mine: Vec<u32> = (r..s.cin).step_by(n).map(|c| c as u32).collect();
        let indices = Tensor::new(mine.as_slice(), store.device())?;
        let w = rows.to_device(store.device())?.index_select(&indices, 1)?;
        // Each rank's weights are its own group's, not a shard of one
        // tensor (their input channels differ): named by group.
        let weight = store.add(&format!("{name}.group{r}of{n}.weight"), &w, None)?;
        let bias = match bias {
            Some(b) => Some(store.add(&format!("{name}.group{r}of{n}.bias"), &b, None)?),
            None => None,
        };
        Ok(ParallelConvolution2D {
            ctx: ctx.clone(),
            conv: Conv2d::new(weight, bias, stride, padding)?,
            channels: mine,
            indices,
            in_channels: s.cin,
            out_channels: s.cout,
            replicated: false,
        })
    }

    /// The whole layer as one device's dense convolution holds it — weight
    /// (O, C, kh, kw) with zeros outside the groups, bias (O) — and the
    /// gradients in the same form, on rank `root` (every rank with `None`;
    /// `None` on the others). Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        let (n, r) = (self.ctx.size(), self.ctx.rank());
        let w = self.conv.weight.value();
        let [o, _, kh, kw] = w.dims()[..] else {
            return Err(Error::Usage("ParallelConvolution2D: a 4-D weight".into()));
        };
        let cout = self.out_channels;
        let out = chunk_range(cout, n, r);
        // This rank's rows, dense: its group's values at its channels.
        let dense = |t: &Tensor| -> Result<Tensor> {
            let zeros = Tensor::zeros((o, self.in_channels, kh, kw), t.dtype(), t.device())?;
            if self.channels.is_empty() || o == 0 {
                return Ok(zeros);
            }
            let idx = self.indices.to_device(t.device())?;
            Ok(zeros.index_add(&idx, &t.contiguous()?, 1)?)
        };
        let shard = Some(Shard {
            dim: 0,
            offset: out.start,
            global: cout,
        });
        let weight = gather_shard(&self.ctx, &dense(w)?, shard, root)?;
        let wg = self.conv.weight.grad().map(&dense).transpose()?;
        let weight_grad = gather_grad(
            &self.ctx,
            self.conv.weight.name(),
            wg.as_ref(),
            &dense(w)?,
            shard,
            root,
        )?;
        let (bias, bias_grad) = match &self.conv.bias {
            Some(b) => (
                gather_shard(&self.ctx, b.value(), shard, root)?,
                gather_grad(&self.ctx, b.name(), b.grad(), b.value(), shard, root)?,
            ),
            None => (None, None),
        };
        Ok(weight.map(|weight| Whole {
            weight,
            bias,
            weight_grad,
            bias_grad,
        }))
    }

    /// The same layer for a network whose every rank computes the same
    /// loss from y: the split backward (gather-from) of y, and dL/dx summed
    /// over the ranks (copy-to), so that every rank's dL/dx is the whole
    /// one-device gradient, as the layer before it needs.
    pub fn replicated(mut self) -> Self {
        self.replicated = true;
        self
    }

    /// This rank's input channels (r, r+n, …).
    pub fn channel_indices(&self) -> &[u32] {
        &self.channels
    }

    /// Its parameters on this rank.
    pub fn params(&self) -> Vec<Param> {
        self.conv.params()
    }

    /// y (B, O, Ho, Wo) for the replicated x (B, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        channels("ParallelConvolution2D", x, self.in_channels)?;
        // With one loss on every rank, dL/dx is the sum of every rank's
        // part (each covers its own input channels only): copy-to sums
        // them in backward, so the layer before gets the whole gradient.
        // (ChainerMN's form leaves each rank its part: the allgather
        // before it sums them.) An input that needs no gradient needs no
        // allreduce; every rank holds the same x, so all decide alike.
        let x = if self.replicated && x.track_op() {
            copy_to_shards(&self.ctx, x)?
        } else {
            x.clone()
        };
        let x = &x;
        let mine = if crate::kernels::fast(x.device()) && x.dtype() == candle_core::DType::F32 {
            x.contiguous()?.apply_op1(SelectChannels {
                channels: self.channels.clone(),
            })?
        } else {
            x.index_select(&self.indices.to_device(x.device())?, 1)?
        };
        let y = self.conv.forward(&mine)?;
        if self.replicated {
            allgather_replicated(&self.ctx, &y, 1)
        } else {
            allgather(&self.ctx, &y, 1)
        }
    }
}

/// Channels `channels` of x (B, C, H, W), on the CPU in f32: whole planes
/// copied forward, copied back into a zeroed dx backward (candle's
/// `index_select` backward adds element by element).
struct SelectChannels {
    channels: Vec<u32>,
}

impl SelectChannels {
    /// (b, c, h·w) of a 4-D layout.
    fn sizes(l: &candle_core::Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (b, c, h, w) = l.shape().dims4()?;
        Ok((b, c, h * w))
    }
}

impl candle_core::CustomOp1 for SelectChannels {
    fn name(&self) -> &'static str {
        "shardnet-select-channels"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(v) = s else {
            candle_core::bail!("shardnet select-channels: f32");
        };
        let x = crate::kernels::view(v, l, "select-channels")?;
        let (b, c, hw) = Self::sizes(l)?;
        let k = self.channels.len();
        let mut y = Vec::with_capacity(b * k * hw);
        for i in 0..b {
            for &ch in &self.channels {
                y.extend_from_slice(&x[(i * c + ch as usize) * hw..][..hw]);
            }
        }
        let (_, _, h, w) = l.shape().dims4()?;
        Ok((candle_core::CpuStorage::F32(y), (b, k, h, w).into()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, c, h, w) = x.dims4()?;
        let hw = h * w;
        let g = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let k = self.channels.len();
        let mut dx = vec![0f32; b * c * hw];
        for i in 0..b {
            for (j, &ch) in self.channels.iter().enumerate() {
                dx[(i * c + ch as usize) * hw..][..hw]
                    .copy_from_slice(&g[(i * k + j) * hw..][..hw]);
            }
        }
        Ok(Some(Tensor::from_vec(dx, (b, c, h, w), x.device())?))
    }
}

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
    /// Layer `layer` (its seed) of `cin` → `cout` channels, a kernel of
    /// `k` (3 or (3, 5)), named `name` in `store`: this rank's output chunk
    /// of the global weight and bias.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        (cin, cout): (usize, usize),
        k: impl Into<KernelSize>,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        let s = Spec {
            cin,
            cout,
            k: k.into(),
        };
        let out = chunk_range(cout, ctx.size(), ctx.rank());
        let fan_in = cin * s.kk();
        let w = weight_block(store, layer, &s, out.clone(), 0..cin, fan_in)?;
        let b = if bias {
            Some(bias_block(store, layer, out, fan_in)?)
        } else {
            None
        };
        Self::assemble(ctx, store, name, &s, w, b, stride, padding)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank: rank r keeps output channels O_r.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let s = given("OutputParallelConv2d::from_weights", weight, bias)?;
        let out = chunk_range(s.cout, ctx.size(), ctx.rank());
        let w = weight.narrow(0, out.start, out.len())?.contiguous()?;
        let b = bias_rows(bias, &out)?;
        Self::assemble(ctx, store, name, &s, w, b, stride, padding)
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
    ) -> Result<Self> {
        let out = chunk_range(s.cout, ctx.size(), ctx.rank());
        let shard = Shard {
            dim: 0,
            offset: out.start,
            global: s.cout,
        };
        let weight = store.add(&format!("{name}.weight"), &w, Some(shard))?;
        let bias = match b {
            Some(b) => Some(store.add(&format!("{name}.bias"), &b, Some(shard))?),
            None => None,
        };
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
        Whole::gather(&self.ctx, &self.conv.weight, self.conv.bias.as_ref(), root)
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
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        channels: (usize, usize),
        k: impl Into<KernelSize>,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        Self::seeded(
            ctx,
            store,
            name,
            layer,
            channels,
            k.into(),
            stride,
            padding,
            bias,
            false,
        )
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
    #[allow(clippy::too_many_arguments)]
    pub fn new_sharded(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        channels: (usize, usize),
        k: impl Into<KernelSize>,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        Self::seeded(
            ctx,
            store,
            name,
            layer,
            channels,
            k.into(),
            stride,
            padding,
            bias,
            true,
        )
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
        sharded: bool,
    ) -> Result<Self> {
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

    #[allow(clippy::too_many_arguments)]
    fn seeded(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        (cin, cout): (usize, usize),
        k: KernelSize,
        stride: usize,
        padding: usize,
        bias: bool,
        sharded: bool,
    ) -> Result<Self> {
        let s = Spec { cin, cout, k };
        let mine = chunk_range(cin, ctx.size(), ctx.rank());
        let fan_in = cin * s.kk();
        let w = weight_block(store, layer, &s, 0..cout, mine, fan_in)?;
        let rows = if sharded {
            chunk_range(cout, ctx.size(), ctx.rank())
        } else {
            0..cout
        };
        let b = if bias {
            Some(bias_block(store, layer, rows, fan_in)?)
        } else {
            None
        };
        Self::assemble(ctx, store, name, &s, w, b, stride, padding, sharded)
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
        let mine = chunk_range(s.cin, ctx.size(), ctx.rank());
        let shard = Shard {
            dim: 1,
            offset: mine.start,
            global: s.cin,
        };
        let weight = store.add(&format!("{name}.weight"), &w, Some(shard))?;
        let bias = match b {
            None => None,
            Some(b) if !sharded => Some(store.add(&format!("{name}.bias"), &b, None)?),
            Some(b) => {
                let own = chunk_range(s.cout, ctx.size(), ctx.rank());
                let shard = Shard {
                    dim: 0,
                    offset: own.start,
                    global: s.cout,
                };
                Some(store.add(&format!("{name}.bias"), &b, Some(shard))?)
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
        Whole::gather(&self.ctx, &self.conv.weight, self.bias.as_ref(), root)
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
    /// Layer `layer` of `cin` → `cout` channels (a kernel of `k`: 3 or
    /// (3, 5)), split as `split` over the ranks of `ctx`. The whole
    /// convolution takes the same initial values as the exact splits.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        split: ChannelSplit,
        name: &str,
        layer: usize,
        cin: usize,
        cout: usize,
        k: impl Into<KernelSize>,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        let ch = (cin, cout);
        let k = k.into();
        Ok(match split {
            ChannelSplit::None => {
                let s = Spec { cin, cout, k };
                let fan_in = cin * s.kk();
                let w = weight_block(store, layer, &s, 0..cout, 0..cin, fan_in)?;
                let b = if bias {
                    Some(bias_block(store, layer, 0..cout, fan_in)?)
                } else {
                    None
                };
                Self::whole_conv(store, name, &w, b.as_ref(), stride, padding)?
            }
            ChannelSplit::Grouped => ChannelConv2d::Grouped(ParallelConvolution2D::new(
                ctx, store, name, layer, ch, k, stride, padding, bias,
            )?),
            ChannelSplit::Output => ChannelConv2d::Output(OutputParallelConv2d::new(
                ctx, store, name, layer, ch, k, stride, padding, bias,
            )?),
            ChannelSplit::Input => ChannelConv2d::Input(InputParallelConv2d::new(
                ctx, store, name, layer, ch, k, stride, padding, bias,
            )?),
        })
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O), the
    /// same on every rank, split as `split` (each form's `from_weights`).
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        split: ChannelSplit,
        name: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        Ok(match split {
            ChannelSplit::None => {
                given("ChannelConv2d::from_weights", weight, bias)?;
                Self::whole_conv(store, name, weight, bias, stride, padding)?
            }
            ChannelSplit::Grouped => ChannelConv2d::Grouped(ParallelConvolution2D::from_weights(
                ctx, store, name, weight, bias, stride, padding,
            )?),
            ChannelSplit::Output => ChannelConv2d::Output(OutputParallelConv2d::from_weights(
                ctx, store, name, weight, bias, stride, padding,
            )?),
            ChannelSplit::Input => ChannelConv2d::Input(InputParallelConv2d::from_weights(
                ctx, store, name, weight, bias, stride, padding, false,
            )?),
        })
    }

    fn whole_conv(
        store: &ParamStore,
        name: &str,
        w: &Tensor,
        b: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let weight = store.add(&format!("{name}.weight"), w, None)?;
        let bias = match b {
            Some(b) => Some(store.add(&format!("{name}.bias"), b, None)?),
            None => None,
        };
        Ok(ChannelConv2d::Whole(Conv2d::new(
            weight, bias, stride, padding,
        )?))
    }

    /// The whole weight and bias and their gradients on rank `root` (every
    /// rank with `None`), whichever the split (each form's `whole`; the
    /// whole convolution's own on root). Collective.
    pub fn whole(&self, ctx: &Context, root: Option<usize>) -> Result<Option<Whole>> {
        match self {
            ChannelConv2d::Whole(c) => Whole::gather(ctx, &c.weight, c.bias.as_ref(), root),
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
