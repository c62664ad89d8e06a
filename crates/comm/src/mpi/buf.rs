//! Raw views of tensor memory for MPI: the bytes of a contiguous CPU tensor,
//! and fresh typed storage for MPI to write into, so that data goes from MPI
//! straight into a candle tensor without an extra copy.

use crate::{Error, Result};
use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use std::mem::MaybeUninit;

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
    let t = t.to_device(&crate::HOST)?.contiguous()?;
    let (ptr, len) = {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Mpi("expected a CPU tensor".into()));
        };
        storage_range(cpu, layout)
    };
    Ok(Bytes {
        tensor: t,
        ptr,
        len,
    })
}

fn storage_range(cpu: &CpuStorage, layout: &Layout) -> (*const u8, usize) {
    let size = cpu.dtype().size_in_bytes();
    let base = match cpu {
        CpuStorage::U8(v) => v.as_ptr(),
        CpuStorage::U32(v) => v.as_ptr() as *const u8,
        CpuStorage::I64(v) => v.as_ptr() as *const u8,
        CpuStorage::F16(v) => v.as_ptr() as *const u8,
        CpuStorage::BF16(v) => v.as_ptr() as *const u8,
        CpuStorage::F32(v) => v.as_ptr() as *const u8,
        CpuStorage::F64(v) => v.as_ptr() as *const u8,
        other => other
            .as_slice::<u8>()
            .map(|s| s.as_ptr())
            .unwrap_or(std::ptr::null()),
    };
    // SAFETY: the layout's offset lies inside the storage.
    (
        unsafe { base.add(layout.start_offset() * size) },
        layout.shape().elem_count() * size,
    )
}

/// Fresh, uninitialised storage of `n` elements of one dtype for MPI to fill
/// (zeroing it first would cost a full extra pass over the memory).
pub(crate) enum Fresh {
    U8(Vec<MaybeUninit<u8>>),
    U32(Vec<MaybeUninit<u32>>),
    I64(Vec<MaybeUninit<i64>>),
    F16(Vec<MaybeUninit<f16>>),
    BF16(Vec<MaybeUninit<bf16>>),
    F32(Vec<MaybeUninit<f32>>),
    F64(Vec<MaybeUninit<f64>>),
}

fn uninit<T>(n: usize) -> Vec<MaybeUninit<T>> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: MaybeUninit needs no initialisation.
    unsafe { v.set_len(n) };
    v
}

/// SAFETY: every element must have been written.
unsafe fn assume_init<T>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity())
}

impl Fresh {
    pub(crate) fn new(dtype: DType, n: usize) -> Result<Self> {
        Ok(match dtype {
            DType::U8 => Fresh::U8(uninit(n)),
            DType::U32 => Fresh::U32(uninit(n)),
            DType::I64 => Fresh::I64(uninit(n)),
            DType::F16 => Fresh::F16(uninit(n)),
            DType::BF16 => Fresh::BF16(uninit(n)),
            DType::F32 => Fresh::F32(uninit(n)),
            DType::F64 => Fresh::F64(uninit(n)),
            d => return Err(crate::desc::unsupported_dtype(d)),
        })
    }

    pub(crate) fn ptr(&mut self) -> *mut u8 {
        match self {
            Fresh::U8(v) => v.as_mut_ptr() as *mut u8,
            Fresh::U32(v) => v.as_mut_ptr() as *mut u8,
            Fresh::I64(v) => v.as_mut_ptr() as *mut u8,
            Fresh::F16(v) => v.as_mut_ptr() as *mut u8,
            Fresh::BF16(v) => v.as_mut_ptr() as *mut u8,
            Fresh::F32(v) => v.as_mut_ptr() as *mut u8,
            Fresh::F64(v) => v.as_mut_ptr() as *mut u8,
        }
    }

    /// The filled storage as a tensor of `shape`. Only call once MPI has
    /// written every element (every caller receives exactly the full buffer).
    pub(crate) fn into_tensor<S: Into<Shape>>(self, shape: S) -> Tensor {
        // SAFETY: the completed MPI operation wrote the whole buffer.
        let storage = unsafe {
            match self {
                Fresh::U8(v) => CpuStorage::U8(assume_init(v)),
                Fresh::U32(v) => CpuStorage::U32(assume_init(v)),
                Fresh::I64(v) => CpuStorage::I64(assume_init(v)),
                Fresh::F16(v) => CpuStorage::F16(assume_init(v)),
                Fresh::BF16(v) => CpuStorage::BF16(assume_init(v)),
                Fresh::F32(v) => CpuStorage::F32(assume_init(v)),
                Fresh::F64(v) => CpuStorage::F64(assume_init(v)),
            }
        };
        Tensor::from_storage(
            Storage::Cpu(storage),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        )
    }
}

/// Copy `src` to `dst` (the same length) with 16-byte vector moves.
///
/// glibc's `memcpy` copies a few kilobytes with `rep movsb`, which on some
/// AMD EPYC machines (this development VM among them) runs at ~2 GB/s
/// instead of ~60 when source and destination are aligned differently: a
/// 4 KB message then spends 2 µs in one copy. Small messages are copied
/// here instead.
pub(crate) fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bytes: lengths differ");
    let n = src.len();
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
        while i + 64 <= n {
            // SAFETY: i + 64 ≤ n for both slices; unaligned loads and stores.
            unsafe {
                let s = src.as_ptr().add(i) as *const __m128i;
                let d = dst.as_mut_ptr().add(i) as *mut __m128i;
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_storeu_si128(d, a);
                _mm_storeu_si128(d.add(1), b);
                _mm_storeu_si128(d.add(2), c);
                _mm_storeu_si128(d.add(3), e);
            }
            i += 64;
        }
    }
    dst[i..].copy_from_slice(&src[i..]);
}

#[cfg(test)]
mod tests {
    #[test]
    fn copy_bytes_copies_every_length_and_offset() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..17 {
            for n in 0..(300 - off) {
                let mut dst = vec![0u8; n + 5];
                super::copy_bytes(&mut dst[3..3 + n], &src[off..off + n]);
                assert_eq!(&dst[3..3 + n], &src[off..off + n]);
                assert_eq!(&dst[..3], &[0, 0, 0]);
                assert_eq!(&dst[3 + n..], &[0, 0]);
            }
        }
    }
}
