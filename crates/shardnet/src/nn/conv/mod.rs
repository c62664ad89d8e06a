//! `Conv2d`: a 2-D convolution on GEMMs (im2col's, or Winograd's for 3 × 3
//! kernels), with in-place gradients.
//!
//! y[b, o, oy, ox] = bias[o] + Σ_{c, i, j} W[o, c, i, j] · x[b, c, oy·s − p + i, ox·s − p + j]
//! (zero outside the image), for x (B, C, H, W), W (O, C, kh, kw), bias (O),
//! y (B, O, Ho, Wo) with Ho = (H + 2p − kh)/s + 1 (likewise Wo); stride s and
//! padding p the same along both axes, f32 or f64, NCHW.
//!
//! On the CPU every pass is one GEMM per chunk of images, over the chunk's
//! im2col matrix `col` (C·kh·kw, q·Ho·Wo), whose column (b, oy, ox) holds the
//! patch under output pixel (oy, ox) of image b:
//!
//! | pass | GEMM | then |
//! |------|------|------|
//! | forward | Y (O, q·HoWo) = W (O, CKK) · col | bias added; Y to NCHW |
//! | input gradient | dcol (CKK, q·HoWo) = Wᵀ · G | col2im: each entry added back into dx |
//! | weight gradient | dW (O, CKK) += G · colᵀ | straight into the [`Param`] buffer |
//! | bias gradient | db (O) += Σ_{b, pixels} G | |
//!
//! A chunk holds enough images for the GEMM's columns to fill a cache-sized
//! panel (≥ [`MIN_COLUMNS`] unless the batch is smaller, or when T threads
//! need at least T chunks), and never more than [`MAX_COL_BYTES`] of `col`,
//! so memory stays bounded at any batch; a one-image chunk writes Y straight
//! into y. One image whose im2col matrix passes [`geom::MAX_BAND_BYTES`]
//! (VGG16's 64 → 64 at 32 × 32: 2.4 MB) runs band by band of output rows
//! in the forward and the input gradient, each band's matrix within a
//! core's L2 (measured: that layer's forward 10–14% faster). With T threads the chunks run in parallel (T at a time, each
//! GEMM on one thread); the weight gradient then sums T partial dW, each
//! over a fixed contiguous run of chunks, in order — the same result on
//! every run. `col` is rebuilt in the
//! backward rather than kept (it is kh·kw times the input). A 1×1 kernel
//! with stride 1 and no padding uses x itself.
//!
//! In f32, on images of at most 16 × 16 output pixels (256), the input
//! gradient runs on our own GEMM instead (`input_grad.rs`, on
//! `kernels::sgemm`): Wᵀ packed once per call, G read in place, then the
//! same col2im (measured 0.82–0.97× the time of the path above).
//!
//! In f32, a 3 × 3 kernel at stride 1 over at least
//! [`winograd::MIN_CHANNELS`] input channels and [`winograd::MIN_CALL_TILES`]
//! blocks of 2 × 2 output pixels per call runs by Winograd's F(2×2, 3×3)
//! instead (`winograd/`): every pass 16 GEMMs with 16/36 of im2col's
//! multiplications (measured on VGG16's layers at batch 32, one thread:
//! 0.61–0.92× im2col's forward + backward time). `SHARDNET_WINOGRAD=0` or
//! [`set_winograd`] turns it off.
//!
//! In f32, a 3 × 3 kernel at stride 1 and padding 1 over 2 × 2 images
//! (VGG16's last block at 32 × 32 inputs) runs its forward and input
//! gradient as one dense GEMM each instead (`dense.rs`): every output sees
//! every input, so the layer is a 4O × 4C matrix of taps and an image a row
//! of 4C values (measured at batch 32, one thread: forward 5.3 → 3.0 ms,
//! forward + backward 17.8 → 13.8 at 512 → 512).
//!
//! On other devices (and with `SHARDNET_KERNELS=generic`) it is candle's
//! `conv2d` on [`Param::tracked`] values: the gradients reach the `Param`s
//! in backward, as the kernel's do.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::comm::HOST;
//! use shardnet::nn::{Conv2d, Param};
//!
//! // One 2×2 kernel of ones over a 3×3 image, stride 1, no padding.
//! let w = Param::new("w", &Tensor::ones((1, 1, 2, 2), candle_core::DType::F32, &HOST)?)?;
//! let conv = Conv2d::new(w.clone(), None, 1, 0)?;
//! let x = Tensor::arange(0f32, 9., &HOST)?.reshape((1, 1, 3, 3))?;
//! let y = conv.forward(&x)?;
//! assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, vec![8., 12., 20., 24.]);
//! y.sum_all()?.backward()?;
//! // Each weight sees the four pixels it multiplies.
//! assert_eq!(w.grad().unwrap().flatten_all()?.to_vec1::<f32>()?, vec![8., 12., 20., 24.]);
//! # Ok::<(), shardnet::Error>(())
//! ```
//!
//! The layer is here; `passes` holds the CPU kernel's passes and how the
//! images are cut, `im2col` its patch matrices, `input_grad` the input
//! gradient on our GEMM, `winograd` the Winograd passes and `ops` their
//! candle ops.

