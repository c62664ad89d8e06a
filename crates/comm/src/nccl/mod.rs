//! The `nccl` backend (feature `nccl`): one rank per GPU, collectives on
//! the GPUs through NCCL, as ChainerMN's `pure_nccl` communicator.
//!
//! | op | NCCL calls | agreement |
//! |----|------------|-----------|
//! | allreduce | `ncclAllReduce` (mean: `ncclAvg`) | header |
//! | reduce (hierarchical's first level) | `ncclReduce` | header |
//! | reduce_scatter | `ncclReduceScatter`; chunks of unequal rows: one `ncclReduce` per chunk to its owner, in a group | header |
//! | allgather | `ncclAllGather`; unequal first dimensions: one `ncclBroadcast` per rank into its slot, in a group | header |
//! | bcast | `ncclBroadcast` | header |
//! | gather, scatter, alltoall | `ncclSend`/`ncclRecv` pairs in a group (shapes may differ) | header; scatter and alltoall also each destination's shape |
//! | send, recv, barrier, split | the host backend the communicator was made over (send/recv through host memory, as ChainerMN's point-to-point functions go through MPI) | that backend's |
//!
//! Built over a host communicator (local threads or MPI processes) whose
//! ranks are bound to GPUs: that communicator broadcasts NCCL's unique id
//! from rank 0, carries every collective's header (operation, dtype, shape),
//! so ranks that disagree get [`Error::Mismatch`] before NCCL is called, and
//! a failed rank is reported as by that backend. Every rank first prepares
//! its GPU and the ranks agree that all did, so none waits in
//! `ncclCommInitRank` for a rank that already failed. A split makes a new
//! NCCL communicator over the host communicator's part. Every NCCL call is
//! issued on the rank's candle stream (ordered with the kernels around it)
//! and then waited for while `cuStreamQuery` and `ncclCommGetAsyncError` are
//! polled: an NCCL error, or no completion within `SHARDNET_TIMEOUT`, aborts
//! the NCCL communicator and returns an error naming the operation, never a
//! hang.
//!
//! NCCL's sums are not taken in rank order: a float allreduce may differ
//! from the local and MPI backends' in its last bits.

use super::desc::{first_dims, Desc, Kind};
use super::reduce::chunk_sizes;
use super::{Backend, Communicator, ReduceOp, HOST};
use crate::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::sys as cu;
use candle_core::cuda_backend::cudarc::nccl::sys as nc;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Shape, Tensor};
use std::ffi::c_void;
mod buf;

use buf::{read, Fresh, Read};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An NCCL communicator handle; aborted (never waited on) when dropped.
struct Handle(nc::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread; every call on
// this one is serialised by `Nccl::lock`.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}
impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is dropped once.
        unsafe {
            nc::ncclCommAbort(self.0);
        }
    }
}

pub(crate) struct Nccl {
    host: Communicator,
    comm: Handle,
    device: CudaDevice,
    timeout: Duration,
    /// One NCCL call sequence at a time (clones of a communicator share it).
    lock: Mutex<()>,
}

impl Communicator {
    /// An NCCL communicator over these ranks (ChainerMN's `pure_nccl`): each
    /// rank must be bound to its own GPU ([`Communicator::on_device`],
    /// `--device cuda`). Collectives run on the GPUs; send/recv, barrier and
    /// split stay on this communicator's backend. Collective.
    pub fn nccl(&self) -> Result<Communicator> {
        let backend = Nccl::new(self)?;
        Ok(Communicator {
            inner: Arc::new(backend),
            device: self.device.clone(),
            received: self.received.clone(),
        })
    }
}

fn gpu<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e}"))
}

fn nccl_ok(r: nc::ncclResult_t, what: &str) -> Result<()> {
    if r == nc::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static C string.
    let text = unsafe { std::ffi::CStr::from_ptr(nc::ncclGetErrorString(r)) };
    Err(Error::Gpu(format!(
        "{what}: NCCL {r:?}: {}",
        text.to_string_lossy()
    )))
}

