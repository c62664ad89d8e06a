//! What the optimizers share: the scalars of a fused step (set before
//! backward, read by each row update), the rows of a fused step on a
//! device, resident zeroed state, the report of a parameter without
//! gradient (an error).

use crate::functions::Rows;
use crate::nn::{Param, Shard};
use crate::{Error, Result};
use candle_core::Tensor;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

/// The scalars of the step that the coming backward's fused row updates
/// belong to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scalars {
    /// The step's learning rate.
    pub lr: f64,
    /// The step's count t (Adam's bias corrections), from 1.
    pub t: u64,
    /// 1 / the loss scale: what the gradient is multiplied by first.
    pub unscale: f64,
}

/// The fused step's scalars, shared by an optimizer and its row updates:
/// armed before backward (`prepare_fused`), disarmed by the step. A row
/// update while disarmed is an error (it would use a stale learning rate).
#[derive(Clone, Default)]
pub(super) struct FusedStep(Arc<Mutex<Option<Scalars>>>);

impl FusedStep {
    pub fn arm(&self, s: Scalars) {
        *lock(&self.0) = Some(s);
    }

    pub fn disarm(&self) {
        *lock(&self.0) = None;
    }

    pub fn scalars(&self, opt: &str) -> Result<Scalars> {
        (*lock(&self.0)).ok_or_else(|| {
            Error::Usage(format!(
                "{opt}: a fused update ran outside a step: call prepare_fused(lr, unscale) \
                 before the backward whose gradient it applies"
            ))
        })
    }
}

/// What SGD and Adam keep besides their per-parameter state.
pub(super) struct Common {
    /// The parameters, in the order given.
    pub params: Vec<Param>,
    /// Updates applied so far (Adam's t).
    pub step: u64,
    /// The scalars the fused row updates share.
    pub fused: FusedStep,
    /// The rows (along dimension 0) of each parameter whose state this
    /// rank holds and updates, where the state is sharded over data-parallel
    /// replicas ([`super::Optimizer::shard_state`]); `None`: every row.
    pub shares: Vec<Option<Range<usize>>>,
}

impl Common {
    pub fn new(params: Vec<Param>) -> Self {
        let shares = vec![None; params.len()];
        Common {
            params,
            step: 0,
            fused: FusedStep::default(),
            shares,
        }
    }

    /// Share the state over `ranks` replicas, this rank `rank` of them:
    /// each parameter's rows split as [`crate::comm::chunk_range`] splits
    /// them, where that is a shard along dimension 0 of the global tensor
    /// (a parameter that is no shard, or one along dimension 0) and every
    /// rank gets a row; the others stay whole. Before the first step only,
    /// and not with fused updates.
    pub fn share(&mut self, opt: &str, ranks: usize, rank: usize) -> Result<()> {
        if ranks == 0 || rank >= ranks {
            return Err(Error::Usage(format!(
                "{opt}: rank {rank} of {ranks} replicas to shard the state over"
            )));
        }
        if self.step > 0 || self.shares.iter().any(Option::is_some) {
            return Err(Error::Usage(format!(
                "{opt}: shard the state before the first step, once (it has taken {} steps)",
                self.step
            )));
        }
        if let Some(p) = self.params.iter().find(|p| p.fused().is_some()) {
            return Err(Error::Usage(format!(
                "{opt}: {} is updated inside backward (fused); its state cannot also be \
                 sharded over replicas",
                p.name()
            )));
        }
        self.shares = self
            .params
            .iter()
            .map(|p| {
                let rows = *p.value().dims().first()?;
                (ranks > 1 && rows >= ranks && rows_in_global(p).is_some())
                    .then(|| crate::comm::chunk_range(rows, ranks, rank))
            })
            .collect();
        Ok(())
    }

    /// The position of `param`, which is to be updated inside backward
    /// (fused): one of this optimizer's, its state not sharded over
    /// replicas (a fused update covers every row).
    pub fn fusable(&self, opt: &str, param: &Param) -> Result<usize> {
        let k = index_of(&self.params, param)?;
        if self.shares[k].is_some() {
            return Err(Error::Usage(format!(
                "{opt}: {}'s state is sharded over replicas; it cannot also be updated inside \
                 backward (fuse before shard_state, which then refuses)",
                param.name()
            )));
        }
        Ok(k)
    }

    /// Parameter `k`'s state: its shape and where it lies in the global
    /// tensor (the parameter's own, or its rows' where the state is shared).
    pub fn state_layout(&self, k: usize) -> (Vec<usize>, Option<Shard>) {
        let p = &self.params[k];
        let mut shape = p.value().dims().to_vec();
        match &self.shares[k] {
            None => (shape, p.shard()),
            Some(rows) => {
                let (offset, global) = rows_in_global(p).unwrap_or((0, shape[0]));
                shape[0] = rows.len();
                let shard = Shard::along(0, &(offset + rows.start..offset + rows.end), global);
                (shape, Some(shard))
            }
        }
    }

