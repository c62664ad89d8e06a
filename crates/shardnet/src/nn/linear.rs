//! `Linear`: y = x Wᵀ + b on our CPU kernels (the forward on `kernels::sgemm`
//! where it beats the `gemm` crate, the gradients on the crate), with
//! in-place gradients.
//!
//! Shapes: x (B, I), W (O, I), b (O), y (B, O); f32 or f64. A weight of
//! more dimensions (…, I) is taken as (O, I) with O the product of the
//! leading ones, its bias as O values of any shape (a transformer's fused
//! q, k, v projection, (3, D, D), is one such layer).
//! Backward: dx = g W (a new tensor, into candle's graph); dW += gᵀ x and
//! db += Σ_rows g straight into the [`Param`] buffers (one GEMM with
//! accumulate, no temporaries), so M micro-batches cost M GEMMs and nothing
//! more. On other devices (and with `SHARDNET_KERNELS=generic`) it is
//! candle's matmul on [`Param::tracked`] values: the gradients reach the
//! `Param`s in backward just the same.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::comm::HOST;
//! use shardnet::nn::{Linear, Param};
//!
//! let w = Param::new("w", &Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &HOST)?)?;
//! let b = Param::new("b", &Tensor::new(&[0f32, 1., 2.], &HOST)?)?;
//! let layer = Linear::new(w.clone(), Some(b.clone()));
//! let x = Tensor::new(&[[1f32, 1.]], &HOST)?;
//! let y = layer.forward(&x)?;
//! assert_eq!(y.to_vec2::<f32>()?, vec![vec![3., 8., 13.]]);
//! y.sum_all()?.backward()?;
//! assert_eq!(w.grad().unwrap().to_vec2::<f32>()?, vec![vec![1., 1.]; 3]);
//! assert_eq!(b.grad().unwrap().to_vec1::<f32>()?, vec![1., 1., 1.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::param::{Accumulate, Param};
use super::replicas::{ReplicaShares, Round};
use crate::kernels::bf16::matmul_bf16_threaded;
use crate::kernels::dot::Abt;
use crate::kernels::{matmul, Float};
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

/// A fully connected layer of [`Param`]s.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
    bf16: bool,
    /// Sharded over replicas ([`Linear::fully_sharded`],
    /// [`Linear::gradient_sharded`]): `weight` is this replica's share,
    /// gathered whole for each pass or once a step.
    shared: Option<ReplicaShares>,
}

impl Linear {
    /// W, (out, in).
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// b, (out), if any.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// A layer from ready parameters.
    pub fn new(weight: Param, bias: Option<Param>) -> Self {
        Linear {
            weight,
            bias,
            bf16: false,
            shared: None,
        }
    }

