//! The `mpi` backend: one rank per process under `mpiexec`, on the system MPI
//! (MPICH) through `mpi-sys`.
//!
//! Every collective is two MPI collectives: an `MPI_Iallgather` of a 128-byte
//! header per rank (operation, root, dtype, shape), checked on every rank
//! exactly as the local backend checks its deposits, then the data collective
//! itself (`MPI_Iallgatherv`, `MPI_Iallreduce`, …) straight into the memory of
//! a fresh candle tensor. A `send` is an `MPI_Isend` of the header and one of
//! the data; it returns at once and keeps the tensor alive until MPI is done.
//!
//! All waits poll `MPI_Test` against [`crate::comm::timeout`]; a wait that
//! runs out, an error returned by [`crate::comm::run`], or a panic ends the
//! whole job with `MPI_Abort`, so mpiexec stops every rank with a message.

mod buf;
mod raw;

pub use raw::raw_mpi;

use super::desc::{check, Desc, Kind, HEADER_WORDS};
use super::reduce::{chunk_offsets, chunk_sizes, finish_mean, fold, snapshot, split_rows};
use super::{Backend, Communicator, ReduceOp};
use crate::{Error, Result};
use buf::{bytes, Bytes, Fresh};
use candle_core::{DType, Tensor};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

const TAG_HEADER: c_int = 1;
const TAG_DATA: c_int = 2;
const TAG_ALLTOALL: c_int = 3;

type Header = [u64; HEADER_WORDS];

struct Process {
    world: ffi::MPI_Comm,
    world_rank: usize,
    intra_rank: usize,
    intra_size: usize,
}

static PROCESS: OnceLock<std::result::Result<Process, String>> = OnceLock::new();
/// What keeps the buffer of a send in flight alive.
enum Keep {
    Header(#[allow(dead_code)] Box<Header>),
    Data(#[allow(dead_code)] Bytes),
}

/// Sends in flight: the request and what keeps its buffer alive.
static PENDING: Mutex<Vec<(ffi::MPI_Request, Keep)>> = Mutex::new(Vec::new());

fn ok(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Mpi(format!(
            "{what} failed with MPI error code {code}"
        )))
    }
}

/// Initialise MPI once for this process and return the world communicator.
pub(crate) fn world() -> Result<Communicator> {
    // Refuse a bad SHARDNET_TIMEOUT before the first wait needs it.
    super::timeout()?;
    let p = PROCESS
        .get_or_init(init)
        .as_ref()
        .map_err(|e| Error::Mpi(e.clone()))?;
    let size = comm_size(p.world);
    Ok(Communicator::from_backend(Arc::new(MpiComm {
        comm: p.world,
        rank: p.world_rank,
        members: (0..size).collect(),
    })))
}

fn comm_size(c: ffi::MPI_Comm) -> usize {
    let mut n: c_int = 0;
    unsafe { ffi::MPI_Comm_size(c, &mut n) };
    n as usize
}

fn init() -> std::result::Result<Process, String> {
    unsafe {
        let mut provided: c_int = 0;
        let mut initialized: c_int = 0;
        ffi::MPI_Initialized(&mut initialized);
        if initialized == 0 {
            let code = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            );
            if code != 0 {
                return Err(format!("MPI_Init_thread failed with code {code}"));
            }
            atexit(finalize);
        }
        let mut world: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
        ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut world);
        let size = comm_size(world);
        if let Some(asked) = super::launcher_size() {
            if asked != size {
                return Err(format!(
                    "the launcher started {asked} processes but MPI sees a world of {size}: the mpiexec used \
                     does not belong to the MPI shardnet was built with (MPICH); launch with mpiexec.mpich"
                ));
            }
        }
        let mut rank: c_int = 0;
        ffi::MPI_Comm_rank(world, &mut rank);
        let mut node: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
        ffi::MPI_Comm_split_type(
            world,
            ffi::RSMPI_COMM_TYPE_SHARED,
            rank,
            ffi::RSMPI_INFO_NULL,
            &mut node,
        );
        let (mut irank, mut isize): (c_int, c_int) = (0, 0);
        ffi::MPI_Comm_rank(node, &mut irank);
        ffi::MPI_Comm_size(node, &mut isize);
        install_panic_abort();
        Ok(Process {
            world,
            world_rank: rank as usize,
            intra_rank: irank as usize,
            intra_size: isize as usize,
        })
    }
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
}

