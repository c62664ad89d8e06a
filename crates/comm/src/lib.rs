//! Communicators: the only way shardnet code talks to other ranks; the
//! one error type ([`Error`]); seeded random numbers (`rng`); the heap
//! counted by part (`heap`).
//!
//! A [`Communicator`] is a group of ranks. Every rank of the group calls the
//! same collectives in the same order; point-to-point [`Communicator::send`] /
//! [`Communicator::recv`] pair up in order per (source, destination).
//!
//! Two host backends sit behind the one API, chosen at run time by name:
//! - `local`: N ranks as threads of one process, started by [`launch`] (on
//!   the CPU) or [`launch_on`] (each rank on its device). Tensors move
//!   between ranks as reference-counted candle tensors, never serialised.
//! - `mpi`: one rank per process under `mpiexec -n N` (cargo feature `mpi`).
//!
//! Over them: `nccl` (feature `nccl`: collectives on the GPUs) and
//! `hierarchical` (ChainerMN's two-level allreduce); `setup` applies
//! `--device` and `--communicator` on each rank. A rank computes on
//! `Communicator::device()`, the CPU by default; `HOST` is host memory.
//!
//! Before any data moves, every collective exchanges a small description of
//! what each rank passed (operation, root, dtype, shape): ranks that disagree
//! get [`crate::Error::Mismatch`] instead of corrupt data or a hang.
//!
//! [`Communicator`] checks what needs no other rank (destination and root in
//! range, no send to oneself, a dtype that can travel, no integer mean) and
//! hands the call to its backend, which implements every operation natively:
//! threads share memory and move reference-counted tensors, processes move
//! bytes through MPI. It moves each argument to where the backend reads
//! (`Backend::home`: host memory for local and MPI, the rank's GPU for NCCL;
//! nothing moves for a CPU tensor on a host backend) and each result back to
//! where the caller's argument was (to the rank's device for what arrives
//! without one: recv, a non-root bcast). So a GPU tensor on the local or MPI
//! backend travels through host memory, correct and slower.
//!
//! The files: `desc` (what a rank passed, and the one check), `reduce`
//! (rank-order folds; balanced chunks: `chunk_sizes`, `chunk_offsets`,
//! `row_share`, their one home; snapshots; `combine_into`, the in-place
//! collectives' sum over the ranks' slices on both host backends), `slices`
//! (in-place collectives on host buffers), `objects` (serde values through
//! `u8` tensors; `agree`: every rank has the same settings, one digest
//! collective, an error naming what differs and where), `local`, `mpi`,
//! `nccl`, `hierarchical`, `setup`.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet_comm::{launch, ReduceOp};
//!
//! let sums = launch(3, |comm| {
//!     let x = Tensor::new(&[comm.rank() as f32, 1.0], comm.device())?;
//!     let s = comm.allreduce(&x, ReduceOp::Sum)?;
//!     Ok(s.to_vec1::<f32>()?)
//! })?;
//! assert_eq!(sums, vec![vec![3.0, 3.0]; 3]);
//! # Ok::<(), shardnet_comm::Error>(())
//! ```

#![warn(missing_docs)]

mod backend;
mod desc;
mod env;
pub mod error;
pub mod heap;
mod hierarchical;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod objects;
mod reduce;
#[doc(hidden)]
pub mod rng;
mod setup;
mod slices;
mod start;

pub use local::{launch, launch_on, launch_with_timeout, LAUNCH_GRACE};
#[cfg(feature = "mpi")]
#[doc(hidden)]
pub use mpi::raw_mpi;
#[doc(hidden)]
pub use reduce::{chunk_offsets, fold, split_rows};
pub use reduce::{chunk_range, chunk_sizes, row_share};
pub use setup::{gpu_of, gpu_placement, nccl_fits, CommKind, DeviceKind, Setup};

pub(crate) use backend::Backend;
pub use env::{launcher_local_size, launcher_size, timeout, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S};
pub(crate) use slices::InPlace;
pub use start::{create_communicator, end_job, mpi_available, run, RANK_STACK};

