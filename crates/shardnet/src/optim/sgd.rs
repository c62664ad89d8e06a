//! SGD with momentum and weight decay, fused and in place: PyTorch's
//! `torch.optim.SGD` (dampening 0, not Nesterov), InsightFace's optimizer
//! for the sharded head.
//!
//! Per element, at every step: d = g + λ·θ; with momentum μ > 0,
//! b ← μ·b + d (b starts at 0, so the first step's b is d, as PyTorch's
//! `clone` of d) and d = b; θ ← θ − lr·d. A parameter that received no
//! gradient since the last step is left as it is, its momentum too; so are
//! the rows a fused step does not pass (Partial FC's unsampled rows).
//! f32 parameters.

use super::fused::{other_path, rows_of, set_rows, zeroed, Common, DeviceRows, FusedStep};
use crate::functions::{RowUpdate, Rows};
use crate::nn::{Param, StateTensor};
use crate::{Error, Result};
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor, Var};
use std::sync::{Arc, Mutex};

/// One parameter's momentum: on the host for the fused CPU kernel, a tensor
/// on the parameter's device for the generic path; none where μ = 0.
#[derive(Clone)]
enum Buffer {
    None,
    Host(Arc<Mutex<Vec<f32>>>),
    Device(Var),
}

/// SGD over a fixed list of parameters.
pub struct Sgd {
    /// Parameters, step count, the fused updates' scalars.
    pub(super) common: Common,
    buffers: Vec<Buffer>,
    /// Learning rate.
    pub lr: f64,
    /// μ (0: plain SGD, no buffer).
    pub momentum: f64,
    /// λ, the L2 weight decay added to the gradient.
    pub weight_decay: f64,
}

/// The per-element update: `theta`, `g`, `buf` of one length (`buf` empty
/// where μ = 0); `g` multiplied by `unscale` first.
fn update(theta: &mut [f32], g: &[f32], buf: &mut [f32], s: &SgdScalars) {
    // Compiled for the CPU's widest vectors.
    crate::kernels::dispatch!(|| {
        #[inline(always)]
        fn go(theta: &mut [f32], g: &[f32], buf: &mut [f32], s: &SgdScalars) {
            let SgdScalars {
                lr,
                momentum,
                decay,
                unscale,
            } = *s;
            if buf.is_empty() {
                for (t, gk) in theta.iter_mut().zip(g) {
                    let d = *gk * unscale + decay * *t;
                    *t -= lr * d;
                }
                return;
            }
            // Zipped slices of one length: no bounds checks, so the loop
            // vectorises.
            for ((t, gk), b) in theta.iter_mut().zip(g).zip(buf.iter_mut()) {
                let d = *gk * unscale + decay * *t;
                *b = momentum * *b + d;
                *t -= lr * *b;
            }
        }
        go(theta, g, buf, s)
    })
}

/// The same update in candle's ops, for any device (the generic path):
/// θ, its gradient and momentum (`None` where μ = 0) → the new θ and
/// momentum; the same f32 constants in the same order as [`update`].
fn device_update(
    theta: &Tensor,
    g: &Tensor,
    buf: Option<&Tensor>,
    s: &SgdScalars,
) -> Result<(Tensor, Option<Tensor>)> {
    let f = f64::from;
    let g = if s.unscale != 1.0 {
        (g * f(s.unscale))?
    } else {
        g.clone()
    };
    let d = (&g + (theta * f(s.decay))?)?;
    Ok(match buf {
        Some(buf) => {
            let buf_new = ((buf * f(s.momentum))? + d)?;
            ((theta - (&buf_new * f(s.lr))?)?, Some(buf_new))
        }
        None => ((theta - (d * f(s.lr))?)?, None),
    })
}

#[derive(Clone, Copy)]
struct SgdScalars {
    lr: f32,
    momentum: f32,
    decay: f32,
    unscale: f32,
}