extern "C" fn finalize() {
    let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    for (req, _) in pending.iter_mut() {
        unsafe { ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE) };
    }
    pending.clear();
    unsafe { ffi::MPI_Finalize() };
}

/// End every rank of the job: print `msg` and call `MPI_Abort`.
pub(crate) fn abort(msg: &str) -> ! {
    eprintln!("shardnet: {msg}; aborting every rank (MPI_Abort)");
    // Give the launcher a moment to forward the message before it kills the job.
    std::thread::sleep(std::time::Duration::from_millis(200));
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    std::process::exit(1)
}

fn install_panic_abort() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        let rank = PROCESS
            .get()
            .and_then(|p| p.as_ref().ok())
            .map_or(0, |p| p.world_rank);
        abort(&format!("rank {rank} panicked"));
    }));
}

/// Whether this node runs more of the job's processes than it has cores.
fn oversubscribed() -> bool {
    static OVER: OnceLock<bool> = OnceLock::new();
    *OVER.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        super::launcher_local_size().is_some_and(|n| n > cores)
    })
}

/// Poll one request until it completes; abort the job at the timeout.
fn wait(req: &mut ffi::MPI_Request, op: &str) {
    let start = Instant::now();
    // Checked when the world was opened ([`world`]).
    let limit =
        super::timeout().unwrap_or(std::time::Duration::from_secs_f64(super::DEFAULT_TIMEOUT_S));
    let mut spins: u64 = 0;
    loop {
        let mut flag: c_int = 0;
        unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if flag != 0 {
            return;
        }
        spins += 1;
        // More processes than cores on this node: give the core away on
        // every poll, since the peer this one waits for may need it.
        if spins.is_multiple_of(1024) || oversubscribed() {
            let waited = start.elapsed();
            if waited > limit {
                let rank = PROCESS
                    .get()
                    .and_then(|p| p.as_ref().ok())
                    .map_or(0, |p| p.world_rank);
                abort(&format!(
                    "rank {rank}: {op} timed out after {:.1} s: a rank never reached it (set SHARDNET_TIMEOUT=<seconds> to wait longer)",
                    limit.as_secs_f64()
                ));
            }
            if waited.as_millis() > 100 {
                std::thread::sleep(std::time::Duration::from_micros(200));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Complete sends whose data has left.
fn progress() {
    PENDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain_mut(|(req, _)| {
            let mut flag: c_int = 0;
            unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            flag == 0
        });
}

fn count(n: usize, op: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::Usage(format!(
            "{op}: {n} elements is more than one MPI message can carry (2^31 - 1)"
        ))
    })
}

fn counts(ns: &[usize], op: &str) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let c = ns
        .iter()
        .map(|n| count(*n, op))
        .collect::<Result<Vec<_>>>()?;
    let d = chunk_offsets(ns)
        .iter()
        .map(|n| count(*n, op))
        .collect::<Result<Vec<_>>>()?;
    Ok((c, d))
}

fn byte_t() -> ffi::MPI_Datatype {
    unsafe { ffi::RSMPI_UINT8_T }
}

/// The MPI datatype that reduces `dtype` natively, if there is one.
fn reduce_type(dtype: DType) -> Option<ffi::MPI_Datatype> {
    unsafe {
        match dtype {
            DType::F32 => Some(ffi::RSMPI_FLOAT),
            DType::F64 => Some(ffi::RSMPI_DOUBLE),
            DType::U8 => Some(ffi::RSMPI_UINT8_T),
            DType::U32 => Some(ffi::RSMPI_UINT32_T),
            DType::I64 => Some(ffi::RSMPI_INT64_T),
            _ => None,
        }
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

fn elems(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// One rank's handle on one MPI communicator.
pub(crate) struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    /// World rank of each member.
    members: Vec<usize>,
}

impl MpiComm {
    fn size_(&self) -> usize {
        self.members.len()
    }

    /// Exchange and check headers; returns every rank's description.
    fn headers(&self, desc: &Desc) -> Result<Vec<Desc>> {
        progress();
        let op = desc.op_name();
        let mine = desc.to_words()?;
        let mut all = vec![0u64; HEADER_WORDS * self.size_()];
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        unsafe {
            ok(
                ffi::MPI_Iallgather(
                    mine.as_ptr() as *const c_void,
                    HEADER_WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    all.as_mut_ptr() as *mut c_void,
                    HEADER_WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    self.comm,
                    &mut req,
                ),
                &op,
            )?;
        }
        wait(&mut req, &op);
        let descs = all
            .chunks(HEADER_WORDS)
            .map(Desc::from_words)
            .collect::<Result<Vec<_>>>()?;
        check(&descs, &self.members)?;
        Ok(descs)
    }

    /// Run one non-blocking MPI call and wait for it.
    fn run(&self, op: &str, call: impl FnOnce(*mut ffi::MPI_Request) -> c_int) -> Result<()> {
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        ok(call(&mut req), op)?;
        wait(&mut req, op);
        Ok(())
    }

    /// Exchange per-destination headers (alltoall and scatter).
    fn route_headers(&self, op: &str, mine: &[Header], root: Option<usize>) -> Result<Vec<Desc>> {
        let n = self.size_();
        let flat: Vec<u64> = mine.iter().flatten().copied().collect();
        let mut got = vec![0u64; HEADER_WORDS * if root.is_some() { 1 } else { n }];
        let h = HEADER_WORDS as c_int;
        self.run(op, |req| unsafe {
            match root {
                Some(r) => ffi::MPI_Iscatter(
                    flat.as_ptr() as *const c_void,
                    h,
                    ffi::RSMPI_UINT64_T,
                    got.as_mut_ptr() as *mut c_void,
                    h,
                    ffi::RSMPI_UINT64_T,
                    r as c_int,
                    self.comm,
                    req,
                ),
                None => ffi::MPI_Ialltoall(
                    flat.as_ptr() as *const c_void,
                    h,
                    ffi::RSMPI_UINT64_T,
                    got.as_mut_ptr() as *mut c_void,
                    h,
                    ffi::RSMPI_UINT64_T,
                    self.comm,
                    req,
                ),
            }
        })?;
        got.chunks(HEADER_WORDS).map(Desc::from_words).collect()
    }

    /// Byte views of several tensors as one buffer with displacements: zero
    /// copy when they are consecutive pieces of one allocation (e.g. from
    /// `chunk`), packed into one tensor otherwise.
    fn packed(ts: &[Tensor]) -> Result<(Bytes, Vec<usize>, Vec<Bytes>)> {
        let parts = ts.iter().map(bytes).collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = parts.iter().map(|b| b.len).collect();
        let adjacent = parts
            .windows(2)
            .all(|w| w[0].ptr.wrapping_add(w[0].len) == w[1].ptr);
        if adjacent && !parts.is_empty() {
            let base = Bytes {
                tensor: parts[0].tensor.clone(),
                ptr: parts[0].ptr,
                len: lens.iter().sum(),
            };
            return Ok((base, lens, parts));
        }
        let flat = ts
            .iter()
            .map(|t| t.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let joined = if flat.is_empty() {
            Tensor::zeros(0, DType::U8, &crate::comm::HOST)?
        } else {
            Tensor::cat(&flat, 0)?
        };
        Ok((bytes(&joined)?, lens, parts))
    }

    /// Allgather raw bytes; returns the buffer as a tensor of `dtype` and the
    /// element counts of each rank.
    fn allgatherv(&self, op: &str, t: &Bytes, dtype: DType, counts_el: &[usize]) -> Result<Tensor> {
        let size = dtype.size_in_bytes();
        let total: usize = counts_el.iter().sum();
        let mut out = Fresh::new(dtype, total)?;
        let byte_counts: Vec<usize> = counts_el.iter().map(|c| c * size).collect();
        let (c, d) = counts(&byte_counts, op)?;
        let ptr = out.ptr();
        self.run(op, |req| unsafe {
            ffi::MPI_Iallgatherv(
                t.ptr as *const c_void,
                count(t.len, op).unwrap_or(0),
                byte_t(),
                ptr as *mut c_void,
                c.as_ptr(),
                d.as_ptr(),
                byte_t(),
                self.comm,
                req,
            )
        })?;
        Ok(out.into_tensor(total))
    }
}

impl Backend for MpiComm {
    fn name(&self) -> &'static str {
        "mpi"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size_()
    }
    fn intra_rank(&self) -> usize {
        PROCESS
            .get()
            .and_then(|p| p.as_ref().ok())
            .map_or(0, |p| p.intra_rank)
    }
    fn intra_size(&self) -> usize {
        PROCESS
            .get()
            .and_then(|p| p.as_ref().ok())
            .map_or(1, |p| p.intra_size)
    }
    fn world_ranks(&self) -> Vec<usize> {
        self.members.clone()
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        progress();
        let header = Box::new(Desc::new(Kind::Send).tensor(t).to_words()?);
        let data = bytes(&snapshot(t)?)?;
        let len = count(data.len, "send")?;
        let (mut rh, mut rd) = (unsafe { ffi::RSMPI_REQUEST_NULL }, unsafe {
            ffi::RSMPI_REQUEST_NULL
        });
        unsafe {
            ok(
                ffi::MPI_Isend(
                    header.as_ptr() as *const c_void,
                    HEADER_WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    dst as c_int,
                    TAG_HEADER,
                    self.comm,
                    &mut rh,
                ),
                "send",
            )?;
            ok(
                ffi::MPI_Isend(
                    data.ptr as *const c_void,
                    len,
                    byte_t(),
                    dst as c_int,
                    TAG_DATA,
                    self.comm,
                    &mut rd,
                ),
                "send",
            )?;
        }
        // Kept until MPI has sent them, even if a panic poisoned the lock.
        let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        p.push((rh, Keep::Header(header)));
        p.push((rd, Keep::Data(data)));
        Ok(())
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        progress();
        let op = format!("recv(from rank {})", self.members[src]);
        let mut header: Header = [0; HEADER_WORDS];
        self.run(&op, |req| unsafe {
            ffi::MPI_Irecv(
                header.as_mut_ptr() as *mut c_void,
                HEADER_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                src as c_int,
                TAG_HEADER,
                self.comm,
                req,
            )
        })?;
        let desc = Desc::from_words(&header)?;
        let (Some(dtype), Some(shape)) = (desc.dtype, desc.shape) else {
            return Err(Error::Mpi(format!(
                "{op}: the message header carries no tensor"
            )));
        };
        let n = elems(&shape);
        let mut out = Fresh::new(dtype, n)?;
        let len = count(n * dtype.size_in_bytes(), &op)?;
        let ptr = out.ptr();
        self.run(&op, |req| unsafe {
            ffi::MPI_Irecv(
                ptr as *mut c_void,
                len,
                byte_t(),
                src as c_int,
                TAG_DATA,
                self.comm,
                req,
            )
        })?;
        Ok(out.into_tensor(shape))
    }

    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor> {
        let mut desc = Desc::new(Kind::Bcast).root(root);
        if let Some(t) = t {
            desc = desc.tensor(t);
        }
        let descs = self.headers(&desc)?;
        let (Some(dtype), Some(shape)) = (descs[root].dtype, descs[root].shape.clone()) else {
            return Err(Error::Mpi(
                "bcast: the root's header carries no tensor".into(),
            ));
        };
        let n = elems(&shape);
        let len = count(n * dtype.size_in_bytes(), "bcast")?;
        // The root broadcasts from (a snapshot of) its tensor, which is also
        // its result; the others receive into fresh storage.
        let mut src = None;
        let mut out = None;
        let ptr = if self.rank == root {
            let t = t.ok_or_else(|| Error::Usage("bcast: the root passed no tensor".into()))?;
            src.insert(bytes(&snapshot(t)?)?).ptr as *mut u8
        } else {
            out.insert(Fresh::new(dtype, n)?).ptr()
        };
        self.run("bcast", |req| unsafe {
            ffi::MPI_Ibcast(
                ptr as *mut c_void,
                len,
                byte_t(),
                root as c_int,
                self.comm,
                req,
            )
        })?;
        match (src, out) {
            (Some(src), _) => Ok(src.tensor.reshape(shape)?),
            (None, Some(out)) => Ok(out.into_tensor(shape)),
            (None, None) => Err(Error::Mpi("bcast: no buffer".into())),
        }
    }

    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let descs = self.headers(&Desc::new(Kind::Gather).root(root).tensor(t))?;
        let src = bytes(t)?;
        let shapes: Vec<Vec<usize>> = descs
            .iter()
            .map(|d| d.shape.clone().unwrap_or_default())
            .collect();
        let n_el: Vec<usize> = shapes.iter().map(|s| elems(s)).collect();
        let size = t.dtype().size_in_bytes();
        let byte_counts: Vec<usize> = n_el.iter().map(|c| c * size).collect();
        let (c, d) = counts(&byte_counts, "gather")?;
        let mut out = if self.rank == root {
            Some(Fresh::new(t.dtype(), n_el.iter().sum())?)
        } else {
            None
        };
        let ptr = out.as_mut().map_or(std::ptr::null_mut(), |o| o.ptr());
        let len = count(src.len, "gather")?;
        self.run("gather", |req| unsafe {
            ffi::MPI_Igatherv(
                src.ptr as *const c_void,
                len,
                byte_t(),
                ptr as *mut c_void,
                c.as_ptr(),
                d.as_ptr(),
                byte_t(),
                root as c_int,
                self.comm,
                req,
            )
        })?;
        let Some(out) = out else { return Ok(None) };
        Ok(Some(unpack(out, &shapes)?))
    }

    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let ts = if self.rank == root {
            ts.unwrap_or(&[])
        } else {
            &[]
        };
        self.headers(&Desc::new(Kind::Scatter).root(root).tensors(ts))?;
        let mine: Vec<Header> = ts
            .iter()
            .map(|t| Desc::new(Kind::Scatter).root(root).tensor(t).to_words())
            .collect::<Result<_>>()?;
        let got = self.route_headers("scatter", &mine, Some(root))?;
        let (Some(dtype), Some(shape)) = (got[0].dtype, got[0].shape.clone()) else {
            return Err(Error::Mpi("scatter: header carries no tensor".into()));
        };
        let n = elems(&shape);
        let mut out = Fresh::new(dtype, n)?;
        let ptr = out.ptr();
        let len = count(n * dtype.size_in_bytes(), "scatter")?;
        let (base, lens, _keep) = Self::packed(ts)?;
        let (c, d) = counts(&lens, "scatter")?;
        self.run("scatter", |req| unsafe {
            ffi::MPI_Iscatterv(
                base.ptr as *const c_void,
                c.as_ptr(),
                d.as_ptr(),
                byte_t(),
                ptr as *mut c_void,
                len,
                byte_t(),
                root as c_int,
                self.comm,
                req,
            )
        })?;
        Ok(out.into_tensor(shape))
    }

    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let descs = self.headers(&Desc::new(Kind::Allgather).tensor(t))?;
        let rows: Vec<usize> = descs
            .iter()
            .map(|d| {
                d.shape
                    .as_ref()
                    .and_then(|s| s.first().copied())
                    .unwrap_or(0)
            })
            .collect();
        let row: usize = t.dims()[1..].iter().product();
        let el: Vec<usize> = rows.iter().map(|r| r * row).collect();
        let src = bytes(t)?;
        let flat = self.allgatherv("allgather", &src, t.dtype(), &el)?;
        let mut shape = t.dims().to_vec();
        shape[0] = rows.iter().sum();
        Ok((flat.reshape(shape)?, rows))
    }

    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        self.headers(&Desc::new(Kind::Alltoall).tensors(ts))?;
        let mine: Vec<Header> = ts
            .iter()
            .map(|t| Desc::new(Kind::Alltoall).tensor(t).to_words())
            .collect::<Result<_>>()?;
        let got = self.route_headers("alltoall", &mine, None)?;
        let shapes: Vec<Vec<usize>> = got
            .iter()
            .map(|d| d.shape.clone().unwrap_or_default())
            .collect();
        self.alltoall_data(ts, ts[0].dtype(), &shapes)
    }

    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.headers(&Desc::new(Kind::Allreduce).reduce(op).tensor(t))?;
        let Some(dt) = reduce_type(t.dtype()) else {
            // No native MPI reduction (f16, bf16): gather and fold in rank order.
            let n = t.elem_count();
            let src = bytes(t)?;
            let all = self.allgatherv("allreduce", &src, t.dtype(), &vec![n; self.size_()])?;
            let parts = (0..self.size_())
                .map(|r| all.narrow(0, r * n, n)?.reshape(t.dims()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            return fold(&parts, op);
        };
        let src = bytes(t)?;
        let n = t.elem_count();
        let mut out = Fresh::new(t.dtype(), n)?;
        let ptr = out.ptr();
        let c = count(n, "allreduce")?;
        self.run("allreduce", |req| unsafe {
            ffi::MPI_Iallreduce(
                src.ptr as *const c_void,
                ptr as *mut c_void,
                c,
                dt,
                mpi_op(op),
                self.comm,
                req,
            )
        })?;
        finish_mean(out.into_tensor(t.dims()), op, self.size_())
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.headers(&Desc::new(Kind::ReduceScatter).reduce(op).tensor(t))?;
        let sizes = chunk_sizes(t.dim(0)?, self.size_());
        let row: usize = t.dims()[1..].iter().product();
        let mut shape = t.dims().to_vec();
        shape[0] = sizes[self.rank];
        let Some(dt) = reduce_type(t.dtype()) else {
            // No native MPI reduction: route chunk r to rank r, fold in rank order.
            let chunks = split_rows(&t.contiguous()?, &sizes)?;
            let got = self.alltoall_data(&chunks, t.dtype(), &vec![shape.clone(); self.size_()])?;
            return fold(&got, op);
        };
        let src = bytes(t)?;
        let el: Vec<c_int> = sizes
            .iter()
            .map(|s| count(s * row, "reduce_scatter"))
            .collect::<Result<_>>()?;
        let mut out = Fresh::new(t.dtype(), sizes[self.rank] * row)?;
        let ptr = out.ptr();
        self.run("reduce_scatter", |req| unsafe {
            ffi::MPI_Ireduce_scatter(
                src.ptr as *const c_void,
                ptr as *mut c_void,
                el.as_ptr(),
                dt,
                mpi_op(op),
                self.comm,
                req,
            )
        })?;
        finish_mean(out.into_tensor(shape), op, self.size_())
    }

    fn barrier(&self) -> Result<()> {
        // The header exchange is an allgather: nobody leaves before all arrive.
        self.headers(&Desc::new(Kind::Barrier)).map(|_| ())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>> {
        let mut desc = Desc::new(Kind::Split);
        desc.color = color.map_or(-1, i64::from);
        desc.key = key;
        let descs = self.headers(&desc)?;
        let mut new: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        let c = color.map_or(unsafe { ffi::RSMPI_UNDEFINED }, |c| c as c_int);
        // MPI orders by key then parent rank, as the local backend does.
        let k = c_int::try_from(key)
            .map_err(|_| Error::Usage(format!("split: key {key} does not fit an MPI int")))?;
        ok(
            unsafe { ffi::MPI_Comm_split(self.comm, c, k, &mut new) },
            "split",
        )?;
        let Some(color) = color else { return Ok(None) };
        let mut mine: Vec<(i64, usize)> = descs
            .iter()
            .enumerate()
            .filter(|(_, d)| d.color == i64::from(color))
            .map(|(r, d)| (d.key, r))
            .collect();
        mine.sort();
        let rank = mine.iter().position(|(_, r)| *r == self.rank).unwrap_or(0);
        Ok(Some(Arc::new(MpiComm {
            comm: new,
            rank,
            members: mine.iter().map(|(_, r)| self.members[*r]).collect(),
        })))
    }
}

impl MpiComm {
    /// Alltoall of tensors whose received shapes are already known: one
    /// `MPI_Irecv` and one `MPI_Isend` per peer, straight between the
    /// senders' tensors and one fresh output (MPICH's `MPI_Ialltoallv`
    /// schedule measured at half the bandwidth of its blocking alltoall).
    fn alltoall_data(
        &self,
        ts: &[Tensor],
        dtype: DType,
        shapes: &[Vec<usize>],
    ) -> Result<Vec<Tensor>> {
        let n_el: Vec<usize> = shapes.iter().map(|s| elems(s)).collect();
        let esize = dtype.size_in_bytes();
        let mut out = Fresh::new(dtype, n_el.iter().sum())?;
        let base = out.ptr();
        let offs = chunk_offsets(&n_el);
        let parts = ts.iter().map(bytes).collect::<Result<Vec<_>>>()?;
        let mut reqs = Vec::with_capacity(2 * parts.len());
        for (peer, part) in parts.iter().enumerate() {
            // SAFETY: offsets lie inside `out`, sized to hold every part.
            let dst = unsafe { base.add(offs[peer] * esize) };
            if peer == self.rank {
                unsafe { std::ptr::copy_nonoverlapping(part.ptr, dst, part.len) };
                continue;
            }
            let (mut rr, mut rs) = unsafe { (ffi::RSMPI_REQUEST_NULL, ffi::RSMPI_REQUEST_NULL) };
            let rlen = count(n_el[peer] * esize, "alltoall")?;
            unsafe {
                ok(
                    ffi::MPI_Irecv(
                        dst as *mut c_void,
                        rlen,
                        byte_t(),
                        peer as c_int,
                        TAG_ALLTOALL,
                        self.comm,
                        &mut rr,
                    ),
                    "alltoall",
                )?;
                ok(
                    ffi::MPI_Isend(
                        part.ptr as *const c_void,
                        count(part.len, "alltoall")?,
                        byte_t(),
                        peer as c_int,
                        TAG_ALLTOALL,
                        self.comm,
                        &mut rs,
                    ),
                    "alltoall",
                )?;
            }
            reqs.push(rr);
            reqs.push(rs);
        }
        for r in reqs.iter_mut() {
            wait(r, "alltoall");
        }
        unpack(out, shapes)
    }
}

/// Views of consecutive tensors of `shapes` in one filled buffer (no copy).
fn unpack(out: Fresh, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let n_el: Vec<usize> = shapes.iter().map(|s| elems(s)).collect();
    let all = out.into_tensor(n_el.iter().sum::<usize>());
    let offs = chunk_offsets(&n_el);
    Ok(shapes
        .iter()
        .zip(offs.iter().zip(&n_el))
        .map(|(s, (o, n))| all.narrow(0, *o, *n)?.reshape(s.as_slice()))
        .collect::<candle_core::Result<Vec<_>>>()?)
}

// SAFETY: an MPI communicator handle is a plain integer in MPICH, and MPI is
// initialised with MPI_THREAD_MULTIPLE.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}
