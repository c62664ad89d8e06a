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

use super::codes::ok;
use super::MpiComm;
use crate::desc::{Desc, Kind};
use crate::reduce::{combine_into, row_share};
use crate::{Error, Result};
use crate::{InPlace, ReduceOp};
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
    /// `what` on `bufs` (rows of `units`) through the node's shared window;
    /// `Ok(false)` where the ranks do not share a node (the caller goes
    /// another way). Every rank calls it with the same lengths and rows
    /// (checked before, by the header exchange).
    /// - Allreduce: every rank copies its buffers into its segment; rank r
    ///   combines its share of every buffer from all segments into all of
    ///   them; each copies its segment back.
    /// - Reduce-scatter: every rank copies all but its share of its buffers
    ///   into its segment; rank r combines its share from its own buffer
    ///   and the others' segments into its own buffer.
    /// - Allgather: rank r copies its shares into its segment and the
    ///   others' shares out of theirs.
    pub(super) fn shared_rows(
        &self,
        bufs: &mut [&mut [f32]],
        units: &[usize],
        what: InPlace,
    ) -> Result<bool> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            // Nothing to move (every rank agreed on the lengths).
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
        let (me, n) = (self.rank, self.size_());
        // Where each buffer starts in a segment, and this rank's share of it.
        let starts: Vec<usize> = bufs
            .iter()
            .scan(0, |at, b| {
                let s = *at;
                *at += b.len();
                Some(s)
            })
            .collect();
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let share = |b: usize, r: usize| row_share(lens[b], units[b], n, r);
        // SAFETY: this rank's segment holds w.len ≥ total floats, and only
        // this rank writes it until the barrier in `sync`.
        let mine = unsafe { std::slice::from_raw_parts_mut(w.bases[me], total) };
        for (b, buf) in bufs.iter().enumerate() {
            match what {
                // Its own share only: the others read it.
                InPlace::Allgather => {
                    let s = share(b, me);
                    mine[starts[b] + s.start..starts[b] + s.end].copy_from_slice(&buf[s]);
                }
                // All but its own share: the others combine theirs from it.
                InPlace::ReduceScatter(_) => {
                    let s = share(b, me);
                    let at = starts[b];
                    mine[at..at + s.start].copy_from_slice(&buf[..s.start]);
                    mine[at + s.end..at + buf.len()].copy_from_slice(&buf[s.end..]);
                }
                InPlace::Allreduce(_) => {
                    mine[starts[b]..starts[b] + buf.len()].copy_from_slice(buf);
                }
            }
        }
        self.sync(w)?;
        if let InPlace::ReduceScatter(op) = what {
            // Rank r's share combined from its own buffer and the others'
            // segments, in rank order, into its own buffer.
            let mean_over = (op == ReduceOp::Mean).then_some(n);
            for (b, buf) in bufs.iter_mut().enumerate() {
                let s = share(b, me);
                let (before, own, after): (Vec<_>, _, Vec<_>) = {
                    // SAFETY: rank r reads only its share of buffer b in
                    // the other segments, which their owners wrote before
                    // the sync and write again only after the next call's
                    // header exchange (which every rank reaches after this
                    // loop); nobody writes them meanwhile.
                    let seg = |r: usize| unsafe {
                        std::slice::from_raw_parts_mut(w.bases[r].add(starts[b] + s.start), s.len())
                    };
                    (
                        (0..me).map(seg).collect(),
                        &mut buf[s.clone()],
                        (me + 1..n).map(seg).collect(),
                    )
                };
                let mut parts: Vec<&mut [f32]> = before;
                parts.push(own);
                parts.extend(after);
                combine_into(&mut parts, mean_over, Some(me));
            }
            return Ok(true);
        }
        if let InPlace::Allgather = what {
            for (b, buf) in bufs.iter_mut().enumerate() {
                for r in (0..n).filter(|r| *r != me) {
                    let s = share(b, r);
                    // SAFETY: rank r wrote its share of buffer b into its
                    // segment before the sync; nobody writes it again
                    // before the next call's header exchange, which every
                    // rank reaches only after this loop.
                    let theirs = unsafe {
                        std::slice::from_raw_parts(w.bases[r].add(starts[b] + s.start), s.len())
                    };
                    buf[s].copy_from_slice(theirs);
                }
            }
            return Ok(true);
        }
        let InPlace::Allreduce(op) = what else {
            return Err(Error::Mpi(format!("{what:?}: returned above")));
        };
        let mean_over = (op == ReduceOp::Mean).then_some(n);
        for (b, &start) in starts.iter().enumerate() {
            let s = share(b, me);
            // SAFETY: between the syncs rank r reads and writes only its
            // share of each buffer in each segment, ranges no two ranks
            // share; each segment holds w.len ≥ total floats.
            let mut parts: Vec<&mut [f32]> = w
                .bases
                .iter()
                .map(|base| unsafe {
                    std::slice::from_raw_parts_mut(base.add(start + s.start), s.len())
                })
                .collect();
            combine_into(&mut parts, mean_over, None);
        }
        // Every rank's results are in every segment once all are done.
        self.sync(w)?;
        // SAFETY: this rank's segment holds the results; no rank writes it
        // again before the next call.
        let mine = unsafe { std::slice::from_raw_parts(w.bases[me], total) };
        for (b, buf) in bufs.iter_mut().enumerate() {
            buf.copy_from_slice(&mine[starts[b]..starts[b] + buf.len()]);
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

// SAFETY: the segments' addresses are only used inside `shared_rows`,
// under the communicator's lock, by the calls of all ranks together.
unsafe impl Send for Window {}
