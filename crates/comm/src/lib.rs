//! Communicators: the only way shardnet code talks to other ranks; the
//! one error type ([`Error`]); seeded random numbers (`rng`).
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

mod desc;
pub mod error;
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

pub use local::{launch, launch_on, launch_with_timeout, LAUNCH_GRACE};
#[cfg(feature = "mpi")]
#[doc(hidden)]
pub use mpi::raw_mpi;
#[doc(hidden)]
pub use reduce::{chunk_offsets, fold, split_rows};
pub use reduce::{chunk_range, chunk_sizes, row_share};
pub use setup::{CommKind, DeviceKind, Setup};
pub(crate) use slices::InPlace;

use candle_core::{Device, Tensor};
pub use error::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

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

/// What each backend implements. Argument checks that need no other rank
/// live in [`Communicator`], so backends see only well-formed calls.
pub(crate) trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn intra_rank(&self) -> usize;
    fn intra_size(&self) -> usize;
    /// The world rank of each rank of this communicator (for error messages).
    fn world_ranks(&self) -> Vec<usize>;
    fn send(&self, t: &Tensor, dst: usize) -> Result<()>;
    fn recv(&self, src: usize) -> Result<Tensor>;
    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor>;
    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>>;
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor>;
    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)>;
    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>>;
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>>;
    /// Where this backend reads and writes tensors: host memory (`None`: the
    /// local and MPI backends; a GPU tensor travels through the host), or
    /// one device (NCCL: the rank's GPU). [`Communicator`] moves the
    /// arguments there and the results back where the caller has them.
    fn home(&self) -> Option<Device> {
        None
    }
    /// Combine equal-shaped tensors from every rank on `root` (`Some` there,
    /// `None` elsewhere). By default an allreduce whose result only the root
    /// keeps; NCCL reduces to the root alone.
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize) -> Result<Option<Tensor>> {
        let y = self.allreduce(t, op)?;
        Ok((self.rank() == root).then_some(y))
    }
    /// Allreduce host buffers in place where the ranks share memory (the
    /// local backend: each rank sums its share of every buffer straight
    /// from the others' and writes it into all of them); `None` where the
    /// backend cannot, and [`Communicator::allreduce_slices`] copies them
    /// through one [`Backend::allreduce`].
    fn allreduce_in_place(&self, _bufs: &mut [&mut [f32]], _op: ReduceOp) -> Option<Result<()>> {
        None
    }
    /// [`Communicator::reduce_scatter_slices`] and
    /// [`Communicator::allgather_slices`] straight between the ranks'
    /// buffers where they share memory (the local backend); `None` where the
    /// backend cannot, and the communicator goes through a copy.
    fn rows_in_place(
        &self,
        _bufs: &mut [&mut [f32]],
        _units: &[usize],
        _what: InPlace,
    ) -> Option<Result<()>> {
        None
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

/// The wait limit when `SHARDNET_TIMEOUT` is not set, in seconds.
pub const DEFAULT_TIMEOUT_S: f64 = 300.0;
/// The longest `SHARDNET_TIMEOUT` (about 317 years: in effect, none).
pub const MAX_TIMEOUT_S: f64 = 1e10;

/// The wait limit for the local backend and for MPI progress: `SHARDNET_TIMEOUT`
/// seconds (a finite number > 0), [`DEFAULT_TIMEOUT_S`] when unset. Any
/// other value is an error that says so, never silently the default.
pub fn timeout() -> Result<Duration> {
    let Some(raw) = std::env::var_os("SHARDNET_TIMEOUT") else {
        return Ok(Duration::from_secs_f64(DEFAULT_TIMEOUT_S));
    };
    let text = raw.to_string_lossy();
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= MAX_TIMEOUT_S)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            Error::Usage(format!(
                "SHARDNET_TIMEOUT={text:?} is not a wait limit: give a number of seconds > 0 \
                 and at most {MAX_TIMEOUT_S:e} (e.g. SHARDNET_TIMEOUT=600), or unset it for the \
                 default {DEFAULT_TIMEOUT_S} s"
            ))
        })
}

