//! Raw views of tensor memory for MPI: the bytes of a contiguous CPU tensor,
//! and fresh typed storage for MPI to write into, so that data goes from MPI
//! straight into a candle tensor without an extra copy.

use crate::{Error, Result};
use candle_core::{backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Storage, Tensor};

/// A contiguous CPU tensor and the address of its first byte.
pub(crate) struct Bytes {
    /// Keeps the memory alive (and is what the caller reshapes or narrows).
    pub tensor: Tensor,
    pub ptr: *const u8,
    pub len: usize,
}

// The pointer refers to memory owned by `tensor`, which is immutable here.
unsafe impl Send for Bytes {}

/// The bytes of `t` (moved to the CPU and made contiguous when needed).
pub(crate) fn bytes(t: &Tensor) -> Result<Bytes> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?;
    let (ptr, len) = {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Mpi("expected a CPU tensor".into()));
        };
        storage_range(cpu, layout)
    };
    Ok(Bytes { tensor: t, ptr, len })
}

fn storage_range(cpu: &CpuStorage, layout: &Layout) -> (*const u8, usize) {
    let size = cpu.dtype().size_in_bytes();
    let base = match cpu {
        CpuStorage::U8(v) => v.as_ptr() as *const u8,
        CpuStorage::U32(v) => v.as_ptr() as *const u8,
        CpuStorage::I64(v) => v.as_ptr() as *const u8,
        CpuStorage::F16(v) => v.as_ptr() as *const u8,
        CpuStorage::BF16(v) => v.as_ptr() as *const u8,
        CpuStorage::F32(v) => v.as_ptr() as *const u8,
        CpuStorage::F64(v) => v.as_ptr() as *const u8,
        other => other.as_slice::<u8>().map(|s| s.as_ptr()).unwrap_or(std::ptr::null()),
    };
    // SAFETY: the layout's offset lies inside the storage.
    (unsafe { base.add(layout.start_offset() * size) }, layout.shape().elem_count() * size)
}

/// Fresh storage of `n` elements of `dtype` for MPI to fill.
pub(crate) struct Fresh {
    storage: CpuStorage,
}

impl Fresh {
    pub(crate) fn new(dtype: DType, n: usize) -> Result<Self> {
        let storage = match dtype {
            DType::U8 => CpuStorage::U8(vec![0; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
            DType::F16 => CpuStorage::F16(vec![half::f16::ZERO; n]),
            DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO; n]),
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            d => return Err(Error::Usage(format!("dtype {} cannot be communicated", d.as_str()))),
        };
        Ok(Fresh { storage })
    }

    pub(crate) fn ptr(&mut self) -> *mut u8 {
        match &mut self.storage {
            CpuStorage::U8(v) => v.as_mut_ptr(),
            CpuStorage::U32(v) => v.as_mut_ptr() as *mut u8,
            CpuStorage::I64(v) => v.as_mut_ptr() as *mut u8,
            CpuStorage::F16(v) => v.as_mut_ptr() as *mut u8,
            CpuStorage::BF16(v) => v.as_mut_ptr() as *mut u8,
            CpuStorage::F32(v) => v.as_mut_ptr() as *mut u8,
            CpuStorage::F64(v) => v.as_mut_ptr() as *mut u8,
            _ => std::ptr::null_mut(),
        }
    }

    /// The filled storage as a tensor of `shape`.
    pub(crate) fn into_tensor<S: Into<Shape>>(self, shape: S) -> Tensor {
        Tensor::from_storage(Storage::Cpu(self.storage), shape, candle_core::op::BackpropOp::none(), false)
    }
}
