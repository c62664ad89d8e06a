//! The same operations as the benchmark, called directly on MPICH on the
//! world communicator with preallocated buffers: the reference the MPI
//! backend is measured against.

use crate::{Error, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

/// A closure that runs `op` once on `bytes` bytes (f32 elements) with raw MPI.
pub fn raw_mpi(op: &str, bytes: usize) -> Result<Box<dyn FnMut()>> {
    let (world, rank, size) = unsafe {
        let (mut r, mut s) = (0, 0);
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut r);
        ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut s);
        (ffi::RSMPI_COMM_WORLD, r, s)
    };
    let el = bytes / 4;
    let per = (el / size as usize) as c_int;
    let mut send = vec![1f32; el];
    let mut recv = vec![0f32; el];
    let f32t = unsafe { ffi::RSMPI_FLOAT };
    let ignore = unsafe { ffi::RSMPI_STATUS_IGNORE };
    Ok(match op {
        "send/recv" => Box::new(move || unsafe {
            let (s, d) = (
                send.as_mut_ptr() as *mut c_void,
                recv.as_mut_ptr() as *mut c_void,
            );
            if rank == 0 {
                ffi::MPI_Send(s, el as c_int, f32t, 1, 7, world);
                ffi::MPI_Recv(d, el as c_int, f32t, 1, 7, world, ignore);
            } else if rank == 1 {
                ffi::MPI_Recv(d, el as c_int, f32t, 0, 7, world, ignore);
                ffi::MPI_Send(d, el as c_int, f32t, 0, 7, world);
            }
        }),
        "allgather" => Box::new(move || unsafe {
            ffi::MPI_Allgather(
                send.as_ptr() as *const c_void,
                per,
                f32t,
                recv.as_mut_ptr() as *mut c_void,
                per,
                f32t,
                world,
            );
        }),
        "allreduce" => Box::new(move || unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr() as *const c_void,
                recv.as_mut_ptr() as *mut c_void,
                el as c_int,
                f32t,
                ffi::RSMPI_SUM,
                world,
            );
        }),
        "alltoall" => Box::new(move || unsafe {
            ffi::MPI_Alltoall(
                send.as_ptr() as *const c_void,
                per,
                f32t,
                recv.as_mut_ptr() as *mut c_void,
                per,
                f32t,
                world,
            );
        }),
        other => {
            return Err(Error::Usage(format!(
                "raw MPI benchmark: unknown op {other}"
            )))
        }
    })
}