fn nccl_type(d: DType) -> Result<nc::ncclDataType_t> {
    use nc::ncclDataType_t::*;
    Ok(match d {
        DType::U8 => ncclUint8,
        DType::U32 => ncclUint32,
        DType::I64 => ncclInt64,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        d => return Err(crate::desc::unsupported_dtype(d)),
    })
}

fn nccl_op(op: ReduceOp) -> nc::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
        ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nc::ncclRedOp_t::ncclMin,
        ReduceOp::Mean => nc::ncclRedOp_t::ncclAvg,
    }
}

impl Nccl {
    fn new(host: &Communicator) -> Result<Self> {
        let Device::Cuda(dev) = host.device().clone() else {
            return Err(Error::Usage(format!(
                "the NCCL communicator needs every rank on its own GPU, but rank {} computes on {:?}: \
                 pass --device cuda (or bind the rank with Communicator::on_device)",
                host.rank(),
                host.device().location()
            )));
        };
        // Everything that can fail on one rank alone happens before the
        // ranks enter ncclCommInitRank, which waits for all of them.
        let prepared = (|| -> Result<Vec<u8>> {
            dev.cuda_stream()
                .context()
                .bind_to_thread()
                .map_err(gpu("binding the GPU to this thread"))?;
            if host.rank() != 0 {
                return Ok(vec![0; 128]);
            }
            let mut id = std::mem::MaybeUninit::<nc::ncclUniqueId>::uninit();
            // SAFETY: NCCL writes the id.
            nccl_ok(
                unsafe { nc::ncclGetUniqueId(id.as_mut_ptr()) },
                "ncclGetUniqueId",
            )?;
            // SAFETY: written above.
            let id = unsafe { id.assume_init() };
            Ok(id.internal.iter().map(|c| *c as u8).collect())
        })();
        let ok = Tensor::new(&[u8::from(prepared.is_ok())], &HOST)?;
        let all_ok = host.fresh_counter().allgather(&ok)?.to_vec1::<u8>()?;
        let bytes = prepared?;
        if let Some(r) = all_ok.iter().position(|v| *v == 0) {
            return Err(Error::PeerFailed {
                op: "nccl".into(),
                rank: host.world_ranks()[r],
                message: "could not prepare its GPU for NCCL".into(),
            });
        }
        let id = host
            .fresh_counter()
            .bcast(Some(&Tensor::from_vec(bytes, 128, &HOST)?), 0)?
            .to_vec1::<u8>()?;
        let mut raw = nc::ncclUniqueId { internal: [0; 128] };
        for (d, s) in raw.internal.iter_mut().zip(&id) {
            *d = *s as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: every rank of `host` calls this with the same id.
        nccl_ok(
            unsafe { nc::ncclCommInitRank(&mut comm, host.size() as i32, raw, host.rank() as i32) },
            "ncclCommInitRank",
        )?;
        Ok(Nccl {
            host: host.fresh_counter(),
            comm: Handle(comm),
            device: dev,
            timeout: super::timeout()?,
            lock: Mutex::new(()),
        })
    }

    fn stream(&self) -> cu::CUstream {
        self.device.cuda_stream().cu_stream()
    }

    /// Every rank's header over the host backend, and the same check.
    fn agree(&self, desc: Desc) -> Result<Vec<Desc>> {
        self.host.agree_desc(desc)
    }

    /// Issue NCCL calls (`calls` returns NCCL's status), then wait for the
    /// stream while polling NCCL's asynchronous error, within the timeout.
    fn run(&self, what: &str, grouped: bool, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        let _guard = self.lock.lock().map_err(|_| {
            Error::Gpu(format!(
                "{what}: the NCCL communicator was poisoned by a panic"
            ))
        })?;
        self.device
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(gpu("binding the GPU to this thread"))?;
        if grouped {
            // SAFETY: paired with ncclGroupEnd below.
            nccl_ok(unsafe { nc::ncclGroupStart() }, what)?;
        }
        let issued = calls();
        if grouped {
            // SAFETY: closes the group opened above, whatever `calls` did.
            let end = nccl_ok(unsafe { nc::ncclGroupEnd() }, what);
            issued?;
            end?;
        } else {
            issued?;
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(1);
        loop {
            // SAFETY: the stream belongs to this rank's device.
            match unsafe { cu::cuStreamQuery(self.stream()) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(self.abort(format!("{what}: the GPU stream failed: {e:?}"))),
            }
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator.
            unsafe { nc::ncclCommGetAsyncError(self.comm.0, &mut state) };
            if state != nc::ncclResult_t::ncclSuccess && state != nc::ncclResult_t::ncclInProgress {
                let e = nccl_ok(state, what)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                return Err(self.abort(e));
            }
            if start.elapsed() > self.timeout {
                self.abort(String::new());
                return Err(Error::Timeout {
                    op: format!("{what} (NCCL)"),
                    missing: Vec::new(),
                    secs: self.timeout.as_secs_f64(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Abort the NCCL communicator (its kernels end; it cannot be used
    /// again) and describe the failure.
    fn abort(&self, message: String) -> Error {
        // SAFETY: aborting is allowed at any time; later calls fail.
        unsafe { nc::ncclCommAbort(self.comm.0) };
        Error::Gpu(format!("{message} (the NCCL communicator was aborted)"))
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor::zeros(
            shape,
            dtype,
            &Device::Cuda(self.device.clone()),
        )?)
    }

    /// Grouped point-to-point: send `sends[d]` to each d, receive a tensor
    /// of `recv_shapes[s]` from each s (None: nothing), own part kept.
    fn exchange(
        &self,
        what: &str,
        sends: &[Option<&Tensor>],
        recv_shapes: &[Option<Vec<usize>>],
        dtype: DType,
    ) -> Result<Vec<Option<Tensor>>> {
        let me = self.rank();
        let ty = nccl_type(dtype)?;
        let reads: Vec<Option<Read>> = sends
            .iter()
            .enumerate()
            .map(|(d, t)| match t {
                Some(t) if d != me && t.elem_count() > 0 => read(t, &self.device).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        let mut bufs: Vec<Option<(Fresh, Vec<usize>)>> = recv_shapes
            .iter()
            .enumerate()
            .map(|(s, sh)| match sh {
                Some(sh) if s != me && sh.iter().product::<usize>() > 0 => {
                    Fresh::new(&self.device, dtype, sh.iter().product())
                        .map(|b| Some((b, sh.clone())))
                }
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        let stream = self.stream();
        let size = dtype.size_in_bytes();
        self.run(what, true, || {
            for (d, r) in reads.iter().enumerate() {
                if let (Some(r), Some(t)) = (r, sends[d]) {
                    // SAFETY: the buffer holds t's elements on this device.
                    nccl_ok(
                        unsafe {
                            nc::ncclSend(
                                r.ptr,
                                t.elem_count(),
                                ty,
                                d as i32,
                                self.comm.0,
                                stream as _,
                            )
                        },
                        what,
                    )?;
                }
            }
            for (s, b) in bufs.iter_mut().enumerate() {
                if let Some((b, sh)) = b {
                    let ptr = b.ptr(&self.device, 0, size);
                    // SAFETY: the buffer holds the announced elements.
                    nccl_ok(
                        unsafe {
                            nc::ncclRecv(
                                ptr,
                                sh.iter().product(),
                                ty,
                                s as i32,
                                self.comm.0,
                                stream as _,
                            )
                        },
                        what,
                    )?;
                }
            }
            Ok(())
        })?;
        recv_shapes
            .iter()
            .zip(bufs)
            .enumerate()
            .map(|(s, (sh, b))| match (sh, b) {
                (_, Some((b, sh))) => b.into_tensor(&self.device, Shape::from(sh)).map(Some),
                (Some(sh), None) if s == me => Ok(sends[me].cloned()),
                (Some(sh), None) => self.zeros(sh, dtype).map(Some),
                (None, _) => Ok(None),
            })
            .collect()
    }

    /// Each destination's shape, from the ranks that send (over the host).
    fn shapes_of(ts: &[Tensor]) -> Result<Vec<Tensor>> {
        ts.iter()
            .map(|t| {
                let dims: Vec<i64> = t.dims().iter().map(|d| *d as i64).collect();
                Ok(Tensor::from_vec(dims.clone(), dims.len(), &HOST)?)
            })
            .collect()
    }

    fn dims(t: &Tensor) -> Result<Vec<usize>> {
        Ok(t.to_vec1::<i64>()?
            .into_iter()
            .map(|d| d as usize)
            .collect())
    }
}

impl Backend for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn intra_rank(&self) -> usize {
        self.host.intra_rank()
    }
    fn intra_size(&self) -> usize {
        self.host.intra_size()
    }
    fn world_ranks(&self) -> Vec<usize> {
        self.host.world_ranks()
    }
    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.host.send(&t.to_device(&HOST)?, dst)
    }
    fn recv(&self, src: usize) -> Result<Tensor> {
        self.host.recv(src)
    }
    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor> {
        let mut d = Desc::new(Kind::Bcast).root(root);
        if let Some(t) = t {
            d = d.tensor(t);
        }
        let descs = self.agree(d)?;
        let shape = descs[root].shape.clone().unwrap_or_default();
        let dtype = descs[root].dtype.unwrap_or(DType::F32);
        let n: usize = shape.iter().product();
        if n == 0 {
            return self.zeros(&shape, dtype);
        }
        let src = match (self.rank() == root, t) {
            (true, Some(t)) => Some(read(t, &self.device)?),
            _ => None,
        };
        let mut out = Fresh::new(&self.device, dtype, n)?;
        let ptr = out.ptr(&self.device, 0, dtype.size_in_bytes());
        let ty = nccl_type(dtype)?;
        let stream = self.stream();
        self.run("bcast", false, || {
            let s = src.as_ref().map_or(std::ptr::null(), |r| r.ptr);
            // SAFETY: both buffers hold n elements (the send one on the root).
            nccl_ok(
                unsafe { nc::ncclBroadcast(s, ptr, n, ty, root as i32, self.comm.0, stream as _) },
                "bcast",
            )
        })?;
        out.into_tensor(&self.device, Shape::from(shape))
    }
    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let descs = self.agree(Desc::new(Kind::Gather).root(root).tensor(t))?;
        let me = self.rank();
        let n = self.size();
        let mut sends = vec![None; n];
        if me != root {
            sends[root] = Some(t);
        } else {
            sends[me] = Some(t);
        }
        let shapes: Vec<Option<Vec<usize>>> = (0..n)
            .map(|s| (me == root).then(|| descs[s].shape.clone().unwrap_or_default()))
            .collect();
        let got = self.exchange("gather", &sends, &shapes, t.dtype())?;
        Ok((me == root).then(|| got.into_iter().flatten().collect()))
    }
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let mut d = Desc::new(Kind::Scatter).root(root);
        if let Some(ts) = ts {
            d = d.tensors(ts);
        }
        let descs = self.agree(d)?;
        let dtype = descs[root].dtype.unwrap_or(DType::F32);
        let me = self.rank();
        let shape_tensors = ts.map(Self::shapes_of).transpose()?;
        let mine = Self::dims(&self.host.scatter(shape_tensors.as_deref(), root)?)?;
        let n = self.size();
        let sends: Vec<Option<&Tensor>> = (0..n)
            .map(|d| ts.filter(|_| me == root).and_then(|ts| ts.get(d)))
            .collect();
        let shapes: Vec<Option<Vec<usize>>> =
            (0..n).map(|s| (s == root).then(|| mine.clone())).collect();
        let mut got = self.exchange("scatter", &sends, &shapes, dtype)?;
        got.swap_remove(root)
            .ok_or_else(|| Error::Gpu("scatter: nothing arrived from the root".into()))
    }
    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let descs = self.agree(Desc::new(Kind::Allgather).tensor(t))?;
        let firsts = first_dims(&descs);
        let row: usize = t.dims()[1..].iter().product();
        let total: usize = firsts.iter().sum();
        let mut shape = t.dims().to_vec();
        shape[0] = total;
        if total * row == 0 {
            return Ok((self.zeros(&shape, t.dtype())?, firsts));
        }
        let dtype = t.dtype();
        let ty = nccl_type(dtype)?;
        let size = dtype.size_in_bytes();
        let src = read(t, &self.device)?;
        let mut out = Fresh::new(&self.device, dtype, total * row)?;
        let stream = self.stream();
        if firsts.iter().all(|f| *f == firsts[0]) {
            let ptr = out.ptr(&self.device, 0, size);
            self.run("allgather", false, || {
                // SAFETY: out holds every rank's rows.
                nccl_ok(
                    unsafe {
                        nc::ncclAllGather(
                            src.ptr,
                            ptr,
                            firsts[0] * row,
                            ty,
                            self.comm.0,
                            stream as _,
                        )
                    },
                    "allgather",
                )
            })?;
        } else {
            let mut offset = 0;
            let slots: Vec<(*mut c_void, usize)> = firsts
                .iter()
                .map(|f| {
                    let p = (out.ptr(&self.device, offset, size), f * row);
                    offset += f * row;
                    p
                })
                .collect();
            self.run("allgather", true, || {
                for (r, (ptr, count)) in slots.iter().enumerate() {
                    if *count > 0 {
                        // SAFETY: each slot holds rank r's rows.
                        nccl_ok(
                            unsafe {
                                nc::ncclBroadcast(
                                    src.ptr,
                                    *ptr,
                                    *count,
                                    ty,
                                    r as i32,
                                    self.comm.0,
                                    stream as _,
                                )
                            },
                            "allgather",
                        )?;
                    }
                }
                Ok(())
            })?;
        }
        Ok((out.into_tensor(&self.device, Shape::from(shape))?, firsts))
    }
    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        let descs = self.agree(Desc::new(Kind::Alltoall).tensors(ts))?;
        let dtype = descs.iter().find_map(|d| d.dtype).unwrap_or(DType::F32);
        let shapes = self.host.alltoall(&Self::shapes_of(ts)?)?;
        let shapes: Vec<Option<Vec<usize>>> = shapes
            .iter()
            .map(|s| Self::dims(s).map(Some))
            .collect::<Result<_>>()?;
        let sends: Vec<Option<&Tensor>> = ts.iter().map(Some).collect();
        let got = self.exchange("alltoall", &sends, &shapes, dtype)?;
        Ok(got.into_iter().flatten().collect())
    }
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.agree(Desc::new(Kind::Allreduce).reduce(op).tensor(t))?;
        let n = t.elem_count();
        if n == 0 {
            return self.zeros(t.dims(), t.dtype());
        }
        let src = read(t, &self.device)?;
        let mut out = Fresh::new(&self.device, t.dtype(), n)?;
        let ptr = out.ptr(&self.device, 0, t.dtype().size_in_bytes());
        let ty = nccl_type(t.dtype())?;
        let stream = self.stream();
        self.run("allreduce", false, || {
            // SAFETY: both buffers hold n elements.
            nccl_ok(
                unsafe {
                    nc::ncclAllReduce(src.ptr, ptr, n, ty, nccl_op(op), self.comm.0, stream as _)
                },
                "allreduce",
            )
        })?;
        out.into_tensor(&self.device, t.shape().clone())
    }
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize) -> Result<Option<Tensor>> {
        // The same header as an allreduce: the two are one operation to the
        // flat backends, whose default reduce is an allreduce.
        self.agree(Desc::new(Kind::Allreduce).reduce(op).tensor(t))?;
        let n = t.elem_count();
        let me = self.rank();
        if n == 0 {
            return (me == root)
                .then(|| self.zeros(t.dims(), t.dtype()))
                .transpose();
        }
        let src = read(t, &self.device)?;
        let mut out = Fresh::new(&self.device, t.dtype(), n)?;
        let ptr = out.ptr(&self.device, 0, t.dtype().size_in_bytes());
        let ty = nccl_type(t.dtype())?;
        let stream = self.stream();
        self.run("reduce", false, || {
            // SAFETY: both buffers hold n elements (the result only on root).
            nccl_ok(
                unsafe {
                    nc::ncclReduce(
                        src.ptr,
                        ptr,
                        n,
                        ty,
                        nccl_op(op),
                        root as i32,
                        self.comm.0,
                        stream as _,
                    )
                },
                "reduce",
            )
        })?;
        (me == root)
            .then(|| out.into_tensor(&self.device, t.shape().clone()))
            .transpose()
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.agree(Desc::new(Kind::ReduceScatter).reduce(op).tensor(t))?;
        let n = self.size();
        let me = self.rank();
        let rows = chunk_sizes(t.dims()[0], n);
        let row: usize = t.dims()[1..].iter().product();
        let mut shape = t.dims().to_vec();
        shape[0] = rows[me];
        if rows[me] * row == 0 && rows.iter().all(|r| r * row == 0) {
            return self.zeros(&shape, t.dtype());
        }
        let dtype = t.dtype();
        let ty = nccl_type(dtype)?;
        let size = dtype.size_in_bytes();
        let src = read(t, &self.device)?;
        let mut out = Fresh::new(&self.device, dtype, rows[me] * row)?;
        let ptr = out.ptr(&self.device, 0, size);
        let stream = self.stream();
        if rows.iter().all(|r| *r == rows[0]) {
            self.run("reduce_scatter", false, || {
                // SAFETY: src holds n chunks, out one.
                nccl_ok(
                    unsafe {
                        nc::ncclReduceScatter(
                            src.ptr,
                            ptr,
                            rows[0] * row,
                            ty,
                            nccl_op(op),
                            self.comm.0,
                            stream as _,
                        )
                    },
                    "reduce_scatter",
                )
            })?;
        } else {
            self.run("reduce_scatter", true, || {
                let mut offset = 0;
                for (r, k) in rows.iter().enumerate() {
                    let count = k * row;
                    if count > 0 {
                        let s = (src.ptr as u64 + (offset * size) as u64) as *const c_void;
                        // Only the root's receive buffer is written.
                        let d = if r == me { ptr } else { s as *mut c_void };
                        // SAFETY: chunk r of src, into out on its owner.
                        nccl_ok(
                            unsafe {
                                nc::ncclReduce(
                                    s,
                                    d,
                                    count,
                                    ty,
                                    nccl_op(op),
                                    r as i32,
                                    self.comm.0,
                                    stream as _,
                                )
                            },
                            "reduce_scatter",
                        )?;
                    }
                    offset += count;
                }
                Ok(())
            })?;
        }
        if rows[me] * row == 0 {
            return self.zeros(&shape, dtype);
        }
        out.into_tensor(&self.device, Shape::from(shape))
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>> {
        // A new NCCL communicator over the host backend's part.
        let Some(part) = self.host.split(color, key)? else {
            return Ok(None);
        };
        Ok(Some(Arc::new(Nccl::new(&part)?)))
    }
    fn home(&self) -> Option<Device> {
        Some(Device::Cuda(self.device.clone()))
    }
}