mod dense;
mod geom;
mod im2col;
mod input_grad;
mod ops;
mod passes;
mod winograd;

pub use dense::set_enabled as set_dense;
pub use geom::{MAX_COL_BYTES, MIN_COLUMNS};
pub(crate) use winograd::MIN_CHANNELS as WINOGRAD_MIN_CHANNELS;
pub use winograd::{enabled as winograd_enabled, set_enabled as set_winograd};

use super::param::Param;
use super::replicas::ReplicaShares;
use crate::{Error, Result};
use candle_core::Tensor;
use geom::Geom;
use ops::ConvOp;

/// A 2-D convolution of [`Param`]s: square stride and padding, no dilation,
/// one group (a grouped convolution is several of these on channel subsets).
#[derive(Clone)]
pub struct Conv2d {
    weight: Param,
    bias: Option<Param>,
    stride: usize,
    padding: usize,
    /// Sharded over replicas ([`Conv2d::fully_sharded`],
    /// [`Conv2d::gradient_sharded`]): `weight` is this replica's share,
    /// gathered whole for each pass or once a step.
    shared: Option<ReplicaShares>,
}

impl std::fmt::Debug for Conv2d {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conv2d")
            .field("weight", &self.weight)
            .field("bias", &self.bias)
            .field("stride", &self.stride)
            .field("padding", &self.padding)
            .field("shared_along", &self.shared.as_ref().map(|s| s.dim()))
            .finish()
    }
}

impl Conv2d {
    /// W, (out, in, kh, kw).
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// b, (out), if any.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Stride along both axes (≥ 1).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Zero padding on every side.
    pub fn padding(&self) -> usize {
        self.padding
    }

    /// A layer from ready parameters: weight (out, in, kh, kw), bias (out).
    pub fn new(weight: Param, bias: Option<Param>, stride: usize, padding: usize) -> Result<Self> {
        let dims = weight.value().dims().to_vec();
        let [o, _, kh, kw] = dims[..] else {
            return Err(Error::Usage(format!(
                "Conv2d {}: weight of shape {dims:?}, expected (out, in, kh, kw)",
                weight.name()
            )));
        };
        if stride == 0 || kh == 0 || kw == 0 {
            return Err(Error::Usage(format!(
                "Conv2d {}: stride {stride} and kernel {kh}×{kw} must be at least 1",
                weight.name()
            )));
        }
        if let Some(b) = &bias {
            if b.value().dims() != [o] {
                return Err(Error::Usage(format!(
                    "Conv2d {}: bias of shape {:?}, expected ({o})",
                    weight.name(),
                    b.value().dims()
                )));
            }
        }
        Ok(Conv2d {
            weight,
            bias,
            stride,
            padding,
            shared: None,
        })
    }