    /// Arm the fused updates of the coming backward: this step's `lr`, its
    /// t, gradients multiplied by `unscale`.
    pub fn prepare_fused(&self, lr: f64, unscale: f64) {
        self.fused.arm(Scalars {
            lr,
            t: self.step + 1,
            unscale,
        });
    }

    /// Count a step, end the fused updates of its backward, and run
    /// `update(k, parameter k, its gradient)` for each parameter with a
    /// gradient (consumed). An empty shard is skipped; a parameter without
    /// gradient is an error (not a fused one: backward updated it).
    /// Returns t.
    pub fn step(
        &mut self,
        opt: &str,
        mut update: impl FnMut(usize, &Param, Tensor, Option<Range<usize>>) -> Result<()>,
    ) -> Result<u64> {
        // A parameter without gradient stops the step before anything
        // moves (no half-applied update).
        for p in &self.params {
            if p.value().elem_count() > 0 && p.grad().is_none() {
                missing(p, self.step + 1, opt)?;
            }
        }
        self.step += 1;
        self.fused.disarm();
        for (k, p) in self.params.iter().enumerate() {
            if p.value().elem_count() == 0 {
                // A rank's empty shard (fewer channels or classes than
                // ranks): nothing to update, and nothing to report.
                p.take_grad();
                continue;
            }
            match p.take_grad() {
                Some(g) => update(k, p, g, self.shares[k].clone())?,
                None => missing(p, self.step, opt)?,
            }
        }
        Ok(self.step)
    }
}

/// The piece length that splits an element-wise pass of `n` elements
/// over the threads, or `None` where it runs on this thread (small, or
/// inside a parallel task). Any cut gives the same values.
pub(super) fn pieces(n: usize) -> Option<usize> {
    crate::kernels::split_work(n).then(|| n.div_ceil(crate::kernels::threads()).max(1 << 14))
}

/// The lock, whether or not a panicking holder poisoned it.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `t`'s rows `rows` (along dimension 0; all of `t` where `None`): the
/// part of a parameter, its gradient or its state that this rank updates.
pub(super) fn rows_of(t: &Tensor, rows: &Option<Range<usize>>) -> Result<Tensor> {
    Ok(match rows {
        Some(r) => t.narrow(0, r.start, r.len())?,
        None => t.clone(),
    })
}

/// Set `p` to `rows_value` where the update covered its rows `rows` only
/// (the generic path; the CPU kernels write the rows in place).
pub(super) fn set_rows(p: &Param, rows: &Option<Range<usize>>, rows_value: &Tensor) -> Result<()> {
    match rows {
        Some(r) => p
            .var()
            .set(&p.value().slice_scatter0(rows_value, r.start)?)?,
        None => p.var().set(rows_value)?,
    }
    Ok(())
}

/// The rows of a weight (C_r, d) that a fused update steps on the
/// generic path, on the weight's device: read from the weight and each
/// state tensor, and written back in place, leaving every other row as it
/// is.
pub(super) enum DeviceRows {
    /// Rows `start .. start + len`.
    Range(usize, usize),
    /// The listed rows: their indices (k), and each index repeated along
    /// its row (k, d), for the scatter back.
    List(Tensor, Tensor),
}

impl DeviceRows {
    /// `rows` of `weight`, given their gradient `grad` ((rows.len(), d),
    /// checked); `None` where there are none.
    pub fn new(opt: &str, rows: Rows<'_>, weight: &Tensor, grad: &Tensor) -> Result<Option<Self>> {
        let (cr, d) = weight.dims2()?;
        if grad.dims() != [rows.len(), d] {
            return Err(Error::Usage(format!(
                "{opt}: a fused update of {} rows of {d} with a gradient of shape {:?}",
                rows.len(),
                grad.dims()
            )));
        }
        if let Some(r) = rows.iter().find(|&r| r >= cr) {
            return Err(Error::Usage(format!(
                "{opt}: fused update of row {r} of a weight of {cr} rows"
            )));
        }
        if rows.is_empty() {
            return Ok(None);
        }
        Ok(Some(match rows {
            Rows::Range(r) => DeviceRows::Range(r.start, r.len()),
            Rows::List(list) => {
                let idx = Tensor::new(list, weight.device())?;
                let spread = idx
                    .unsqueeze(1)?
                    .broadcast_as((list.len(), d))?
                    .contiguous()?;
                DeviceRows::List(idx, spread)
            }
        }))
    }

    /// These rows of `t` (the weight, or a state tensor shaped like it).
    pub fn read(&self, t: &Tensor) -> Result<Tensor> {
        Ok(match self {
            DeviceRows::Range(start, len) => t.narrow(0, *start, *len)?,
            DeviceRows::List(idx, _) => t.index_select(idx, 0)?,
        })
    }

    /// Write `rows` (these rows' new values) into `t`, in place.
    pub fn write(&self, t: &Tensor, rows: &Tensor) -> Result<()> {
        let rows = rows.contiguous()?;
        match self {
            DeviceRows::Range(start, _) => t.slice_set(&rows, 0, *start)?,
            DeviceRows::List(_, spread) => t.scatter_set(spread, &rows, 0)?,
        }
        Ok(())
    }
}

