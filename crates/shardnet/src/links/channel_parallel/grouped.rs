//! ChainerMN's grouped channel-parallel convolution
//! ([`ParallelConvolution2D`]), its `.replicated()` form, and the op that
//! selects a rank's interleaved input channels.

use super::common::{channels, given, Spec};
use super::config::ConvConfig;
use crate::comm::chunk_range;
use crate::functions::{allgather, allgather_replicated, copy_to_shards, Context};
use crate::nn::{gather_grad, gather_shard, Conv2d, Param, ParamStore, Shard, WeightsFrom, Whole};
use crate::{Error, Result};
use candle_core::Tensor;

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
    /// `cin` → `cout` channels as `cfg` says, its group's weight and bias
    /// in `store` (scope it: `store.pp("conv1")`; named by group:
    /// `group{r}of{n}.weight`). The bound is the group's own fan-in (its
    /// input channels r, r+n, …, at least 1).
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
        let (n, r) = (ctx.size(), ctx.rank());
        let src = WeightsFrom::Seeded {
            layer: cfg.layer,
            fan_in: (r..cin).step_by(n).count() * s.kk(),
            bias: cfg.bias,
        };
        Self::build(ctx, store, &s, src, cfg.stride, cfg.padding)
    }

    /// The layer from a user's whole weight (O, C, kh, kw) and bias (O),
    /// the same on every rank, as one device's dense convolution holds
    /// them: rank r keeps output rows O_r and input channels r, r+n, …
    /// (the weights outside the groups are not used: see the module doc).
    /// [`Self::whole`] gives them back in this form.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let s = given("ParallelConvolution2D::from_weights", weight, bias)?;
        let src = WeightsFrom::Given { weight, bias };
        Self::build(ctx, store, &s, src, stride, padding)
    }

    /// This rank's group: its output rows O_r of the dense weight, at its
    /// input channels, and its rows of the bias. Each rank's weights are
    /// its own group's, not a shard of one tensor (their input channels
    /// differ): named by group.
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
        let rows = w.split(0, n, r).value(store)?;
        let mine: Vec<u32> = (r..s.cin).step_by(n).map(|c| c as u32).collect();
        let indices = Tensor::new(mine.as_slice(), store.device())?;
        let w = rows.to_device(store.device())?.index_select(&indices, 1)?;
        let group = store.pp(&format!("group{r}of{n}"));
        let weight = group.add("weight", &w, None)?;
        let bias = match b {
            Some(b) => Some(group.add("bias", &b.split(0, n, r).value(store)?, None)?),
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
        let w = self.conv.weight().value();
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
        let shard = Some(Shard::along(0, &out, cout));
        let weight = gather_shard(&self.ctx, &dense(w)?, shard, root)?;
        let wg = self.conv.weight().grad().map(&dense).transpose()?;
        let weight_grad = gather_grad(
            &self.ctx,
            self.conv.weight().name(),
            wg.as_ref(),
            &dense(w)?,
            shard,
            root,
        )?;
        let (bias, bias_grad) = match self.conv.bias() {
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

crate::nn::candle_module!(ParallelConvolution2D);