    /// The layer fully sharded over the data-parallel replicas of `dp`
    /// (ZeRO stage 3, FSDP's design): this replica keeps `share`, its chunk
    /// along `dim` of the weight the layer holds now (the caller registers
    /// it where the optimizer and checkpoints find it), and so only a share
    /// of its gradient and optimizer state. Each pass gathers the weight
    /// whole and drops it after: the forward keeps its input alone for
    /// backward, which gathers the weight again and reduce-scatters the
    /// weight's gradient into the share's (summed over the replicas, as a
    /// data-parallel allreduce sums them) at once, never deferred to a
    /// zero-bubble pipeline's W pass. The bias stays whole. The replicas
    /// run every pass together, as data parallelism does.
    pub fn fully_sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
    ) -> Result<Linear> {
        self.sharded(dp, share, dim, false)
    }

    /// The layer with its gradient (and so its optimizer state) sharded
    /// over the replicas of `dp`, its weight kept whole (ZeRO stage 2): as
    /// [`Linear::fully_sharded`], but the weight is gathered once, by the
    /// first pass after [`Linear::forget_gathered`], and kept for the
    /// passes after it. Forget it after the optimizer steps the share.
    pub fn gradient_sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
    ) -> Result<Linear> {
        self.sharded(dp, share, dim, true)
    }

    fn sharded(
        &self,
        dp: &crate::functions::Context,
        share: Param,
        dim: usize,
        keep_whole: bool,
    ) -> Result<Linear> {
        let (now, pair) = (self.shared.as_ref(), (&self.weight, &share));
        let shared = ReplicaShares::new("Linear", now, dp, pair, dim, keep_whole)?;
        Ok(Linear {
            weight: share,
            shared: Some(shared),
            ..self.clone()
        })
    }

    /// Whether the weight is shared out over replicas
    /// ([`Linear::fully_sharded`], [`Linear::gradient_sharded`]): its
    /// gradient reaches this replica's share summed over them, so it needs
    /// no allreduce.
    pub fn is_shared_out(&self) -> bool {
        self.shared.is_some()
    }

    /// Drop the whole weight a gradient-sharded layer keeps: the next pass
    /// gathers the shares again (after a step, or a checkpoint restored).
    /// Nothing for other layers.
    pub fn forget_gathered(&self) {
        if let Some(sh) = &self.shared {
            sh.forget();
        }
    }

    /// A fully sharded layer gathering at most `bytes` of its weight at a
    /// time (8 MiB unless set; 0: whole): with its weight shared out by rows
    /// (along dimension 0), f32 on the host, each pass moves it in blocks of
    /// rows, a piece of every replica's share, and reduce-scatters each
    /// block's gradient as its backward ends, so the pass never holds the
    /// whole weight or its whole gradient. dL/dx is summed block by block,
    /// so it may differ from the whole layer's in the last bits. Other
    /// layers ignore it.
    pub fn with_gather_block(mut self, bytes: usize) -> Self {
        self.shared = self.shared.map(|sh| sh.with_block(bytes));
        self
    }

    /// The layer with its weight gathered whole (a fresh parameter, of the
    /// share's name, with its own gradient), or itself when not sharded.
    /// Collective over the replicas when sharded.
    fn gathered(&self) -> Result<Linear> {
        let Some(sh) = &self.shared else {
            return Ok(self.clone());
        };
        let whole = sh.gather(&self.weight)?;
        Ok(Linear {
            weight: Param::from_var(self.weight.name(), whole)?,
            bias: self.bias.clone(),
            bf16: self.bf16,
            shared: None,
        })
    }

    /// A sharded layer's forward: the weight gathered (whole, or a block
    /// at a time), y computed outside the graph, x alone kept for the
    /// backward (on `dp`'s tape).
    fn forward_sharded(&self, sh: &ReplicaShares, x: &Tensor) -> Result<Tensor> {
        let want_dx = x.track_op();
        let (layer, kept) = (self.clone(), x.detach());
        let rounds = sh.rounds(&self.weight);
        crate::functions::communicating(sh.dp(), "fully sharded Linear", x, || {
            let y = match &rounds {
                Some(rounds) => self.forward_rounds(sh, rounds, x)?,
                None => self.gathered()?.forward_detached(x)?,
            };
            Ok((
                y,
                // Mirror: the weight gathered again (whole, or block by
                // block), the layer's backward, its gradient reduce-scattered.
                crate::functions::backward(move |g| match &rounds {
                    Some(rounds) => layer.backward_rounds(rounds, &kept, g, want_dx),
                    None => {
                        let whole = layer.gathered()?;
                        let dx = super::deferred::now(|| whole.backward_apart(&kept, g, want_dx))?;
                        sh_of(&layer)?.scatter_grad(&whole.weight, &layer.weight)?;
                        Ok(dx)
                    }
                }),
            ))
        })
    }

    /// The output features per row of the whole weight (along dimension 0).
    fn features_per_row(sh: &ReplicaShares) -> Result<usize> {
        let rows = sh.whole().first().copied().unwrap_or(0).max(1);
        Ok(out_in(sh.whole())?.0 / rows)
    }

    /// The layer of `round`'s block of the weight (gathered now): its rows,
    /// replica by replica, and their biases if `with_bias`.
    fn round_layer(&self, sh: &ReplicaShares, round: &Round, with_bias: bool) -> Result<Linear> {
        let w = Param::from_var(self.weight.name(), sh.gather_round(&self.weight, round)?)?;
        let per = Self::features_per_row(sh)?;
        let bias = match (&self.bias, with_bias) {
            (Some(b), true) => {
                let all = b.value().flatten_all()?;
                let parts = round
                    .pieces
                    .iter()
                    .filter(|p| !p.is_empty())
                    .map(|p| all.narrow(0, p.start * per, p.len() * per))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Some(Param::new(b.name(), &Tensor::cat(&parts, 0)?)?)
            }
            _ => None,
        };
        Ok(Linear::new(w, bias).with_bf16(self.bf16))
    }

    /// y = x Wᵀ + b with the weight gathered a block of rows at a time:
    /// each block's features computed, then put in the whole weight's
    /// order.
    fn forward_rounds(&self, sh: &ReplicaShares, rounds: &[Round], x: &Tensor) -> Result<Tensor> {
        let per = Self::features_per_row(sh)?;
        let ys = rounds
            .iter()
            .map(|round| self.round_layer(sh, round, true)?.forward_detached(x))
            .collect::<Result<Vec<_>>>()?;
        let last = x.rank().saturating_sub(1);
        let mut cols = Vec::new();
        for r in 0..sh.dp().size() {
            for (round, y) in rounds.iter().zip(&ys) {
                let len = round.pieces[r].len() * per;
                if len > 0 {
                    cols.push(y.narrow(last, round.offset(r) * per, len)?);
                }
            }
        }
        Ok(Tensor::cat(&cols, last)?)
    }

    /// The backward of [`Self::forward_rounds`] at `x` for dL/dy = `g`:
    /// block by block, the block gathered again, its dL/dx added up and
    /// its weight gradient reduce-scattered into the share's; db whole.
    fn backward_rounds(
        &self,
        rounds: &[Round],
        x: &Tensor,
        g: &Tensor,
        want_dx: bool,
    ) -> Result<Option<Tensor>> {
        let sh = sh_of(self)?;
        let per = Self::features_per_row(sh)?;
        let last = g.rank().saturating_sub(1);
        // On the CPU kernels dL/dx is summed in one buffer, each block's
        // GEMM adding into it; on candle's ops block by block.
        let fast = crate::kernels::fast(x.device()) && x.dtype() == DType::F32;
        let mut into = (want_dx && fast).then(|| {
            let (rows, i) = (lead(x.dims()), x.dims().last().copied().unwrap_or(0));
            (crate::kernels::unfilled(rows * i, f32::NAN), rows, i)
        });
        let mut dx: Option<Tensor> = None;
        for (t, round) in rounds.iter().enumerate() {
            let block = self.round_layer(sh, round, false)?;
            let gs = round
                .pieces
                .iter()
                .filter(|p| !p.is_empty())
                .map(|p| g.narrow(last, p.start * per, p.len() * per))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let g = Tensor::cat(&gs, last)?.contiguous()?;
            let d = super::deferred::now(|| block.backward_apart(x, &g, want_dx && !fast))?;
            if let Some((buf, rows, i)) = &mut into {
                block.add_input_grad(&g, buf, (*rows, *i), t > 0)?;
            }
            sh.scatter_round_grad(&block.weight, round, &self.weight)?;
            dx = match (dx, d) {
                (Some(a), Some(b)) => Some((a + b)?),
                (a, b) => a.or(b),
            };
        }
        self.bias_backward(g)?;
        if let Some((buf, _, _)) = into {
            dx = Some(Tensor::from_vec(buf, x.shape(), x.device())?);
        }
        Ok(dx)
    }

    /// dx (rows, I) (+)= g (rows, O) · W (O, I) on the CPU kernels, f32 (on
    /// bf16 inputs for a bf16 layer): a block's share of dL/dx added into
    /// one buffer (written when not `accumulate`).
    fn add_input_grad(
        &self,
        g: &Tensor,
        dx: &mut [f32],
        (rows, i): (usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let (o, _) = out_in(self.weight.value().dims())?;
        crate::kernels::with_f32s(g, "Linear", |g| {
            crate::kernels::with_f32s(self.weight.value(), "Linear", |w| {
                if self.bf16 {
                    matmul_bf16_threaded(rows, i, o, (dx, i, 1), accumulate, (g, o, 1), (w, i, 1));
                } else {
                    matmul(rows, i, o, dx, accumulate, (g, o, 1), (w, i, 1));
                }
                Ok::<_, candle_core::Error>(())
            })
        })?;
        Ok(())
    }

    /// db += Σ_rows g, as the layer's own backward adds it.
    fn bias_backward(&self, g: &Tensor) -> Result<()> {
        let Some(b) = &self.bias else {
            return Ok(());
        };
        let g = g.contiguous()?;
        if crate::kernels::fast(g.device()) {
            return b.accumulate(&g, &g, BiasGrad);
        }
        let o = b.value().elem_count();
        let db = g.reshape((lead(g.dims()), o))?.sum(0)?;
        b.add_grad(&db.reshape(b.value().shape())?)
    }

    /// The layer with its GEMMs on bf16 inputs (`on`) or f32 ones: x, W and
    /// (in backward) dL/dy rounded to bf16 as the GEMMs read them, products
    /// summed in f32 (mixed precision; the parameters, their gradients and
    /// y stay f32). On the CPU kernels that is `kernels::bf16`'s GEMM,
    /// forward and backward; on the generic path candle's bf16 matmul,
    /// whose output is rounded to bf16 too (what cuBLAS and PyTorch's
    /// autocast give). f64 layers ignore it.
    pub fn with_bf16(mut self, on: bool) -> Self {
        self.bf16 = on;
        self
    }

    /// Whether the GEMMs take bf16 inputs ([`Self::with_bf16`]).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Its parameters, weight first.
    pub fn params(&self) -> Vec<Param> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// y = x Wᵀ + b for x of shape (B, in), or (…, in) giving (…, out).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(sh) = &self.shared {
            return self.forward_sharded(sh, x);
        }
        let w = self.weight.value();
        let (o, i) = out_in(w.dims())?;
        match x.dims().split_last() {
            Some((k, lead)) if *k == i && !lead.is_empty() => {}
            _ => {
                return Err(Error::Usage(format!(
                    "Linear({i} -> {o}): input of shape {:?}, expected (batch, {i}) or (…, {i})",
                    x.dims()
                )))
            }
        }
        if x.rank() > 2 && !crate::kernels::fast(w.device()) {
            // candle's matmul takes two dimensions: the rows flattened.
            let mut out = x.dims().to_vec();
            if let Some(last) = out.last_mut() {
                *last = o;
            }
            let rows = lead(x.dims());
            return self
                .forward(&x.reshape((rows, i))?)?
                .reshape(out)
                .map_err(Into::into);
        }
        if !crate::kernels::fast(w.device()) {
            // The generic path: candle's ops; dW and db reach the Params
            // in backward, as the kernel's do (`Param::tracked`).
            let wt = self.weight.tracked()?.reshape((o, i))?.t()?;
            let y = self.generic_matmul(x, &wt)?;
            return Ok(match &self.bias {
                Some(b) => y.broadcast_add(&b.tracked()?.reshape(o)?)?,
                None => y,
            });
        }
        let b = super::param::bias_or_empty(self.bias.as_ref(), w)?;
        Ok(x.contiguous()?.apply_op3(w, &b, LinearOp(self.clone()))?)
    }
}