/// The number of processes the launcher (mpiexec, srun) asked for, when this
/// process was started by one.
pub fn launcher_size() -> Option<usize> {
    env_count(&["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
}

/// The number of processes the launcher started on this node.
pub fn launcher_local_size() -> Option<usize> {
    env_count(&["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"]).or_else(launcher_size)
}

fn env_count(keys: &[&str]) -> Option<usize> {
    keys.iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
}

/// End this process with `msg` (exit status 1), and with it the whole job
/// when `mpiexec` started it with other processes: a process that fails
/// before it joins MPI (a flag that does not parse, a file that cannot be
/// read) still joins, so that the others, waiting for it in
/// `MPI_Init`, end with its error rather than wait for ever.
pub fn end_job(msg: &str) -> ! {
    #[cfg(feature = "mpi")]
    if launcher_size().is_some_and(|n| n > 1) && mpi::world().is_ok() {
        mpi::abort(msg);
    }
    eprintln!("shardnet: {msg}");
    std::process::exit(1)
}

/// Whether the MPI backend was compiled in.
pub fn mpi_available() -> bool {
    cfg!(feature = "mpi")
}

/// Open the world communicator of the named backend for this process.
///
/// `"mpi"` joins the `mpiexec` job. `"local"` ranks exist only inside
/// [`launch`], so here it is an error that says so; see [`run`] for one entry
/// point that covers both.
pub fn create_communicator(name: &str) -> Result<Communicator> {
    match name {
        "mpi" => open_mpi(),
        "local" => Err(Error::Usage("the local backend's ranks are threads: start them with shardnet_comm::launch(n, |comm| ...)".into())),
        other => Err(Error::Usage(format!("unknown communicator backend '{other}' (use 'local' or 'mpi')"))),
    }
}

#[cfg(feature = "mpi")]
fn open_mpi() -> Result<Communicator> {
    mpi::world()
}

#[cfg(not(feature = "mpi"))]
fn open_mpi() -> Result<Communicator> {
    Err(Error::Mpi(match launcher_size() {
        Some(n) => format!(
            "this process was started by mpiexec ({n} processes) but shardnet was built without MPI; \
             rebuild with `cargo build --release --features mpi`"
        ),
        None => "shardnet was built without MPI; rebuild with `cargo build --release --features mpi` and start it under mpiexec".into(),
    }))
}

/// Run `f` on every rank of the named backend and return this process's
/// results: with `"local"`, `n` thread ranks (all results, in rank order); with
/// `"mpi"`, this process's rank (one result; `n` is ignored). `"auto"` picks
/// `mpi` when started by mpiexec, `local` otherwise.
///
/// Under MPI an error or panic on any rank aborts the whole job
/// (`MPI_Abort`), so that no rank is left waiting.
pub fn run<T, F>(backend: &str, n: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    let backend = match backend {
        "auto" if launcher_size().is_some_and(|n| n > 1) => "mpi",
        "auto" => "local",
        b => b,
    };
    match backend {
        "local" => {
            if let Some(k) = launcher_size().filter(|k| *k > 1) {
                return Err(Error::Usage(format!(
                    "started by mpiexec with {k} processes, but the local backend was asked for: \
                     every process would run all {n} ranks; pass --comm mpi"
                )));
            }
            launch(n, f)
        }
        "mpi" => {
            let comm = create_communicator("mpi")?;
            run_mpi(comm, f)
        }
        other => create_communicator(other).map(|_| Vec::new()),
    }
}

/// The stack of a thread that runs a rank (thread ranks, and an MPI
/// process's rank): autograd walks the graph recursively, so a rank that
/// holds a deep model (a pipeline stage of thousands of layers) needs more
/// than a thread's usual 2 MiB. Address space only: pages are used as the
/// stack grows.
pub const RANK_STACK: usize = 1 << 30;

#[cfg(feature = "mpi")]
fn run_mpi<T, F>(comm: Communicator, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    let rank = comm.rank();
    // On its own thread, with a rank's stack.
    let out = std::thread::scope(|s| {
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .stack_size(RANK_STACK)
            .spawn_scoped(s, || f(comm))
            .map(|h| h.join())
    });
    match out {
        Ok(Ok(Ok(v))) => Ok(vec![v]),
        Ok(Ok(Err(e))) => mpi::abort(&format!("rank {rank} failed: {e}")),
        Ok(Err(_)) => mpi::abort(&format!("rank {rank} panicked")),
        Err(e) => mpi::abort(&format!("rank {rank} could not start its thread: {e}")),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T, F: Fn(Communicator) -> Result<T> + Sync>(
    _comm: Communicator,
    _f: F,
) -> Result<Vec<T>> {
    open_mpi().map(|_| Vec::new())
}