use candle_core::{Device, Tensor};
pub use error::{Error, Result};
use std::sync::Arc;

/// The host's memory: where datasets, serialised objects and MPI staging
/// buffers live, whatever device a rank computes on.
pub const HOST: Device = Device::Cpu;

/// How values from all ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Elementwise sum, in rank order.
    Sum,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Sum divided by the number of ranks (float dtypes only).
    Mean,
}

impl ReduceOp {
    /// The name used in messages and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Mean => "mean",
        }
    }
    pub(crate) fn code(self) -> u64 {
        self as u64
    }
    pub(crate) fn from_code(c: u64) -> Option<Self> {
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean]
            .get(c as usize)
            .copied()
    }
}

/// A group of ranks that communicate. Cheap to clone; all clones are the same
/// communicator (they share its call sequence).
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<dyn Backend>,
    /// The device this rank computes on (see [`Communicator::device`]).
    device: Device,
    /// Bytes this rank has received (see [`Communicator::bytes_received`]).
    received: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator({}, rank {} of {})",
            self.inner.name(),
            self.rank(),
            self.size()
        )
    }
}

impl Communicator {
    pub(crate) fn from_backend(inner: Arc<dyn Backend>) -> Self {
        Communicator {
            inner,
            // The one default: a rank computes on the host's CPU unless its
            // launcher binds it to another device.
            device: HOST,
            received: Default::default(),
        }
    }

    /// The device this rank computes on: tensors a model makes for this rank
    /// go here. The CPU unless the rank was started on another
    /// ([`launch_on`], [`Communicator::on_device`]).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This communicator (the same one: clones share the call sequence),
    /// with this rank bound to `device`.
    pub fn on_device(&self, device: Device) -> Communicator {
        Communicator {
            device,
            ..self.clone()
        }
    }

    /// This communicator with a counter of its own for
    /// [`bytes_received`](Self::bytes_received): for the communicators a
    /// backend is built on, whose traffic the outer one already counts.
    pub(crate) fn fresh_counter(&self) -> Communicator {
        Communicator {
            received: Default::default(),
            ..self.clone()
        }
    }

    /// Every rank's [`desc::Desc`] of the call it is in, exchanged as one
    /// header each through this communicator's allgather, and the same
    /// [`desc::check`] on every rank: for the backends built on another
    /// (NCCL, hierarchical), whose own data path carries no header.
    fn agree_desc(&self, desc: desc::Desc) -> Result<Vec<desc::Desc>> {
        let words = desc.to_words()?;
        let t = Tensor::from_vec(
            words.iter().map(|w| *w as i64).collect::<Vec<_>>(),
            desc::HEADER_WORDS,
            &HOST,
        )?;
        let all = self.allgather(&t)?.to_vec1::<i64>()?;
        let descs = all
            .chunks(desc::HEADER_WORDS)
            .map(|c| desc::Desc::from_words(&c.iter().map(|w| *w as u64).collect::<Vec<_>>()))
            .collect::<Result<Vec<_>>>()?;
        desc::check(&descs, &self.world_ranks())?;
        Ok(descs)
    }