    /// The layer fully sharded over the data-parallel replicas of `dp`
    /// (ZeRO stage 3, FSDP's design): this replica keeps `share`, its chunk
    /// along `dim` of the weight the layer holds now (the caller registers
    /// it where the optimizer and checkpoints find it), and so only a share
    /// of its gradient and optimizer state. Each pass gathers the weight
    /// whole and drops it after: the forward keeps its input alone for
    /// backward, which gathers the weight again, and reduce-scatters the
    /// weight's gradient into the share's (summed over the replicas, as a
    /// data-parallel allreduce sums them). The bias stays whole. The
    /// replicas run every pass together, as data parallelism does.
    pub fn fully_sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
    ) -> Result<Conv2d> {
        self.sharded(dp, share, dim, false)
    }

    fn sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
        keep_whole: bool,
    ) -> Result<Conv2d> {
        let (now, pair) = (self.shared.as_ref(), (&self.weight, &share));
        let shared = ReplicaShares::new("Conv2d", now, dp, pair, dim, keep_whole)?;
        Ok(Conv2d {
            weight: share,
            shared: Some(shared),
            ..self.clone()
        })
    }

    /// The layer with its gradient (and so its optimizer state) sharded
    /// over the replicas of `dp`, its weight kept whole (ZeRO stage 2):
    /// as [`Conv2d::fully_sharded`], but the weight is gathered once, by
    /// the first pass after [`Conv2d::forget_gathered`], and kept for the
    /// passes after it. Forget it after the optimizer steps the share.
    pub fn gradient_sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
    ) -> Result<Conv2d> {
        self.sharded(dp, share, dim, true)
    }

    /// Drop the whole weight a gradient-sharded layer keeps: the next pass
    /// gathers the shares again (after a step, or a checkpoint restored).
    /// Nothing for other layers.
    pub fn forget_gathered(&self) {
        if let Some(sh) = &self.shared {
            sh.forget();
        }
    }

    /// The layer with its weight gathered whole (a fresh parameter, of the
    /// share's name), or itself when not sharded. Collective over the
    /// replicas when sharded.
    fn gathered(&self) -> Result<Conv2d> {
        let Some(sh) = &self.shared else {
            return Ok(self.clone());
        };
        let whole = sh.gather(&self.weight)?;
        // A fresh parameter on the value: its own (empty) gradient.
        Conv2d::new(
            Param::from_var(self.weight.name(), whole)?,
            self.bias.clone(),
            self.stride,
            self.padding,
        )
    }

    /// Its parameters, weight first.
    pub fn params(&self) -> Vec<Param> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// The output's (height, width) for an input of `h` × `w`, or an error
    /// naming the layer when the kernel does not fit.
    pub fn output_size(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        let d = self.weight.value().dims();
        let (kh, kw) = (d[2], d[3]);
        let (s, p) = (self.stride, self.padding);
        if h + 2 * p < kh || w + 2 * p < kw {
            return Err(Error::Usage(format!(
                "Conv2d {}: a {kh}×{kw} kernel does not fit a {h}×{w} input padded by {p}",
                self.weight.name()
            )));
        }
        Ok(((h + 2 * p - kh) / s + 1, (w + 2 * p - kw) / s + 1))
    }

    fn geom(&self, x: &Tensor) -> Result<Geom> {
        // The fields are public: check again what `new` checked.
        Conv2d::new(
            self.weight.clone(),
            self.bias.clone(),
            self.stride,
            self.padding,
        )?;
        let d = self.weight.value().dims();
        let (o, c, kh, kw) = (d[0], d[1], d[2], d[3]);
        let [n, xc, h, w] = x.dims()[..] else {
            return Err(Error::Usage(format!(
                "Conv2d {}: input of shape {:?}, expected (batch, {c}, height, width)",
                self.weight.name(),
                x.dims()
            )));
        };
        if xc != c {
            return Err(Error::Usage(format!(
                "Conv2d {}: input of shape {:?} has {xc} channels, the layer takes {c}",
                self.weight.name(),
                x.dims()
            )));
        }
        let (ho, wo) = self.output_size(h, w)?;
        Ok(Geom {
            n,
            c,
            h,
            w,
            o,
            kh,
            kw,
            s: self.stride,
            p: self.padding,
            ho,
            wo,
        })
    }

    /// y for x of shape (batch, in, height, width).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(sh) = &self.shared {
            let need_dx = x.track_op();
            let name = "fully sharded Conv2d";
            return crate::functions::communicating(sh.dp(), name, x, || {
                let (y, back) = self.forward_apart(x)?;
                Ok((
                    y,
                    // Mirror: the weight gathered again, the layer's
                    // backward, its gradient reduce-scattered.
                    crate::functions::backward(move |g| back.backward(g, need_dx)),
                ))
            });
        }
        let g = self.geom(x)?;
        let w = self.weight.value();
        if !crate::kernels::fast(w.device()) {
            return self.forward_generic(x, &g);
        }
        let b = super::param::bias_or_empty(self.bias.as_ref(), w)?;
        Ok(x.contiguous()?.apply_op3(
            w,
            &b,
            ConvOp::new(g, self.weight.clone(), self.bias.clone()),
        )?)
    }

    /// y for x as [`Conv2d::forward`] computes it, outside the graph, with
    /// its backward apart: y is not an input of anything the graph keeps,
    /// so it is freed as soon as its user drops it (a partial sum that is
    /// reduce-scattered at once: [`crate::functions::reduce_scatter_of`]).
    /// The [`ConvBackward`] keeps x (and on the CPU's Winograd path the
    /// packed weights, as the graph's op does).
    pub fn forward_apart(&self, x: &Tensor) -> Result<(Tensor, ConvBackward)> {
        let (y, x, op) = if self.shared.is_some() {
            // The whole weight (and the Winograd path's packing of it) goes
            // when the forward is done: backward gathers it again.
            let (y, back) = self.gathered()?.forward_apart(x)?;
            (y, back.x, None)
        } else {
            let g = self.geom(x)?;
            let w = self.weight.value();
            if crate::kernels::fast(w.device()) {
                let x = x.detach().contiguous()?;
                let b = super::param::bias_or_empty(self.bias.as_ref(), w)?;
                let op = ConvOp::new(g, self.weight.clone(), self.bias.clone());
                (x.apply_op3_no_bwd(w, &b, &op)?, x, Some(op))
            } else {
                // Detached: the graph to W goes with the tensor dropped here.
                let x = x.detach();
                (self.forward_generic(&x, &g)?.detach(), x, None)
            }
        };
        let conv = self.clone();
        Ok((y, ConvBackward { conv, x, op }))
    }

    /// candle's conv2d (any device); an input with no channels gives the
    /// bias alone and zero-size gradients, as the CPU kernel does.
    fn forward_generic(&self, x: &Tensor, g: &Geom) -> Result<Tensor> {
        let w = self.weight.tracked()?;
        let y = if g.c == 0 {
            // No input channels: the bias alone (candle's conv2d takes
            // none); x and W stay in the graph, so both get their (empty)
            // gradients.
            let zero = (crate::functions::zero_of(x)? + crate::functions::zero_of(&w)?)?;
            zero.broadcast_as((g.n, g.o, g.ho, g.wo))?
        } else if (g.h + 2 * g.p - g.kh) % g.s != (g.w + 2 * g.p - g.kw) % g.s {
            // candle's conv2d backward takes its transposed convolution's
            // output padding from the height alone, and fails when the
            // width's differs. Padded here and cut to the rows and columns
            // the windows reach, both remainders are 0 (and the result is
            // the same: what is cut off is never read).
            let (hu, wu) = ((g.ho - 1) * g.s + g.kh, (g.wo - 1) * g.s + g.kw);
            x.pad_with_zeros(2, g.p, g.p)?
                .pad_with_zeros(3, g.p, g.p)?
                .narrow(2, 0, hu)?
                .narrow(3, 0, wu)?
                .conv2d(&w, 0, g.s, 1, 1)?
        } else {
            x.conv2d(&w, g.p, g.s, 1, 1)?
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(&b.tracked()?.reshape((1, g.o, 1, 1))?)?,
            None => y,
        })
    }
}