/// The error of a fused update whose optimizer state is on the other
/// path's side: on the device (`on_device`) while the CPU kernel runs, or
/// on the host while the generic path runs.
pub(super) fn other_path(opt: &str, on_device: bool) -> Error {
    let (state, runs) = if on_device {
        ("on the device (the generic path's)", "the CPU kernel")
    } else {
        ("on the host (the CPU kernels')", "the device-generic path")
    };
    Error::Usage(format!(
        "{opt}: the fused update's state is {state}, but {runs} ran it: choose the kernels \
         (SHARDNET_KERNELS, kernels::set_kernels) before building the optimizer"
    ))
}

/// `n` zeros, written (resident now, not on first touch): optimizer state
/// is all touched sooner or later, and memory measured early should say so.
pub(super) fn zeroed(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, 0.0);
    v
}

/// Where `p`'s rows (dimension 0) lie in its global tensor: (offset,
/// global rows). `None` where it is a shard along another dimension of
/// more than one rank (its rows' state would be a block of the global
/// state, which a checkpoint's shard cannot describe); a shard of one rank
/// (a tensor-parallel layer on one rank) is the whole.
fn rows_in_global(p: &Param) -> Option<(usize, usize)> {
    let dims = p.value().dims();
    let rows = *dims.first()?;
    match p.shard() {
        None => Some((0, rows)),
        Some(s) if s.dim == 0 => Some((s.offset, s.global)),
        Some(s) if s.offset == 0 && dims.get(s.dim) == Some(&s.global) => Some((0, rows)),
        Some(_) => None,
    }
}

/// The position of `param` (the same parameter, by its value) in `params`.
fn index_of(params: &[Param], param: &Param) -> Result<usize> {
    params
        .iter()
        .position(|p| p.value().id() == param.value().id())
        .ok_or_else(|| {
            Error::Usage(format!(
                "fuse: {} is not one of this optimizer's parameters",
                param.name()
            ))
        })
}

/// A parameter that received no gradient in a step is an error, never a
/// silent skip: most often the gradient is still in candle's `GradStore`
/// (a `Param::value` used in the user's own candle ops), or the parameter
/// is not part of the loss. A fused parameter was updated in backward.
fn missing(p: &Param, step: u64, opt: &str) -> Result<()> {
    if p.fused().is_some() {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "{opt} step {step}: parameter {} received no gradient. If your own candle ops use \
         Param::value, move their gradients in after backward with store.absorb(&mut grads) \
         (or compute with Param::tracked, whose gradient arrives by itself); if the parameter is \
         not part of the loss, leave it out of the optimizer",
        p.name()
    )))
}

/// `f(row, its gradient)` for each row of `rows`, checked against a weight
/// of `len` elements and a gradient of `rows.len()` rows of `d`.
pub(super) fn for_rows(
    rows: Rows<'_>,
    d: usize,
    len: usize,
    grad: &[f32],
    mut f: impl FnMut(usize, &[f32]),
) -> Result<()> {
    if grad.len() != rows.len() * d {
        return Err(Error::Usage(format!(
            "fused update: {} gradient values for {} rows of {d}",
            grad.len(),
            rows.len()
        )));
    }
    for (k, r) in rows.iter().enumerate() {
        if (r + 1) * d > len {
            return Err(Error::Usage(format!(
                "fused update: row {r} of a weight of {} rows",
                len / d.max(1)
            )));
        }
        f(r, &grad[k * d..(k + 1) * d]);
    }
    Ok(())
}

/// Three steps of an optimizer (`new` makes it over one parameter) on a
/// parameter large enough to be split over the threads ([`pieces`]), once
/// on this thread alone and once split: both results must be equal and
/// must have moved (on a 1-core machine both passes are serial).
#[cfg(test)]
pub(super) fn assert_split_equals_serial<O>(
    new: impl Fn(Param) -> O,
    step: impl Fn(&mut O) -> Result<()>,
) {
    use crate::comm::HOST;
    let n = 100_003;
    let theta: Vec<f32> = (0..n)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 53) % 97) as f32 / 48.0 - 1.0)
        .collect();
    let run = |serial: bool| -> Vec<f32> {
        let t = Tensor::from_vec(theta.clone(), n, &HOST).unwrap();
        let p = Param::new("w", &t).unwrap();
        let mut opt = new(p.clone());
        for _ in 0..3 {
            p.set_grad(&Tensor::from_vec(g.clone(), n, &HOST).unwrap())
                .unwrap();
            if serial {
                crate::kernels::serial(|| step(&mut opt)).unwrap();
            } else {
                step(&mut opt).unwrap();
            }
        }
        p.value().to_vec1::<f32>().unwrap()
    };
    let (one, split) = (run(true), run(false));
    assert_eq!(one, split);
    assert_ne!(one, theta, "the step moved nothing");
}
