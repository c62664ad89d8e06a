//! The pieces the backend's operations are made of: the header exchange
//! that checks every rank's call, one non-blocking call waited on, the
//! variable-size allgather, the alltoall of known shapes, and the MPI
//! counts, datatypes and reduction ops.

use super::buf::{bytes, Bytes, Fresh};
use super::codes::{ok, Header};
use super::process::{progress, wait};
use super::MpiComm;
use crate::desc::{check, Desc, HEADER_WORDS};
use crate::reduce::chunk_offsets;
use crate::ReduceOp;
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

pub(super) const TAG_HEADER: c_int = 1;
pub(super) const TAG_DATA: c_int = 2;
const TAG_ALLTOALL: c_int = 3;

pub(super) fn count(n: usize, op: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::Usage(format!(
            "{op}: {n} elements is more than one MPI message can carry (2^31 - 1)"
        ))
    })
}

pub(super) fn counts(ns: &[usize], op: &str) -> Result<(Vec<c_int>, Vec<c_int>)> {
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

pub(super) fn byte_t() -> ffi::MPI_Datatype {
    unsafe { ffi::RSMPI_UINT8_T }
}

/// The MPI datatype that reduces `dtype` natively, if there is one.
pub(super) fn reduce_type(dtype: DType) -> Option<ffi::MPI_Datatype> {
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

pub(super) fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

pub(super) fn elems(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl MpiComm {
    pub(super) fn size_(&self) -> usize {
        self.members.len()
    }

    /// Exchange and check headers; returns every rank's description.
    pub(super) fn headers(&self, desc: &Desc) -> Result<Vec<Desc>> {
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
    pub(super) fn run(
        &self,
        op: &str,
        call: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        ok(call(&mut req), op)?;
        wait(&mut req, op);
        Ok(())
    }

    /// Exchange per-destination headers (alltoall and scatter).
    pub(super) fn route_headers(
        &self,
        op: &str,
        mine: &[Header],
        root: Option<usize>,
    ) -> Result<Vec<Desc>> {
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
    pub(super) fn packed(ts: &[Tensor]) -> Result<(Bytes, Vec<usize>, Vec<Bytes>)> {
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
            Tensor::zeros(0, DType::U8, &crate::HOST)?
        } else {
            Tensor::cat(&flat, 0)?
        };
        Ok((bytes(&joined)?, lens, parts))
    }

    /// Allgather raw bytes; returns the buffer as a tensor of `dtype` and the
    /// element counts of each rank.
    pub(super) fn allgatherv(
        &self,
        op: &str,
        t: &Bytes,
        dtype: DType,
        counts_el: &[usize],
    ) -> Result<Tensor> {
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

impl MpiComm {
    /// Alltoall of tensors whose received shapes are already known: one
    /// `MPI_Irecv` and one `MPI_Isend` per peer, straight between the
    /// senders' tensors and one fresh output (MPICH's `MPI_Ialltoallv`
    /// schedule measured at half the bandwidth of its blocking alltoall).
    pub(super) fn alltoall_data(
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
pub(super) fn unpack(out: Fresh, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let n_el: Vec<usize> = shapes.iter().map(|s| elems(s)).collect();
    let all = out.into_tensor(n_el.iter().sum::<usize>());
    let offs = chunk_offsets(&n_el);
    Ok(shapes
        .iter()
        .zip(offs.iter().zip(&n_el))
        .map(|(s, (o, n))| all.narrow(0, *o, *n)?.reshape(s.as_slice()))
        .collect::<candle_core::Result<Vec<_>>>()?)
}
