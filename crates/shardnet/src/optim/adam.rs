//! Adam (Kingma & Ba), fused and in place.
//!
//! Per element, at step t: g ← g + λ·θ (weight decay as PyTorch's
//! `torch.optim.Adam`, an L2 term; 0 by default); m ← β1 m + (1 − β1) g;
//! v ← β2 v + ((1 − β2) g) g; θ ← θ − (α m) / (√v / √(1 − β2ᵗ) + ε) with
//! α = lr / (1 − β1ᵗ): PyTorch's order of operations. Decoupled (AdamW,
//! PyTorch's `torch.optim.AdamW`), the decay leaves the gradient and
//! shrinks the parameter first: θ ← θ·(1 − lr·λ), then the update with g
//! alone. A parameter that
//! received no gradient since the last step is an error naming it
//! (PyTorch and candle skip it silently, which hides a gradient left in
//! candle's `GradStore`). A fused step updates the rows it is passed and
//! their moments only, with the step's t (Partial FC's unsampled rows keep
//! θ, m and v). f32 parameters.
//!
//! Every constant (1 − β1, 1 − β2, α, √(1 − β2ᵗ), and β1, β2, ε, λ
//! themselves) is formed in f64 and rounded to f32 once, as PyTorch's
//! Python floats are: 1 − β2 taken in f32 from β2 already rounded is
//! 9.99987e-4, not 1e-3, and every step would come out 6.4e-6 too large.
//! The CPU kernel and the generic path (candle's ops, for any device) use
//! the same f32 constants in the same order, so on the CPU they give the
//! same bits from the same gradients.
//!
//! candle-nn's AdamW builds about ten temporary tensors per parameter per
//! step (578 ms for a 4096 × 4096 weight on one core here, against PyTorch's
//! 113 ms); this is one pass over memory.

use super::fused::{other_path, rows_of, set_rows, zeroed, Common, DeviceRows, FusedStep};
use crate::functions::{RowUpdate, Rows};
use crate::nn::{Half, Param, Slot, StateTensor};
use crate::{Error, Result};
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor, Var};
use std::sync::{Arc, Mutex};

/// Adam's two moments of one parameter: on the host for the fused CPU
/// kernel, as tensors on the parameter's device for the generic path.
#[derive(Clone)]
enum Moments {
    Host(Arc<Mutex<(Vec<f32>, Vec<f32>)>>),
    Device(Var, Var),
}

/// Adam over a fixed list of parameters.
pub struct Adam {
    /// Parameters, step count (t), the fused updates' scalars.
    pub(super) common: Common,
    moments: Vec<Moments>,
    /// Learning rate.
    pub lr: f64,
    /// β1, β2.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// λ: the L2 weight decay added to the gradient, or (decoupled) the
    /// rate of AdamW's θ ← θ(1 − lr·λ).
    pub weight_decay: f64,
    /// AdamW: the decay is decoupled from the gradient.
    pub decoupled: bool,
}

impl Adam {
    /// Adam with β = (0.9, 0.999), ε = 1e-8 (Chainer's and PyTorch's defaults).
    pub fn new(params: Vec<Param>, lr: f64) -> Result<Self> {
        let moments = params
            .iter()
            .map(|p| {
                if p.value().dtype() != candle_core::DType::F32 {
                    return Err(Error::Usage(format!("Adam: {} is not f32", p.name())));
                }
                zero_moments(p, p.value().dims())
            })
            .collect::<Result<_>>()?;
        Ok(Adam {
            common: Common::new(params),
            moments,
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        })
    }

    /// Let backward update `param` (one of this optimizer's) row by row as
    /// its gradient is produced, on the CPU kernels or the generic path;
    /// see [`super::Optimizer::fuse`].
    pub fn fuse(&self, param: &Param) -> Result<()> {
        let k = self.common.fusable("Adam", param)?;
        param.set_fused(Some(Arc::new(AdamRows {
            step: self.common.fused.clone(),
            moments: self.moments[k].clone(),
            betas: self.betas,
            eps: self.eps,
            decay: self.weight_decay,
            decoupled: self.decoupled,
        })));
        Ok(())
    }