impl Sgd {
    /// SGD at `lr` with momentum μ and weight decay λ (InsightFace's head:
    /// μ = 0.9, λ = 5e-4).
    pub fn new(params: Vec<Param>, lr: f64, momentum: f64, weight_decay: f64) -> Result<Self> {
        let buffers = params
            .iter()
            .map(|p| {
                if p.value().dtype() != candle_core::DType::F32 {
                    return Err(Error::Usage(format!("SGD: {} is not f32", p.name())));
                }
                zero_buffer(p, p.value().dims(), momentum)
            })
            .collect::<Result<_>>()?;
        Ok(Sgd {
            common: Common::new(params),
            buffers,
            lr,
            momentum,
            weight_decay,
        })
    }

    /// Hold and update the momentum of this rank's share of the
    /// parameters' rows only, one of `ranks` data-parallel replicas (ZeRO
    /// stage 1); see [`super::Optimizer::shard_state`].
    pub fn shard_state(&mut self, ranks: usize, rank: usize) -> Result<()> {
        self.common.share("SGD", ranks, rank)?;
        for k in 0..self.buffers.len() {
            let (shape, _) = self.common.state_layout(k);
            self.buffers[k] = zero_buffer(&self.common.params[k], &shape, self.momentum)?;
        }
        Ok(())
    }

    /// The momentum buffers as training state, read and written in place:
    /// `sgd.momentum/{name}` of every parameter, sharded as the parameter
    /// is, or as this rank's rows of it where the state is sharded over
    /// replicas (none where μ = 0).
    pub fn state(&self) -> Vec<StateTensor> {
        let mut out = Vec::new();
        for (k, (p, b)) in self.common.params.iter().zip(&self.buffers).enumerate() {
            let slot = match b {
                Buffer::None => continue,
                Buffer::Host(v) => crate::nn::Slot::Host(v.clone()),
                Buffer::Device(v) => crate::nn::Slot::Var(v.clone()),
            };
            let (shape, shard) = self.common.state_layout(k);
            out.push(StateTensor {
                name: format!("sgd.momentum/{}", p.name()),
                shape,
                shard,
                slot,
            });
        }
        out
    }

    /// Let backward update `param` (one of this optimizer's) row by row as
    /// its gradient is produced, on the CPU kernels or the generic path;
    /// see [`super::Optimizer::fuse`].
    pub fn fuse(&self, param: &Param) -> Result<()> {
        let k = self.common.fusable("SGD", param)?;
        param.set_fused(Some(Arc::new(SgdRows {
            step: self.common.fused.clone(),
            momentum: self.momentum as f32,
            decay: self.weight_decay as f32,
            buf: self.buffers[k].clone(),
        })));
        Ok(())
    }

