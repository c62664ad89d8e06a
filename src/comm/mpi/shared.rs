//! A window of memory the ranks of one MPI communicator share when they all
//! run on one node (MPI-3 `MPI_Win_allocate_shared`): the in-place
//! allreduce copies each rank's buffers into its segment, every rank sums
//! its share of the elements straight from every segment and writes the
//! result into all of them, and each copies its segment back. Two copies
//! and one pass of sums per rank, where MPI's own allreduce moves the data
//! through its shared-memory queues in pieces.
//!
//! The window is allocated on the first call that finds the ranks on one
//! node and grown (freed and allocated again) when a call needs more; every
//! rank decides the same way, since the calls' lengths agree (checked by
//! the header exchange before). It is held in a passive-target epoch
//! (`MPI_Win_lock_all`) for its whole life, and each exchange of roles is
//! `MPI_Win_sync`, a barrier (the header exchange, with its timeout), and
//! `MPI_Win_sync` again: the MPI-3 pattern for load/store on shared
//! windows.

use super::exchange::ok;
use super::MpiComm;
use crate::comm::desc::{Desc, Kind};
use crate::{Error, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

/// What this communicator knows of a shared window.
pub(crate) enum Shared {
    /// Not yet asked whether the ranks share a node.
    Unknown,
    /// They do not (or there is one rank): MPI's own allreduce.
    Off,
    /// They do; the window once one was needed.
    On(Option<Window>),
}

/// One allocated window: every rank's segment, `len` floats each.
pub(crate) struct Window {
    win: ffi::MPI_Win,
    bases: Vec<*mut f32>,
    len: usize,
}

impl MpiComm {
    /// Allreduce (sum, or with `mean_over: Some(n)` mean) `bufs` through the
    /// node's shared window; `Ok(false)` where the ranks do not share a node
    /// (the caller reduces another way). Every rank calls it with the same
    /// lengths (checked before).
    pub(super) fn shared_allreduce(
        &self,
        bufs: &mut [&mut [f32]],
        mean_over: Option<usize>,
    ) -> Result<bool> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            // Nothing to sum (every rank agreed on the lengths).
            return Ok(true);
        }
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*shared, Shared::Unknown) {
            *shared = if self.size_() > 1 && self.on_one_node()? {
                Shared::On(None)
            } else {
                Shared::Off
            };
        }
        let Shared::On(window) = &mut *shared else {
            return Ok(false);
        };
        if window.as_ref().is_none_or(|w| w.len < total) {
            if let Some(old) = window.take() {
                self.free(old)?;
            }
            *window = Some(self.allocate(total)?);
        }
        let Some(w) = window.as_ref() else {
            return Ok(false);
        };
        let me = self.rank;
        // SAFETY: this rank's segment holds w.len ≥ total floats, and only
        // this rank writes it until the barrier in `sync`.
        let mine = unsafe { std::slice::from_raw_parts_mut(w.bases[me], total) };
        let mut at = 0;
        for b in bufs.iter() {
            mine[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        self.sync(w)?;
        let share = crate::comm::chunk_range(total, self.size_(), me);
        // SAFETY: between the two syncs rank r reads and writes only
        // elements `share` of each segment, ranges no two ranks share; each
        // segment holds w.len ≥ total floats.
        let mut parts: Vec<&mut [f32]> = w
            .bases
            .iter()
            .map(|b| unsafe { std::slice::from_raw_parts_mut(b.add(share.start), share.len()) })
            .collect();
        crate::comm::reduce::combine(&mut parts, mean_over);
        drop(parts);
        self.sync(w)?;
        // SAFETY: every rank wrote its share into this segment before the
        // sync; no rank writes it again before the next call's sync.
        let mine = unsafe { std::slice::from_raw_parts(w.bases[me], total) };
        let mut at = 0;
        for b in bufs.iter_mut() {
            let n = b.len();
            b.copy_from_slice(&mine[at..at + n]);
            at += n;
        }
        Ok(true)
    }

    /// Whether every rank of this communicator runs on this node.
    fn on_one_node(&self) -> Result<bool> {
        let mut node: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: plain MPI calls on this communicator (collective: every
        // rank makes it in the same call).
        unsafe {
            ok(
                ffi::MPI_Comm_split_type(
                    self.comm,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    0,
                    ffi::RSMPI_INFO_NULL,
                    &mut node,
                ),
                "allreduce (shared memory)",
            )?;
            let mut n: c_int = 0;
            ok(
                ffi::MPI_Comm_size(node, &mut n),
                "allreduce (shared memory)",
            )?;
            ok(ffi::MPI_Comm_free(&mut node), "allreduce (shared memory)")?;
            Ok(n as usize == self.size_())
        }
    }

    /// A window of `len` floats per rank, every rank's segment located.
    fn allocate(&self, len: usize) -> Result<Window> {
        let op = "allreduce (shared memory)";
        let bytes = ffi::MPI_Aint::try_from(len * 4)
            .map_err(|_| Error::Usage(format!("{op}: {len} floats do not fit one window")))?;
        let mut base: *mut f32 = std::ptr::null_mut();
        let mut win: ffi::MPI_Win = unsafe { ffi::RSMPI_WIN_NULL };
        // SAFETY: MPI writes the base address and the handle; collective,
        // every rank allocates in the same call.
        unsafe {
            ok(
                ffi::MPI_Win_allocate_shared(
                    bytes,
                    4,
                    ffi::RSMPI_INFO_NULL,
                    self.comm,
                    (&mut base as *mut *mut f32).cast::<c_void>(),
                    &mut win,
                ),
                op,
            )?;
        }
        let mut bases = Vec::with_capacity(self.size_());
        for r in 0..self.size_() {
            let (mut size, mut unit, mut ptr): (ffi::MPI_Aint, c_int, *mut f32) =
                (0, 0, std::ptr::null_mut());
            // SAFETY: MPI writes the segment's size, unit and address.
            unsafe {
                ok(
                    ffi::MPI_Win_shared_query(
                        win,
                        r as c_int,
                        &mut size,
                        &mut unit,
                        (&mut ptr as *mut *mut f32).cast::<c_void>(),
                    ),
                    op,
                )?;
            }
            if (size as usize) < len * 4 || ptr.is_null() {
                return Err(Error::Mpi(format!(
                    "{op}: rank {r}'s segment holds {size} bytes, {} needed",
                    len * 4
                )));
            }
            bases.push(ptr);
        }
        // SAFETY: the window was just allocated; the epoch lasts its life.
        unsafe { ok(ffi::MPI_Win_lock_all(0, win), op)? };
        Ok(Window { win, bases, len })
    }

    /// Release a window (collective: every rank frees in the same call).
    fn free(&self, mut w: Window) -> Result<()> {
        let op = "allreduce (shared memory)";
        // SAFETY: the window is ours, in its lock_all epoch; no rank uses
        // it after this call.
        unsafe {
            ok(ffi::MPI_Win_unlock_all(w.win), op)?;
            ok(ffi::MPI_Win_free(&mut w.win), op)
        }
    }

    /// Make every rank's stores to the window visible to every rank: sync,
    /// barrier, sync.
    fn sync(&self, w: &Window) -> Result<()> {
        let op = "allreduce (shared memory)";
        // SAFETY: a memory barrier on our window, inside its epoch.
        unsafe { ok(ffi::MPI_Win_sync(w.win), op)? };
        self.headers(&Desc::new(Kind::Barrier))?;
        // SAFETY: as above.
        unsafe { ok(ffi::MPI_Win_sync(w.win), op) }
    }
}

// SAFETY: the segments' addresses are only used inside `shared_allreduce`,
// under the communicator's lock, by the calls of all ranks together.
unsafe impl Send for Window {}
