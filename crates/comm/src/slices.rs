//! Collectives over host f32 buffers, in place: `allreduce_slices` (the
//! gradients of data parallelism) and its two halves by rows,
//! `reduce_scatter_slices` and `allgather_slices` (each rank's rows of every
//! buffer, [`row_share`]). Backends that share memory work straight between
//! the ranks' buffers ([`crate::Backend::allreduce_in_place`],
//! [`crate::Backend::rows_in_place`]); the others go through one tensor, once every
//! rank's lengths agreed. On every backend the description carries the
//! buffers' total and a digest of their lengths: one total split
//! differently is a mismatch.

use super::desc::{Desc, Kind};
use super::{row_share, Communicator, ReduceOp, HOST};
use crate::{Error, Result};
use candle_core::Tensor;

/// What an in-place collective over host buffers does, each rank on its
/// share of every buffer ([`row_share`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InPlace {
    /// Every share combined and written into every rank's buffer.
    Allreduce(ReduceOp),
    /// Rank r's share combined from every rank's buffer, written into rank
    /// r's alone.
    ReduceScatter(ReduceOp),
    /// Rank r's share of its own buffer copied into every other rank's.
    Allgather,
}

impl InPlace {
    /// The header of this collective over buffers of `lengths` in rows of
    /// `units`: the operation, and a digest of the lengths and the rows
    /// (one total split differently, or in other rows, is a mismatch).
    pub(crate) fn desc(self, lengths: &[usize], units: &[usize]) -> Desc {
        let (kind, op) = match self {
            InPlace::Allreduce(op) => (Kind::Allreduce, Some(op)),
            InPlace::ReduceScatter(op) => (Kind::ReduceScatter, Some(op)),
            InPlace::Allgather => (Kind::Allgather, None),
        };
        let d = Desc::new(kind).buffers(candle_core::DType::F32, &[lengths, units].concat());
        match op {
            Some(op) => d.reduce(op),
            None => d,
        }
    }

    /// The `Communicator` method it is, for messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            InPlace::Allreduce(_) => "allreduce_slices",
            InPlace::ReduceScatter(_) => "reduce_scatter_slices",
            InPlace::Allgather => "allgather_slices",
        }
    }
}