    /// Hold and update the moments of this rank's share of the parameters'
    /// rows only, one of `ranks` data-parallel replicas (ZeRO stage 1); see
    /// [`super::Optimizer::shard_state`].
    pub fn shard_state(&mut self, ranks: usize, rank: usize) -> Result<()> {
        self.common.share("Adam", ranks, rank)?;
        for k in 0..self.moments.len() {
            let (shape, _) = self.common.state_layout(k);
            self.moments[k] = zero_moments(&self.common.params[k], &shape)?;
        }
        Ok(())
    }

    /// The moments as training state, read and written in place:
    /// `adam.m/{name}` and `adam.v/{name}` of every parameter, sharded as
    /// the parameter is, or as this rank's rows of it where the state is
    /// sharded over replicas.
    pub fn state(&self) -> Vec<StateTensor> {
        let mut out = Vec::with_capacity(2 * self.common.params.len());
        for (k, (p, m)) in self.common.params.iter().zip(&self.moments).enumerate() {
            let (shape, shard) = self.common.state_layout(k);
            let slots = match m {
                Moments::Host(pair) => [
                    Slot::HostPair(pair.clone(), Half::First),
                    Slot::HostPair(pair.clone(), Half::Second),
                ],
                Moments::Device(m, v) => [Slot::Var(m.clone()), Slot::Var(v.clone())],
            };
            for (which, slot) in ["m", "v"].into_iter().zip(slots) {
                out.push(StateTensor {
                    name: format!("adam.{which}/{}", p.name()),
                    shape: shape.clone(),
                    shard,
                    slot,
                });
            }
        }
        out
    }

    /// Apply one update from the accumulated gradients, and consume them.
    pub fn step(&mut self) -> Result<()> {
        let t = self.common.step + 1;
        let decay = Decay::of(self.weight_decay, self.decoupled);
        let scalars = AdamScalars::new(self.lr, self.betas, self.eps, decay, t, 1.0);
        let Adam {
            common, moments, ..
        } = self;
        common.step("Adam", |k, p, g, rows| {
            // This rank's rows where the state is sharded, all elsewhere.
            let (theta, g) = (rows_of(p.value(), &rows)?, rows_of(&g, &rows)?);
            let m = match &moments[k] {
                Moments::Host(m) => m,
                Moments::Device(m, v) => {
                    let (theta, m_new, v_new) =
                        device_update(&theta, &g, m.as_tensor(), v.as_tensor(), &scalars)?;
                    set_rows(p, &rows, &theta)?;
                    m.set(&m_new)?;
                    v.set(&v_new)?;
                    return Ok(());
                }
            };
            let kernel = Kernel {
                moments: m,
                s: scalars,
            };
            theta.inplace_op2(&g, &kernel)?;
            Ok(())
        })?;
        Ok(())
    }
}

/// Zeroed moments of `shape` for `p`: on the host for the CPU kernels, on
/// `p`'s device for the generic path.
fn zero_moments(p: &Param, shape: &[usize]) -> Result<Moments> {
    let _state = crate::heap::counting_as(crate::heap::Part::Optimizer);
    let v = p.value();
    Ok(if crate::kernels::fast(v.device()) {
        let n = shape.iter().product();
        Moments::Host(Arc::new(Mutex::new((zeroed(n), zeroed(n)))))
    } else {
        let zeros = || Var::zeros(shape, v.dtype(), v.device());
        Moments::Device(zeros()?, zeros()?)
    })
}

/// Adam's weight decay: an L2 term added to the gradient, or AdamW's
/// decoupled shrinking of the parameter.
#[derive(Clone, Copy)]
enum Decay {
    L2(f64),
    Decoupled(f64),
}

impl Decay {
    fn of(weight_decay: f64, decoupled: bool) -> Self {
        if decoupled {
            Decay::Decoupled(weight_decay)
        } else {
            Decay::L2(weight_decay)
        }
    }
}

