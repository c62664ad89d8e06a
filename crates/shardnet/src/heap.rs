//! The process's heap, counted: [`CountingAllocator`] wraps the system
//! allocator and keeps the bytes live now and their peak, so a run can
//! tell what it holds from what the allocator keeps (peak resident memory
//! counts both, and freed blocks the allocator keeps for reuse).
//!
//! | call | returns |
//! |------|---------|
//! | [`live_bytes`] | bytes allocated and not yet freed, now |
//! | [`peak_bytes`] | the largest [`live_bytes`] since start or [`reset_peak`] |
//! | [`installed`] | whether the program's global allocator is [`CountingAllocator`] |
//!
//! A program opts in with one line (the `shardnet` command does):
//!
//! ```
//! #[global_allocator]
//! static HEAP: shardnet::heap::CountingAllocator = shardnet::heap::CountingAllocator;
//!
//! let before = shardnet::heap::live_bytes().unwrap();
//! let v = vec![0u8; 1 << 20];
//! assert!(shardnet::heap::live_bytes().unwrap() >= before + (1 << 20));
//! drop(v);
//! assert!(shardnet::heap::peak_bytes().unwrap() >= before + (1 << 20));
//! ```
//!
//! Two relaxed atomic updates per allocation: nothing next to the kernels'
//! work, whose buffers are megabytes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counted (see the module doc).
pub struct CountingAllocator;

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Relaxed);
}

// SAFETY: every call is the system allocator's with the same arguments;
// the counters only read sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            if !INSTALLED.load(Relaxed) {
                INSTALLED.store(true, Relaxed);
            }
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            if !INSTALLED.load(Relaxed) {
                INSTALLED.store(true, Relaxed);
            }
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Whether the program's global allocator is [`CountingAllocator`] (it has
/// allocated through it).
pub fn installed() -> bool {
    INSTALLED.load(Relaxed)
}

/// Bytes allocated and not freed, now; `None` unless [`installed`].
pub fn live_bytes() -> Option<u64> {
    installed().then(|| LIVE.load(Relaxed))
}

/// The largest [`live_bytes`] since start or the last [`reset_peak`];
/// `None` unless [`installed`].
pub fn peak_bytes() -> Option<u64> {
    installed().then(|| PEAK.load(Relaxed))
}

/// Starts a new peak at what is live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}