/// The shares of a sharded layer.
fn sh_of(layer: &Linear) -> Result<&ReplicaShares> {
    layer
        .shared
        .as_ref()
        .ok_or_else(|| Error::Usage("Linear: not sharded; this is a bug".into()))
}

/// (O, I) of a weight of shape (…, I): O the product of the leading
/// dimensions.
fn out_in(dims: &[usize]) -> Result<(usize, usize)> {
    match dims.split_last() {
        Some((&i, rest)) if !rest.is_empty() => Ok((rest.iter().product(), i)),
        _ => Err(Error::Usage(format!(
            "Linear: a weight of shape {dims:?}; give (out, in), or (…, in)"
        ))),
    }
}

/// The contiguous elements of a layout.
fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "Linear")
}

/// y (B, O) = x (B, I) Wᵀ + b.
fn forward<T: Float + Send + Sync>(
    x: &[T],
    w: &[T],
    b: &[T],
    rows: usize,
    i: usize,
    o: usize,
) -> Vec<T> {
    // Every element written: by the bias, or by the GEMM.
    let mut y = crate::kernels::unfilled(rows * o, T::NAN);
    let with_bias = !b.is_empty();
    if with_bias {
        fill_rows(&mut y, b);
    }
    // x · Wᵀ: both run along I (our sgemm where it beats the crate there).
    let p = Abt {
        m: rows,
        n: o,
        k: i,
        a: x,
        lda: i,
        b: w,
        ldb: i,
    };
    T::matmul_abt(p, &mut y, o, with_bias);
    y
}