/// Everything the per-element update needs, in f32: each formed in f64
/// and rounded once.
#[derive(Clone, Copy)]
struct AdamScalars {
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    /// α = lr / (1 − β1ᵗ).
    step_size: f32,
    /// √(1 − β2ᵗ).
    bc2_sqrt: f32,
    eps: f32,
    /// λ of the L2 term (0 when decoupled).
    decay: f32,
    /// 1 − lr·λ, AdamW's shrinking of θ (1 otherwise: θ·1 is θ).
    keep: f32,
    unscale: f32,
}

impl AdamScalars {
    fn new(lr: f64, (b1, b2): (f64, f64), eps: f64, decay: Decay, t: u64, unscale: f64) -> Self {
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let (l2, keep) = match decay {
            Decay::L2(l) => (l, 1.0),
            Decay::Decoupled(l) => (0.0, 1.0 - lr * l),
        };
        AdamScalars {
            b1: b1 as f32,
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            step_size: (lr / (1.0 - b1.powi(t))) as f32,
            bc2_sqrt: (1.0 - b2.powi(t)).sqrt() as f32,
            eps: eps as f32,
            decay: l2 as f32,
            keep: keep as f32,
            unscale: unscale as f32,
        }
    }
}

/// The per-element update of `theta` from `g` with moments `m`, `v` (all
/// of one length).
fn update(theta: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamScalars) {
    // Compiled for the CPU's widest vectors (sqrt and division included).
    crate::kernels::dispatch!(|| {
        #[inline(always)]
        fn go(theta: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamScalars) {
            let AdamScalars {
                b1,
                one_minus_b1,
                b2,
                one_minus_b2,
                step_size,
                bc2_sqrt,
                eps,
                decay,
                keep,
                unscale,
            } = *s;
            // Zipped slices of one length: no bounds checks, so the loop
            // vectorises. PyTorch's order: θ·(1 − lr·λ) first (AdamW),
            // (c·g)·g, (α·m) / denominator.
            for (((t, gk), mk), vk) in theta.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let gk = *gk * unscale + decay * *t;
                *mk = b1 * *mk + one_minus_b1 * gk;
                *vk = b2 * *vk + one_minus_b2 * gk * gk;
                let denom = vk.sqrt() / bc2_sqrt + eps;
                *t = *t * keep - step_size * *mk / denom;
            }
        }
        go(theta, g, m, v, s)
    })
}

/// The same update in candle's ops, for any device (the generic path):
/// θ, its gradient and moments → the new θ, m and v; the same f32
/// constants in the same order as [`update`] (candle's affine rounds its
/// f64 factor to f32 once, as the kernel's scalars are).
fn device_update(
    theta: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &AdamScalars,
) -> Result<(Tensor, Tensor, Tensor)> {
    let f = f64::from;
    let g = if s.unscale != 1.0 {
        (g * f(s.unscale))?
    } else {
        g.clone()
    };
    let g = if s.decay != 0.0 {
        (&g + (theta * f(s.decay))?)?
    } else {
        g
    };
    let theta = if s.keep != 1.0 {
        (theta * f(s.keep))?
    } else {
        theta.clone()
    };
    let m_new = ((m * f(s.b1))? + (&g * f(s.one_minus_b1))?)?;
    let v_new = ((v * f(s.b2))? + ((&g * f(s.one_minus_b2))? * &g)?)?;
    // A division, as the kernel's (`Tensor / f64` multiplies by the
    // reciprocal).
    let bc2_sqrt = Tensor::new(s.bc2_sqrt, g.device())?;
    let denom = (v_new.sqrt()?.broadcast_div(&bc2_sqrt)? + f(s.eps))?;
    let step = ((&m_new * f(s.step_size))? / denom)?;
    Ok(((theta - step)?, m_new, v_new))
}

/// The fused row update of one parameter, with its moments (on the host
/// for the CPU kernel, on the device for the generic path).
struct AdamRows {
    step: FusedStep,
    moments: Moments,
    betas: (f64, f64),
    eps: f64,
    decay: f64,
    decoupled: bool,
}

