//! The CPU kernel as candle ops: the forward op, whose backward writes dW
//! and db into the `Param`s in place and returns dx, and the gradient ops
//! it runs.

use super::geom::Geom;
use super::input_grad::on_sgemm;
use super::passes::{bias_grad, forward, input_grad, view, weight_grad};
use super::{dense, winograd};
use crate::nn::param::{Accumulate, Param};
use crate::Result;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

/// The forward op: y from (x, W, b); its backward writes dW and db into the
/// `Param`s and returns dx.
pub(super) struct ConvOp {
    pub(super) g: Geom,
    pub(super) weight: Param,
    pub(super) bias: Option<Param>,
    /// The forward's U on the Winograd path, for the backward (which then
    /// packs none): measured on one Cascade Lake core, VGG16 at batch 32,
    /// U's packing was 4.9% of a step's samples, half of it the backward's.
    /// 16/9 of the weights, held per forward until its backward (or until
    /// the graph is dropped).
    pub(super) kept: std::sync::Mutex<Option<winograd::PackedU>>,
}

impl ConvOp {
    /// The op for one forward of a layer `g` with these parameters.
    pub(super) fn new(g: Geom, weight: Param, bias: Option<Param>) -> Self {
        ConvOp {
            g,
            weight,
            bias,
            kept: std::sync::Mutex::new(None),
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Option<winograd::PackedU>> {
        // Only ever holds a value: a panic elsewhere left nothing half done.
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CustomOp3 for ConvOp {
    fn name(&self) -> &'static str {
        "shardnet-conv2d"
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
        let g = &self.g;
        let y = match (xs, ws, bs) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                let (x, w, b) = (view(x, xl)?, view(w, wl)?, view(b, bl)?);
                CpuStorage::F32(if dense::applies(g) {
                    dense::forward(g, x, w, b)
                } else if winograd::applies(g) {
                    let u = winograd::pack(g, w);
                    let y = winograd::forward(g, x, &u, b);
                    *self.kept() = Some(u);
                    y
                } else {
                    forward(g, x, w, b)
                })
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(forward(g, view(x, xl)?, view(w, wl)?, view(b, bl)?))
            }
            _ => candle_core::bail!("shardnet Conv2d: f32 or f64, one dtype for x, W and b"),
        };
        Ok((y, Shape::from((g.n, g.o, g.ho, g.wo))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = self.backward_of(x, w, &grad.contiguous()?, x.track_op())?;
        Ok((dx, None, None))
    }
}

impl ConvOp {
    /// The backward from dy (contiguous): dW and db added into the
    /// `Param`s, dx returned when `input_grad`.
    pub(super) fn backward_of(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        input_grad: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = self.g;
        let ok = |r: Result<()>| r.map_err(|e| candle_core::Error::Msg(e.to_string()));
        let mut dx = if input_grad {
            self.winograd_backward(dy, x, w)?
        } else {
            None
        };
        if dx.is_none() {
            ok(self.weight.accumulate(dy, x, WeightGrad(g)))?;
        }
        if let Some(b) = &self.bias {
            ok(b.accumulate(dy, dy, BiasGrad(g)))?;
        }
        if dx.is_none() && input_grad {
            dx = Some(dy.apply_op2_no_bwd(&w.detach(), &InputGrad(g))?);
        }
        // A U the backward did not use goes back now, not with the graph.
        drop(self.kept().take());
        Ok(dx)
    }

    /// dx, with dW added into the weight's gradient, in one pass of the
    /// Winograd path ([`winograd::backward`]: each chunk's dM transformed
    /// once for both) where the passes apart would take that path and x, W
    /// and G are f32 on the CPU; `None` (nothing done) elsewhere.
    fn winograd_backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = &self.g;
        let f32_cpu = |t: &Tensor| t.dtype() == DType::F32 && t.device().is_cpu();
        // The passes apart take the dense path first: so here.
        if dense::applies(g)
            || !winograd::applies(g)
            || g.o == 0
            || ![dy, x, w, self.weight.value()].into_iter().all(f32_cpu)
        {
            return Ok(None);
        }
        let mut dx = None;
        let name = "Conv2d";
        crate::kernels::with_f32s(dy, name, |dy| {
            crate::kernels::with_f32s(x, name, |xs| {
                crate::kernels::with_f32s(w, name, |ws| {
                    // The forward's U (packed again if a second backward
                    // through this op took it).
                    let u = self.kept().take().unwrap_or_else(|| winograd::pack(g, ws));
                    self.weight
                        .update_grad(|dw, empty| {
                            dx = winograd::backward(g, dy, xs, Some(&u), dw, empty);
                            Ok(())
                        })
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))
                })
            })
        })?;
        dx.map(|v| Tensor::from_vec(v, (g.n, g.c, g.h, g.w), x.device()))
            .transpose()
    }
}

/// dx from (G, W).
struct InputGrad(Geom);

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        "shardnet-conv2d-input-grad"
    }
    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = &self.0;
        let dx = match (gs, ws) {
            (CpuStorage::F32(d), CpuStorage::F32(w)) => {
                let (d, w) = (view(d, gl)?, view(w, wl)?);
                CpuStorage::F32(if dense::applies(g) {
                    dense::input_grad(g, d, w)
                } else if winograd::applies(g) {
                    winograd::input_grad(g, d, w)
                } else {
                    on_sgemm(g, d, w).unwrap_or_else(|| input_grad(g, d, w))
                })
            }
            (CpuStorage::F64(d), CpuStorage::F64(w)) => {
                CpuStorage::F64(input_grad(g, view(d, gl)?, view(w, wl)?))
            }
            _ => candle_core::bail!("shardnet Conv2d: gradient dtypes differ"),
        };
        Ok((dx, Shape::from((g.n, g.c, g.h, g.w))))
    }
}

/// dW (+)= from (G, x).
struct WeightGrad(Geom);

impl Accumulate for WeightGrad {
    fn name(&self) -> &'static str {
        "shardnet-conv2d-weight-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(d, dl), (x, xl)]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        match (dst, d, x) {
            (CpuStorage::F32(w), CpuStorage::F32(d), CpuStorage::F32(x)) => {
                let (g, d, x) = (&self.0, view(d, dl)?, view(x, xl)?);
                if dense::applies(g) {
                    dense::weight_grad(g, w, d, x, overwrite)
                } else if winograd::applies(g) {
                    winograd::weight_grad(g, w, d, x, overwrite)
                } else {
                    weight_grad(g, w, d, x, overwrite)
                }
            }
            (CpuStorage::F64(w), CpuStorage::F64(d), CpuStorage::F64(x)) => {
                weight_grad(&self.0, w, view(d, dl)?, view(x, xl)?, overwrite)
            }
            _ => candle_core::bail!("shardnet Conv2d: gradient dtypes differ"),
        }
        Ok(())
    }
}

/// db (+)= from G.
struct BiasGrad(Geom);

impl Accumulate for BiasGrad {
    fn name(&self) -> &'static str {
        "shardnet-conv2d-bias-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(d, dl), _]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        match (dst, d) {
            (CpuStorage::F32(b), CpuStorage::F32(d)) => {
                bias_grad(&self.0, b, view(d, dl)?, overwrite)
            }
            (CpuStorage::F64(b), CpuStorage::F64(d)) => {
                bias_grad(&self.0, b, view(d, dl)?, overwrite)
            }
            _ => candle_core::bail!("shardnet Conv2d: gradient dtypes differ"),
        }
        Ok(())
    }
}