/// Every row of `y` set to `b` (over the threads for a large y).
fn fill_rows<T: Copy + Send + Sync>(y: &mut [T], b: &[T]) {
    crate::kernels::for_chunks_mut(y, b.len(), |_, row| row.copy_from_slice(b));
}

/// y (B, O) = x (B, I) Wᵀ + b on bf16 inputs with f32 sums.
fn forward_bf16(x: &[f32], w: &[f32], b: &[f32], (rows, i, o): (usize, usize, usize)) -> Vec<f32> {
    // Every element written: by the bias, or by the GEMM.
    let mut y = crate::kernels::unfilled(rows * o, f32::NAN);
    let with_bias = !b.is_empty();
    if with_bias {
        fill_rows(&mut y, b);
    }
    // W (O, I) read as Wᵀ (I, O): element (k, n) at n·I + k.
    matmul_bf16_threaded(rows, o, i, (&mut y, o, 1), with_bias, (x, i, 1), (w, 1, i));
    y
}

/// The CPU kernels' op of a layer.
struct LinearOp(Linear);

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "shardnet-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let i = xl.shape().dims().last().copied().unwrap_or(0);
        let rows = lead(xl.shape().dims());
        // From the dimensions: a shard with no inputs (i = 0) still has o.
        let o = wl
            .shape()
            .dims()
            .split_last()
            .map_or(0, |(_, rest)| rest.iter().product());
        let y = match (xs, ws, bs) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) if self.0.bf16 => {
                CpuStorage::F32(forward_bf16(
                    view(x, xl)?,
                    view(w, wl)?,
                    view(b, bl)?,
                    (rows, i, o),
                ))
            }
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => CpuStorage::F32(
                forward(view(x, xl)?, view(w, wl)?, view(b, bl)?, rows, i, o),
            ),
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => CpuStorage::F64(
                forward(view(x, xl)?, view(w, wl)?, view(b, bl)?, rows, i, o),
            ),
            _ => candle_core::bail!("shardnet Linear: f32 or f64, one dtype for x, W and b"),
        };
        let mut dims = xl.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = o;
        }
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = self
            .0
            .backward_kernels(x, grad, x.track_op())
            .map_err(candle_core::Error::wrap)?;
        // The parameters are Vars: candle needs no gradient entry for them.
        Ok((dx, None, None))
    }
}

