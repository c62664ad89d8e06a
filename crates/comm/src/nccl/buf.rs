//! Device memory for NCCL: the address of a tensor's elements on this
//! rank's GPU, and fresh buffers NCCL writes that become candle tensors
//! without a copy (the GPU twin of `comm::mpi::buf`).

use super::gpu;
use crate::desc::unsupported_dtype;
use crate::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Device, Shape, Storage, Tensor};
use std::ffi::c_void;

/// Fresh device memory for NCCL to write, one arm per dtype that travels.
pub(super) enum Fresh {
    U8(CudaSlice<u8>),
    U32(CudaSlice<u32>),
    I64(CudaSlice<i64>),
    F16(CudaSlice<half::f16>),
    BF16(CudaSlice<half::bf16>),
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
}

macro_rules! each_fresh {
    ($v:expr, $s:ident => $body:expr) => {
        match $v {
            Fresh::U8($s) => $body,
            Fresh::U32($s) => $body,
            Fresh::I64($s) => $body,
            Fresh::F16($s) => $body,
            Fresh::BF16($s) => $body,
            Fresh::F32($s) => $body,
            Fresh::F64($s) => $body,
        }
    };
}

impl Fresh {
    pub(super) fn new(dev: &CudaDevice, dtype: DType, n: usize) -> Result<Self> {
        // At least one element: a zero-length allocation has no address.
        let n = n.max(1);
        let e = gpu("allocating an NCCL buffer");
        // SAFETY: every element a caller reads is written by NCCL first.
        unsafe {
            Ok(match dtype {
                DType::U8 => Fresh::U8(dev.alloc::<u8>(n).map_err(e)?),
                DType::U32 => Fresh::U32(dev.alloc::<u32>(n).map_err(e)?),
                DType::I64 => Fresh::I64(dev.alloc::<i64>(n).map_err(e)?),
                DType::F16 => Fresh::F16(dev.alloc::<half::f16>(n).map_err(e)?),
                DType::BF16 => Fresh::BF16(dev.alloc::<half::bf16>(n).map_err(e)?),
                DType::F32 => Fresh::F32(dev.alloc::<f32>(n).map_err(e)?),
                DType::F64 => Fresh::F64(dev.alloc::<f64>(n).map_err(e)?),
                d => return Err(unsupported_dtype(d)),
            })
        }
    }

    /// The buffer's device address, `elem` elements in.
    pub(super) fn ptr(&mut self, dev: &CudaDevice, elem: usize, size: usize) -> *mut c_void {
        let stream = dev.cuda_stream();
        let base = each_fresh!(self, s => s.device_ptr_mut(&stream).0);
        (base + (elem * size) as u64) as *mut c_void
    }

    pub(super) fn into_tensor(self, dev: &CudaDevice, shape: Shape) -> Result<Tensor> {
        let storage = each_fresh!(self, s => CudaStorage::wrap_cuda_slice(s, dev.clone()));
        let n = shape.elem_count();
        let t = Tensor::from_storage(
            Storage::Cuda(storage),
            Shape::from(n.max(1)),
            candle_core::op::BackpropOp::none(),
            false,
        );
        // The buffer has at least one element; the tensor exactly the shape's.
        Ok(t.narrow(0, 0, n)?.reshape(shape)?)
    }
}

/// A contiguous tensor on this rank's GPU and its device address (the
/// tensor keeps the memory alive while NCCL reads it).
pub(super) struct Read {
    _keep: Tensor,
    pub(super) ptr: *const c_void,
}

pub(super) fn read(t: &Tensor, dev: &CudaDevice) -> Result<Read> {
    let t = t.to_device(&Device::Cuda(dev.clone()))?.contiguous()?;
    let ptr = {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(Error::Gpu("expected a tensor on the GPU".into()));
        };
        let stream = dev.cuda_stream();
        let e = |x: candle_core::Error| Error::Gpu(format!("reading a tensor's address: {x}"));
        let base = match cs.dtype() {
            DType::U8 => cs.as_cuda_slice::<u8>().map_err(e)?.device_ptr(&stream).0,
            DType::U32 => cs.as_cuda_slice::<u32>().map_err(e)?.device_ptr(&stream).0,
            DType::I64 => cs.as_cuda_slice::<i64>().map_err(e)?.device_ptr(&stream).0,
            DType::F16 => {
                cs.as_cuda_slice::<half::f16>()
                    .map_err(e)?
                    .device_ptr(&stream)
                    .0
            }
            DType::BF16 => {
                cs.as_cuda_slice::<half::bf16>()
                    .map_err(e)?
                    .device_ptr(&stream)
                    .0
            }
            DType::F32 => cs.as_cuda_slice::<f32>().map_err(e)?.device_ptr(&stream).0,
            DType::F64 => cs.as_cuda_slice::<f64>().map_err(e)?.device_ptr(&stream).0,
            d => return Err(unsupported_dtype(d)),
        };
        (base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64) as *const c_void
    };
    Ok(Read { _keep: t, ptr })
}