impl AdamRows {
    /// The scalars of the step this backward belongs to.
    fn scalars(&self) -> Result<AdamScalars> {
        let sc = self.step.scalars("Adam")?;
        let decay = Decay::of(self.decay, self.decoupled);
        Ok(AdamScalars::new(
            sc.lr, self.betas, self.eps, decay, sc.t, sc.unscale,
        ))
    }
}

impl RowUpdate for AdamRows {
    fn update_rows(
        &self,
        rows: Rows<'_>,
        weight: &mut [f32],
        grad: &[f32],
        d: usize,
    ) -> Result<()> {
        let s = self.scalars()?;
        let Moments::Host(moments) = &self.moments else {
            return Err(other_path("Adam", true));
        };
        let mut guard = super::fused::lock(moments);
        let (m, v) = &mut *guard;
        super::fused::for_rows(rows, d, weight.len(), grad, |r, g| {
            let span = r * d..(r + 1) * d;
            update(
                &mut weight[span.clone()],
                g,
                &mut m[span.clone()],
                &mut v[span],
                &s,
            )
        })
    }

    fn update_rows_on_device(&self, rows: Rows<'_>, weight: &Tensor, grad: &Tensor) -> Result<()> {
        let s = self.scalars()?;
        let Moments::Device(m, v) = &self.moments else {
            return Err(other_path("Adam", false));
        };
        let Some(at) = DeviceRows::new("Adam", rows, weight, grad)? else {
            return Ok(());
        };
        let (m, v) = (m.as_tensor(), v.as_tensor());
        let (theta, m_new, v_new) =
            device_update(&at.read(weight)?, grad, &at.read(m)?, &at.read(v)?, &s)?;
        at.write(weight, &theta)?;
        at.write(m, &m_new)?;
        at.write(v, &v_new)?;
        Ok(())
    }
}

struct Kernel<'a> {
    moments: &'a Mutex<(Vec<f32>, Vec<f32>)>,
    s: AdamScalars,
}

impl InplaceOp2 for Kernel<'_> {
    fn name(&self) -> &'static str {
        "shardnet-adam"
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (dst, g) else {
            candle_core::bail!("Adam: f32 parameters and gradients");
        };
        let theta = crate::kernels::view_mut(theta, dl, "Adam")?;
        let g = crate::kernels::view(g, gl, "Adam")?;
        let n = theta.len();
        let mut guard = super::fused::lock(self.moments);
        let (m, v) = &mut *guard;
        let (m, v) = (&mut m[..n], &mut v[..n]);
        if let Some(part) = super::fused::pieces(n) {
            use rayon::prelude::*;
            theta
                .par_chunks_mut(part)
                .zip(g.par_chunks(part))
                .zip(m.par_chunks_mut(part))
                .zip(v.par_chunks_mut(part))
                .for_each(|(((t, g), m), v)| update(t, g, m, v, &self.s));
        } else {
            update(theta, g, m, v, &self.s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update (sqrt and division) gives the same bits at every vector
    /// width, tails included.
    #[test]
    fn the_update_is_the_same_at_every_simd_level() {
        for (n, decoupled) in [(1, false), (15, true), (17, false), (100, true)] {
            let s = AdamScalars::new(1e-3, (0.9, 0.999), 1e-8, Decay::of(0.01, decoupled), 1, 0.5);
            crate::kernels::assert_same_at_every_level(
                "Adam",
                || {
                    let mut t = crate::kernels::test_values(1, n);
                    let mut m = crate::kernels::test_values(2, n);
                    let mut v: Vec<f32> = crate::kernels::test_values(3, n)
                        .iter()
                        .map(|x| x.abs())
                        .collect();
                    update(
                        &mut t,
                        &crate::kernels::test_values(4, n),
                        &mut m,
                        &mut v,
                        &s,
                    );
                    [t, m, v].concat()
                },
                |r| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            );
        }
    }

    /// A parameter large enough to be split over the threads: the same
    /// values as one thread's pass.
    #[test]
    fn a_split_step_equals_the_serial_one() {
        super::super::fused::assert_split_equals_serial(
            |p| Adam::new(vec![p], 1e-3).unwrap(),
            Adam::step,
        );
    }
}