impl Linear {
    /// y = x Wᵀ + b as a value outside candle's graph: nothing is kept for
    /// a backward, which [`Self::backward_detached`] does by hand (an op
    /// that communicates around the layer and keeps less than candle
    /// would: sequence parallelism's regions).
    pub(crate) fn forward_detached(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward(&x.detach())?.detach())
    }

    /// The backward of y = x Wᵀ + b at `x` for dL/dy = `g`: dW and db
    /// added to the parameters' gradients (now, or in a zero-bubble
    /// pipeline's W pass), dL/dx returned; the same GEMMs as the layer's
    /// own backward.
    pub(crate) fn backward_detached(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        self.backward_apart(x, g, true)?
            .ok_or_else(|| Error::Usage("Linear: no input gradient".into()))
    }

    /// [`Self::backward_detached`], dL/dx computed only if `want_dx`.
    fn backward_apart(&self, x: &Tensor, g: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let x = x.detach();
        if crate::kernels::fast(x.device()) {
            return self.backward_kernels(&x, g, want_dx);
        }
        // The generic path: candle's ops, the parameters' gradients added.
        let (o, i) = out_in(self.weight.value().dims())?;
        let rows = lead(x.dims());
        let (x2, g2) = (x.reshape((rows, i))?, g.reshape((rows, o))?);
        let w = self.weight.value().reshape((o, i))?;
        let mm = |a: &Tensor, b: &Tensor| self.generic_matmul(a, b);
        let dx = if !want_dx {
            None
        } else if o == 0 {
            // No output features (a shard without heads): no gradient.
            Some(x.zeros_like()?)
        } else {
            Some(mm(&g2, &w)?.reshape(x.shape())?)
        };
        let (weight, bias) = (self.weight.clone(), self.bias.clone());
        let (gt, xw) = (g2.t()?.contiguous()?, x2);
        let dw = mm(&gt, &xw)?.reshape(weight.value().shape())?;
        let db = bias
            .as_ref()
            .map(|b| g2.sum(0)?.reshape(b.value().shape()))
            .transpose()?;
        super::deferred::weight_grad(move || {
            weight.add_grad(&dw)?;
            if let (Some(b), Some(db)) = (&bias, &db) {
                b.add_grad(db)?;
            }
            Ok(())
        })?;
        Ok(dx)
    }

    /// a · b in candle's ops: on bf16 operands (the output rounded to
    /// bf16, then widened) for a bf16 layer's f32 tensors.
    fn generic_matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok(if self.bf16 && a.dtype() == DType::F32 {
            a.to_dtype(DType::BF16)?
                .matmul(&b.to_dtype(DType::BF16)?)?
                .to_dtype(DType::F32)?
        } else {
            a.matmul(b)?
        })
    }

    /// The CPU kernels' backward at `x` for dL/dy = `grad`: dW and db into
    /// the parameters (now, or deferred), and dL/dx if `want_dx`.
    fn backward_kernels(&self, x: &Tensor, grad: &Tensor, want_dx: bool) -> Result<Option<Tensor>> {
        let g = grad.contiguous()?;
        let w = self.weight.value();
        // dW and db now, or in the W pass of a zero-bubble pipeline.
        let (weight, bias, gw, xw) = (self.weight.clone(), self.bias.clone(), g.clone(), x.clone());
        let bf16 = self.bf16 && x.dtype() == DType::F32;
        super::deferred::weight_grad(move || {
            weight.accumulate(&gw, &xw, WeightGrad { bf16 })?;
            if let Some(b) = &bias {
                b.accumulate(&gw, &gw, BiasGrad)?;
            }
            Ok(())
        })?;
        if !want_dx {
            return Ok(None);
        }
        let (o, i) = out_in(w.dims())?;
        let rows = lead(x.dims());
        Ok(Some(if o == 0 {
            // No output features (a shard without heads): no gradient.
            x.zeros_like()?
        } else if bf16 {
            // dx (B, I) = g (B, O) · W (O, I), every element written.
            let mut dx = crate::kernels::unfilled(rows * i, f32::NAN);
            crate::kernels::with_f32s(&g, "Linear", |g| {
                crate::kernels::with_f32s(w, "Linear", |w| {
                    matmul_bf16_threaded(rows, i, o, (&mut dx, i, 1), false, (g, o, 1), (w, i, 1));
                    Ok::<_, candle_core::Error>(())
                })
            })?;
            Tensor::from_vec(dx, x.shape(), x.device())?
        } else {
            let dx = g.reshape((rows, o))?.matmul(&w.detach().reshape((o, i))?)?;
            dx.reshape(x.shape())?
        }))
    }
}