    /// Apply one update from the accumulated gradients, and consume them.
    /// A parameter the fused step already updated is skipped.
    pub fn step(&mut self) -> Result<()> {
        let s = SgdScalars {
            lr: self.lr as f32,
            momentum: self.momentum as f32,
            decay: self.weight_decay as f32,
            unscale: 1.0,
        };
        let Sgd {
            common, buffers, ..
        } = self;
        common.step("SGD", |k, p, g, rows| {
            // This rank's rows where the state is sharded, all elsewhere.
            let (theta, g) = (rows_of(p.value(), &rows)?, rows_of(&g, &rows)?);
            match &buffers[k] {
                Buffer::Device(buf) => {
                    let (theta, buf_new) = device_update(&theta, &g, Some(buf.as_tensor()), &s)?;
                    set_rows(p, &rows, &theta)?;
                    if let Some(b) = buf_new {
                        buf.set(&b)?;
                    }
                }
                Buffer::None if !crate::kernels::fast(g.device()) => {
                    set_rows(p, &rows, &device_update(&theta, &g, None, &s)?.0)?;
                }
                b => {
                    let buf = match b {
                        Buffer::Host(v) => Some(v.as_ref()),
                        _ => None,
                    };
                    theta.inplace_op2(&g, &Kernel { buf, s })?;
                }
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// A zeroed momentum buffer of `shape` for `p` (none where μ = 0): on the
/// host for the CPU kernels, on `p`'s device for the generic path.
fn zero_buffer(p: &Param, shape: &[usize], momentum: f64) -> Result<Buffer> {
    let _state = crate::heap::counting_as(crate::heap::Part::Optimizer);
    let v = p.value();
    Ok(if momentum == 0.0 {
        Buffer::None
    } else if crate::kernels::fast(v.device()) {
        Buffer::Host(Arc::new(Mutex::new(zeroed(shape.iter().product()))))
    } else {
        Buffer::Device(Var::zeros(shape, v.dtype(), v.device())?)
    })
}

/// The fused row update of one parameter, with its momentum (on the host
/// for the CPU kernel, on the device for the generic path).
struct SgdRows {
    step: FusedStep,
    momentum: f32,
    decay: f32,
    buf: Buffer,
}

impl SgdRows {
    /// The scalars of the step this backward belongs to.
    fn scalars(&self) -> Result<SgdScalars> {
        let sc = self.step.scalars("SGD")?;
        Ok(SgdScalars {
            lr: sc.lr as f32,
            momentum: self.momentum,
            decay: self.decay,
            unscale: sc.unscale as f32,
        })
    }
}

impl RowUpdate for SgdRows {
    fn update_rows(
        &self,
        rows: Rows<'_>,
        weight: &mut [f32],
        grad: &[f32],
        d: usize,
    ) -> Result<()> {
        let s = self.scalars()?;
        let buf = match &self.buf {
            Buffer::None => None,
            Buffer::Host(v) => Some(v),
            Buffer::Device(_) => return Err(other_path("SGD", true)),
        };
        let mut guard = buf.map(|b| super::fused::lock(b));
        super::fused::for_rows(rows, d, weight.len(), grad, |r, g| {
            let theta = &mut weight[r * d..(r + 1) * d];
            match guard.as_deref_mut() {
                Some(buf) => update(theta, g, &mut buf[r * d..(r + 1) * d], &s),
                None => update(theta, g, &mut [], &s),
            }
        })
    }

    fn update_rows_on_device(&self, rows: Rows<'_>, weight: &Tensor, grad: &Tensor) -> Result<()> {
        let s = self.scalars()?;
        let buf = match &self.buf {
            Buffer::None => None,
            Buffer::Device(v) => Some(v.as_tensor()),
            Buffer::Host(_) => return Err(other_path("SGD", false)),
        };
        let Some(at) = DeviceRows::new("SGD", rows, weight, grad)? else {
            return Ok(());
        };
        let old_buf = buf.map(|b| at.read(b)).transpose()?;
        let (theta, buf_new) = device_update(&at.read(weight)?, grad, old_buf.as_ref(), &s)?;
        at.write(weight, &theta)?;
        if let (Some(buf), Some(b)) = (buf, buf_new) {
            at.write(buf, &b)?;
        }
        Ok(())
    }
}

struct Kernel<'a> {
    buf: Option<&'a Mutex<Vec<f32>>>,
    s: SgdScalars,
}

impl InplaceOp2 for Kernel<'_> {
    fn name(&self) -> &'static str {
        "shardnet-sgd"
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (dst, g) else {
            candle_core::bail!("SGD: f32 parameters and gradients");
        };
        let theta = crate::kernels::view_mut(theta, dl, "SGD")?;
        let g = crate::kernels::view(g, gl, "SGD")?;
        let n = theta.len();
        let mut guard = self.buf.map(super::fused::lock);
        let buf: &mut [f32] = match guard.as_mut() {
            Some(b) => &mut b[..n],
            None => &mut [],
        };
        use rayon::prelude::*;
        match super::fused::pieces(n) {
            Some(part) if buf.is_empty() => theta
                .par_chunks_mut(part)
                .zip(g.par_chunks(part))
                .for_each(|(t, g)| update(t, g, &mut [], &self.s)),
            Some(part) => theta
                .par_chunks_mut(part)
                .zip(g.par_chunks(part))
                .zip(buf.par_chunks_mut(part))
                .for_each(|((t, g), b)| update(t, g, b, &self.s)),
            None => update(theta, g, buf, &self.s),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With and without momentum, a parameter large enough to be split
    /// over the threads: the same values as one thread's pass.
    #[test]
    fn a_split_step_equals_the_serial_one() {
        for momentum in [0.0, 0.9] {
            super::super::fused::assert_split_equals_serial(
                |p| Sgd::new(vec![p], 0.1, momentum, 1e-4).unwrap(),
                Sgd::step,
            );
        }
    }
}
