//! The row-update contract between the sharded head and whoever owns its
//! weight: [`InPlaceGrad`], a weight shard whose gradient a kernel
//! accumulates in place (`nn::Param` is one), and [`RowUpdate`], an
//! optimizer's step applied to some [`Rows`] of a weight as their gradient
//! is produced (the fused step; `optim`'s SGD and Adam implement it): on
//! host slices for the CPU kernel, in candle's ops on the weight's device
//! for the device-generic path.

use crate::Result;
use candle_core::Tensor;
use std::sync::Arc;

/// A weight shard whose gradient the op accumulates in place, as the GEMM
/// produces it (no B × C_r gradient tensor is made). `nn::Param` is one.
pub trait InPlaceGrad: Send + Sync {
    /// The value, a contiguous f32 tensor.
    fn value(&self) -> &Tensor;
    /// Whether a gradient has been accumulated since it was last consumed.
    fn has_grad(&self) -> bool;
    /// Run `f` on the f32 gradient buffer, told whether it is empty (then
    /// `f` must overwrite what it does not mean to leave stale).
    fn update_grad(&self, f: &mut (dyn FnMut(&mut [f32], bool) -> Result<()> + Send))
        -> Result<()>;
    /// A shared handle on the same weight and buffer, kept for backward.
    fn handle(&self) -> Arc<dyn InPlaceGrad>;
    /// The optimizer's update to apply to rows in place as their gradient
    /// is produced (the fused step), if one is set: then no gradient is
    /// accumulated.
    fn fused_update(&self) -> Option<Arc<dyn RowUpdate>> {
        None
    }
    /// Run `f` on the f32 value, in place (for the fused step).
    fn update_value(&self, f: &mut (dyn FnMut(&mut [f32]) -> Result<()> + Send)) -> Result<()>;
    /// Add `g` (shaped like the value, any device and dtype) to the
    /// gradient: what the generic path's backward delivers
    /// ([`crate::functions::tracked`]).
    fn add_grad(&self, g: &Tensor) -> Result<()>;
}

/// The rows of a weight (C_r, d) that one call of [`RowUpdate::update_rows`]
/// updates.
#[derive(Clone, Debug)]
pub enum Rows<'a> {
    /// Rows `start .. end`.
    Range(std::ops::Range<usize>),
    /// These rows, sorted (a class sample's).
    List(&'a [u32]),
}

impl Rows<'_> {
    /// How many rows.
    pub fn len(&self) -> usize {
        match self {
            Rows::Range(r) => r.len(),
            Rows::List(l) => l.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row indices, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let (range, list) = match self {
            Rows::Range(r) => (r.clone(), &[][..]),
            Rows::List(l) => (0..0, *l),
        };
        range.chain(list.iter().map(|&r| r as usize))
    }
}

/// An optimizer's step applied to some rows of a weight, given their
/// gradient: what the sharded head's backward calls (the CPU kernel block
/// by block, the generic path once for the rows taking part), so that no
/// gradient of the whole shard is ever held (the fused step). Rows not
/// passed are not touched (their optimizer state included).
pub trait RowUpdate: Send + Sync {
    /// Update rows `rows` of `weight` (the whole shard, (C_r, d) row-major)
    /// and their optimizer state, from `grad` ((rows.len(), d), in the order
    /// of `rows`): the CPU kernel's call, with the state on the host.
    fn update_rows(&self, rows: Rows<'_>, weight: &mut [f32], grad: &[f32], d: usize)
        -> Result<()>;
    /// The same update in candle's ops, on any device: rows `rows` of
    /// `weight` (the whole shard (C_r, d), written in place) and their
    /// optimizer state (on the weight's device), from `grad` ((rows.len(),
    /// d), in the order of `rows`): the device-generic path's call.
    fn update_rows_on_device(&self, rows: Rows<'_>, weight: &Tensor, grad: &Tensor) -> Result<()>;
}