/// The rows of a tensor of these dimensions: the product of all but the
/// last (which may be 0: a shard without features still has its rows).
fn lead(dims: &[usize]) -> usize {
    dims.split_last()
        .map_or(0, |(_, rest)| rest.iter().product())
}

/// (rows, last dimension) of a layout of any rank ≥ 1: the leading
/// dimensions are rows.
fn rows_last(l: &Layout) -> (usize, usize) {
    let last = l.shape().dims().last().copied().unwrap_or(0);
    (lead(l.shape().dims()), last)
}

/// dW (O, I) (+)= gᵀ (O, B) · x (B, I), on bf16 inputs if `bf16`.
struct WeightGrad {
    bf16: bool,
}

fn weight_grad<T: Float>(
    dw: &mut [T],
    g: &[T],
    x: &[T],
    rows: usize,
    o: usize,
    i: usize,
    overwrite: bool,
) {
    // lhs = gᵀ: element (m, k) is g[k, m].
    matmul(o, i, rows, dw, !overwrite, (g, 1, o), (x, i, 1));
}

impl Accumulate for WeightGrad {
    fn name(&self) -> &'static str {
        "shardnet-linear-weight-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(g, gl), (x, xl)]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        let (rows, o) = rows_last(gl);
        let (_, i) = rows_last(xl);
        match (dst, g, x) {
            (CpuStorage::F32(d), CpuStorage::F32(g), CpuStorage::F32(x)) if self.bf16 => {
                let (g, x) = (view(g, gl)?, view(x, xl)?);
                matmul_bf16_threaded(o, i, rows, (d, i, 1), !overwrite, (g, 1, o), (x, i, 1));
            }
            (CpuStorage::F32(d), CpuStorage::F32(g), CpuStorage::F32(x)) => {
                weight_grad(d, view(g, gl)?, view(x, xl)?, rows, o, i, overwrite)
            }
            (CpuStorage::F64(d), CpuStorage::F64(g), CpuStorage::F64(x)) => {
                weight_grad(d, view(g, gl)?, view(x, xl)?, rows, o, i, overwrite)
            }
            _ => candle_core::bail!("shardnet Linear: gradient dtypes differ"),
        }
        Ok(())
    }
}

/// db (O) (+)= Σ_rows g.
pub(super) struct BiasGrad;

fn bias_grad<T: Float>(db: &mut [T], g: &[T], o: usize, overwrite: bool) {
    debug_assert_eq!(db.len(), o);
    // The batch's rows in blocks: a long batch sums as a blocked BLAS would.
    crate::kernels::sum::rows(db, g, !overwrite);
}

impl Accumulate for BiasGrad {
    fn name(&self) -> &'static str {
        "shardnet-linear-bias-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(g, gl), _]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        let (_, o) = rows_last(gl);
        match (dst, g) {
            (CpuStorage::F32(d), CpuStorage::F32(g)) => bias_grad(d, view(g, gl)?, o, overwrite),
            (CpuStorage::F64(d), CpuStorage::F64(g)) => bias_grad(d, view(g, gl)?, o, overwrite),
            _ => candle_core::bail!("shardnet Linear: gradient dtypes differ"),
        }
        Ok(())
    }
}

super::module::candle_module!(Linear);