    /// Combine equal-shaped tensors from every rank on `root`: `Some` there,
    /// `None` on the others.
    pub(crate) fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize) -> Result<Option<Tensor>> {
        self.peer("reduce", root, "root")?;
        reduce::check_op("reduce", t, op)?;
        let r = self.inner.reduce(&self.staged(t)?, op, root)?;
        r.map(|y| Self::placed(y, t.device())).transpose()
    }

    /// Payload bytes this rank has received from other ranks through this
    /// communicator (its clones, and the sub-communicators [`split`](Self::split)
    /// from it) so far: what recv, bcast, gather,
    /// scatter, allgather and alltoall deliver from others, and for
    /// allreduce (reduce_scatter) of b bytes 2b(n−1)/n (b(n−1)/n), what the
    /// bandwidth-optimal algorithm receives. Read it before and after a
    /// step to get the step's communication.
    pub fn bytes_received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count(&self, bytes: usize) {
        self.received
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// `t` where the backend reads it ([`Backend::home`]); itself (no copy)
    /// when it is there already, as every CPU tensor is for the local and
    /// MPI backends.
    fn staged(&self, t: &Tensor) -> Result<Tensor> {
        match self.inner.home() {
            Some(home) => Ok(t.to_device(&home)?),
            None => Ok(t.to_device(&HOST)?),
        }
    }

    fn staged_all(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        ts.iter().map(|t| self.staged(t)).collect()
    }

    /// A result on `device`: where the caller's argument was, or this rank's
    /// device for what arrives without one (recv, a non-root bcast).
    fn placed(y: Tensor, device: &Device) -> Result<Tensor> {
        Ok(y.to_device(device)?)
    }

    fn count_result<T>(&self, r: Result<T>, bytes: impl FnOnce(&T) -> usize) -> Result<T> {
        if let Ok(v) = &r {
            self.count(bytes(v));
        }
        r
    }

    /// The backend's name: `"local"` or `"mpi"`.
    pub fn backend(&self) -> &'static str {
        self.inner.name()
    }
    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank()
    }
    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size()
    }
    /// This rank's index among the ranks on the same node (for picking a device).
    pub fn intra_rank(&self) -> usize {
        self.inner.intra_rank()
    }
    /// The number of ranks on this node.
    pub fn intra_size(&self) -> usize {
        self.inner.intra_size()
    }

    fn peer(&self, op: &str, r: usize, what: &str) -> Result<()> {
        if r >= self.size() {
            return Err(Error::Usage(format!(
                "{op}: {what} {r} is out of range (communicator of {} ranks)",
                self.size()
            )));
        }
        Ok(())
    }

    /// Send `t` to rank `dst`. Does not wait for the receiver. The receiver
    /// sees `t` as it was at the call, whatever the sender does afterwards.
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.peer("send", dst, "destination")?;
        if dst == self.rank() {
            return Err(Error::Usage(format!(
                "send: rank {dst} sends to itself; keep the tensor instead"
            )));
        }
        desc::dtype_code(t.dtype())?;
        self.inner.send(&self.staged(t)?, dst)
    }

    /// Receive the next tensor sent by rank `src`; its shape and dtype come with it.
    pub fn recv(&self, src: usize) -> Result<Tensor> {
        self.peer("recv", src, "source")?;
        if src == self.rank() {
            return Err(Error::Usage(format!(
                "recv: rank {src} receives from itself"
            )));
        }
        let r = self.inner.recv(src);
        let y = self.count_result(r, nbytes)?;
        Self::placed(y, &self.device)
    }

    /// Broadcast the root's tensor to every rank. Other ranks pass `None`, or a
    /// tensor whose shape and dtype must then match the root's.
    pub fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor> {
        self.peer("bcast", root, "root")?;
        if let Some(t) = t {
            desc::dtype_code(t.dtype())?;
        }
        let staged = t.map(|t| self.staged(t)).transpose()?;
        let r = self.inner.bcast(staged.as_ref(), root);
        let me = self.rank();
        let y = self.count_result(r, |y| if me == root { 0 } else { nbytes(y) })?;
        Self::placed(y, t.map_or(&self.device, |t| t.device()))
    }

    /// Collect every rank's tensor on `root`, in rank order (shapes may differ).
    /// Returns `Some` on the root, `None` elsewhere.
    pub fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        self.peer("gather", root, "root")?;
        desc::dtype_code(t.dtype())?;
        let r = self.inner.gather(&self.staged(t)?, root);
        let me = self.rank();
        let ys = self.count_result(r, |ys| match ys {
            Some(ys) => ys
                .iter()
                .enumerate()
                .filter(|(k, _)| *k != me)
                .map(|(_, y)| nbytes(y))
                .sum(),
            None => 0,
        })?;
        ys.map(|ys| {
            ys.into_iter()
                .map(|y| Self::placed(y, t.device()))
                .collect()
        })
        .transpose()
    }

    /// The root passes one tensor per rank; rank `r` receives the `r`-th.
    pub fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        self.peer("scatter", root, "root")?;
        if let Some(t) = ts.and_then(|ts| ts.first()) {
            desc::dtype_code(t.dtype())?;
        }
        let staged = ts.map(|ts| self.staged_all(ts)).transpose()?;
        let r = self.inner.scatter(staged.as_deref(), root);
        let me = self.rank();
        let y = self.count_result(r, |y| if me == root { 0 } else { nbytes(y) })?;
        let device = ts
            .and_then(|ts| ts.first())
            .map_or(&self.device, |t| t.device());
        Self::placed(y, device)
    }

    /// Every rank's tensor, concatenated along dimension 0 in rank order.
    /// First dimensions may differ between ranks; the others must agree.
    pub fn allgather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(self.allgather_counts(t)?.0)
    }

    /// Like [`Communicator::allgather`], also returning each rank's first dimension.
    pub fn allgather_counts(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        desc::dtype_code(t.dtype())?;
        let r = self.inner.allgather(&self.staged(t)?);
        let (y, counts) = self.count_result(r, |(y, _)| nbytes(y) - nbytes(t))?;
        Ok((Self::placed(y, t.device())?, counts))
    }

    /// Rank `r` passes `ts[d]` to rank `d` and receives, in rank order, the
    /// tensor each rank addressed to `r`. Shapes may differ.
    pub fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        if let Some(t) = ts.first() {
            desc::dtype_code(t.dtype())?;
            if ts.iter().any(|x| x.dtype() != t.dtype()) {
                return Err(Error::Usage(
                    "alltoall: all tensors must have one dtype".into(),
                ));
            }
        }
        let r = self.inner.alltoall(&self.staged_all(ts)?);
        let me = self.rank();
        let ys = self.count_result(r, |ys| {
            ys.iter()
                .enumerate()
                .filter(|(k, _)| *k != me)
                .map(|(_, y)| nbytes(y))
                .sum()
        })?;
        let device = ts.first().map_or(&self.device, |t| t.device());
        ys.into_iter().map(|y| Self::placed(y, device)).collect()
    }

    /// Combine equal-shaped tensors from every rank; every rank gets the result.
    pub fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        reduce::check_op("allreduce", t, op)?;
        let r = self.inner.allreduce(&self.staged(t)?, op);
        let n = self.size();
        let y = self.count_result(r, |y| 2 * nbytes(y) * (n - 1) / n)?;
        Self::placed(y, t.device())
    }

    /// Combine equal-shaped tensors from every rank and give rank `r` the
    /// `r`-th chunk along dimension 0 (chunk sizes from [`chunk_sizes`]).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        reduce::check_op("reduce_scatter", t, op)?;
        if t.rank() == 0 {
            return Err(Error::Usage(
                "reduce_scatter: needs a tensor of at least one dimension".into(),
            ));
        }
        let r = self.inner.reduce_scatter(&self.staged(t)?, op);
        let n = self.size();
        let y = self.count_result(r, |_| nbytes(t) * (n - 1) / n)?;
        Self::placed(y, t.device())
    }

    /// Wait until every rank has arrived.
    pub fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    /// Split into sub-communicators: ranks passing the same `color` form one,
    /// ordered by `key` (then by rank). `None` joins none and returns `None`.
    /// What a sub-communicator receives counts in this one's
    /// [`bytes_received`](Self::bytes_received) too. Collective over this
    /// communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        Ok(self.inner.split(color, key)?.map(|inner| Communicator {
            inner,
            device: self.device.clone(),
            received: self.received.clone(),
        }))
    }

    /// The world rank of each rank of this communicator.
    pub fn world_ranks(&self) -> Vec<usize> {
        self.inner.world_ranks()
    }
}

fn nbytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}