crate::nn::candle_module!(Conv2d);

/// The backward of one [`Conv2d::forward_apart`].
pub struct ConvBackward {
    conv: Conv2d,
    /// The input, detached.
    x: Tensor,
    /// The CPU kernel's op of the forward (`None` on the generic path and
    /// for a sharded layer, whose backward gathers its weight again).
    op: Option<ConvOp>,
}

impl ConvBackward {
    /// From dL/dy `dy`: dW (and db) added into the parameters' gradients,
    /// dL/dx returned when `input_grad` (else `None`). On the generic path
    /// candle's conv2d runs again on x for its gradients (one more
    /// forward: candle's backward needs its graph).
    pub fn backward(&self, dy: &Tensor, input_grad: bool) -> Result<Option<Tensor>> {
        let dy = dy.detach().contiguous()?;
        if let Some(sh) = &self.conv.shared {
            let whole = self.conv.gathered()?;
            let dx = ConvBackward {
                conv: whole.clone(),
                x: self.x.clone(),
                op: None,
            }
            .backward(&dy, input_grad)?;
            sh.scatter_grad(&whole.weight, &self.conv.weight)?;
            return Ok(dx);
        }
        let g = self.conv.geom(&self.x)?;
        let w = self.conv.weight.value();
        let fresh;
        let op = match &self.op {
            Some(op) => Some(op),
            None if crate::kernels::fast(w.device()) => {
                // The kernel's backward without its forward's op (Winograd's
                // weights packed again).
                fresh = ConvOp::new(g, self.conv.weight.clone(), self.conv.bias.clone());
                Some(&fresh)
            }
            None => None,
        };
        if let Some(op) = op {
            return Ok(op.backward_of(&self.x.contiguous()?, w, &dy, input_grad)?);
        }
        let x = if input_grad {
            candle_core::Var::from_tensor(&self.x)?.as_tensor().clone()
        } else {
            self.x.clone()
        };
        let y = self.conv.forward_generic(&x, &g)?;
        let mut grads = y.mul(&dy)?.sum_all()?.backward()?;
        for p in self.conv.params() {
            p.absorb(&mut grads)?;
        }
        Ok(if input_grad { grads.remove(&x) } else { None })
    }
}