impl Communicator {
    /// Allreduce host f32 buffers in place: buffer i of every rank becomes
    /// the combination of every rank's buffer i (every rank passes buffers
    /// of the same lengths, in the same order). The local backend reads and
    /// writes the ranks' buffers directly (each rank combines its share of
    /// every buffer: no copies); the others copy them into one buffer, call
    /// [`Communicator::allreduce`] and copy the result back.
    pub fn allreduce_slices(&self, bufs: &mut [&mut [f32]], op: ReduceOp) -> Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let n = self.size();
        if self.inner.home().is_none() {
            if let Some(r) = self.inner.allreduce_in_place(bufs, op) {
                return self.count_result(r, |_| 2 * total * 4 * (n - 1) / n);
            }
        }
        // The lengths agreed first (the backends that reduce in place check
        // them in their header): one small exchange, then the copy.
        let sizes: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        self.agree_desc(
            Desc::new(Kind::Allreduce)
                .reduce(op)
                .buffers(candle_core::DType::F32, &sizes),
        )?;
        let mut flat = {
            let _staging = crate::heap::counting_as(crate::heap::Part::Communication);
            Vec::with_capacity(total)
        };
        for b in bufs.iter() {
            flat.extend_from_slice(b);
        }
        let sum = self.allreduce(&Tensor::from_vec(flat, total, &HOST)?, op)?;
        let (storage, layout) = sum.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(all)) = &*storage else {
            return Err(Error::Usage(
                "allreduce_slices: the result came back in another dtype or device".into(),
            ));
        };
        let mut at = layout.start_offset();
        for b in bufs.iter_mut() {
            b.copy_from_slice(&all[at..at + b.len()]);
            at += b.len();
        }
        Ok(())
    }

    /// Reduce-scatter host f32 buffers in place, by rows: buffer i holds
    /// rows of `units[i]` elements, and afterwards rank r's rows of it
    /// ([`row_share`]) hold the combination of every rank's; its other
    /// elements are unspecified (their partial sums or the rank's own
    /// values). The sums are the same bits as [`Self::allreduce_slices`]'.
    /// Every rank passes the same lengths and units, in the same order. The
    /// first half of an allreduce: what a rank needs to update only its
    /// share of the parameters (the data-parallel step with the optimizer's
    /// state sharded over the replicas).
    pub fn reduce_scatter_slices(
        &self,
        bufs: &mut [&mut [f32]],
        units: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        check_units("reduce_scatter_slices", bufs, units)?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let n = self.size();
        if self.inner.home().is_none() && matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
            if let Some(r) = self
                .inner
                .rows_in_place(bufs, units, InPlace::ReduceScatter(op))
            {
                return self.count_result(r, |_| total * 4 * (n - 1) / n);
            }
        }
        // Elsewhere the whole allreduce (every share combined), once the
        // rows agreed too.
        self.agree_desc(InPlace::ReduceScatter(op).desc(&lengths(bufs), units))?;
        self.allreduce_slices(bufs, op)
    }

    /// Allgather host f32 buffers in place, by rows: rank r's rows of
    /// buffer i ([`row_share`] with `units[i]`) are copied into every other
    /// rank's buffer i. Every rank passes the same lengths and units, in
    /// the same order. The second half of an allreduce: the parameters each
    /// rank updated, to every rank.
    pub fn allgather_slices(&self, bufs: &mut [&mut [f32]], units: &[usize]) -> Result<()> {
        check_units("allgather_slices", bufs, units)?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let (n, me) = (self.size(), self.rank());
        if self.inner.home().is_none() {
            if let Some(r) = self.inner.rows_in_place(bufs, units, InPlace::Allgather) {
                return self.count_result(r, |_| total * 4 * (n - 1) / n);
            }
        }
        // Through one allgather of every rank's shares, after the lengths
        // and units agreed (one small exchange).
        let lens = lengths(bufs);
        self.agree_desc(InPlace::Allgather.desc(&lens, units))?;
        let share = |b: usize, r: usize| row_share(lens[b], units[b], n, r);
        let flat: Vec<f32> = (0..bufs.len())
            .flat_map(|b| bufs[b][share(b, me)].to_vec())
            .collect();
        let len = flat.len();
        let (all, counts) = self.allgather_counts(&Tensor::from_vec(flat, len, &HOST)?)?;
        let all = all.to_vec1::<f32>()?;
        let mut at = 0;
        for (r, count) in counts.iter().enumerate() {
            let (start, end) = (at, at + count);
            for (b, buf) in bufs.iter_mut().enumerate() {
                let s = share(b, r);
                let len = s.len();
                if r != me {
                    buf[s].copy_from_slice(&all[at..at + len]);
                }
                at += len;
            }
            if at != end {
                return Err(Error::Usage(format!(
                    "allgather_slices: rank {r} sent {count} values where its shares hold {}",
                    at - start
                )));
            }
        }
        Ok(())
    }
}

/// The buffers' lengths.
fn lengths(bufs: &[&mut [f32]]) -> Vec<usize> {
    bufs.iter().map(|b| b.len()).collect()
}

/// Every buffer a whole number of rows of its unit (one unit per buffer,
/// none zero).
fn check_units(op: &str, bufs: &[&mut [f32]], units: &[usize]) -> Result<()> {
    if units.len() != bufs.len() {
        return Err(Error::Usage(format!(
            "{op}: {} buffers and {} row lengths (pass one per buffer)",
            bufs.len(),
            units.len()
        )));
    }
    for (i, (b, &u)) in bufs.iter().zip(units).enumerate() {
        if u == 0 || b.len() % u != 0 {
            return Err(Error::Usage(format!(
                "{op}: buffer {i} of {} values is not a whole number of rows of {u}",
                b.len()
            )));
        }
    }
    Ok(())
}
