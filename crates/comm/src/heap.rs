//! The process's heap, counted by part: [`CountingAllocator`] wraps the
//! system allocator and keeps, for each [`Part`] of a training run, the
//! bytes live now, and the parts at the heap's peak. So a run can say what
//! it holds (parameters, gradients, optimizer state, activations, …) and
//! tell it from what the allocator keeps: peak resident memory counts the
//! process's code and the freed blocks the allocator keeps for reuse too.
//!
//! | call | returns |
//! |------|---------|
//! | [`live_bytes`] | bytes allocated and not yet freed, now |
//! | [`peak_bytes`] | the largest [`live_bytes`] since start or [`reset_peak`] |
//! | [`peak_parts`] | what each part held at that peak |
//! | [`counting_as`] | a guard: this thread's allocations count to a part until it drops |
//!
//! An allocation counts to the part its thread was [`counting_as`] when it
//! was made, until it is freed (a header before the block remembers which).
//! Where the library allocates for a part it says so: a parameter's
//! gradient buffer, an optimizer's state, a data set as it is read,
//! communication's staging copies; the training loop counts its steps as
//! activations and a model's build as parameters. Threads of the kernels'
//! pool count what they allocate as [`Part::Other`] (their small scratch).
//!
//! A program opts in with one line (the `shardnet` command does):
//!
//! ```
//! use shardnet_comm::heap::{self, CountingAllocator, Part};
//!
//! #[global_allocator]
//! static HEAP: CountingAllocator = CountingAllocator;
//!
//! let before = heap::live_bytes().unwrap();
//! let v = {
//!     let _data = heap::counting_as(Part::Data);
//!     vec![0u8; 1 << 20]
//! };
//! assert!(heap::live_bytes().unwrap() >= before + (1 << 20));
//! assert!(heap::live_parts().unwrap().data >= 1 << 20);
//! drop(v);
//! assert!(heap::peak_parts().unwrap().data >= 1 << 20);
//! assert!(heap::live_parts().unwrap().data < 1 << 20);
//! ```
//!
//! A few relaxed atomic updates and 16 bytes per allocation: nothing next
//! to the kernels' work, whose buffers are megabytes.

use serde::{Deserialize, Serialize};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// What an allocation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Part {
    /// Everything not said otherwise: the process's own, the runtime's,
    /// the kernels' scratch.
    Other = 0,
    /// Parameters (what a model's build allocates).
    Parameters = 1,
    /// Parameters' gradient buffers.
    Gradients = 2,
    /// Optimizer state (moments, momentum).
    Optimizer = 3,
    /// What a training step holds: activations kept for backward, their
    /// gradients, the batch.
    Activations = 4,
    /// Communication's staging copies.
    Communication = 5,
    /// Data sets as read.
    Data = 6,
}

const PARTS: usize = 7;

/// Bytes by [`Part`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parts {
    /// [`Part::Parameters`].
    pub parameters: u64,
    /// [`Part::Gradients`].
    pub gradients: u64,
    /// [`Part::Optimizer`].
    pub optimizer: u64,
    /// [`Part::Activations`].
    pub activations: u64,
    /// [`Part::Communication`].
    pub communication: u64,
    /// [`Part::Data`].
    pub data: u64,
    /// [`Part::Other`].
    pub other: u64,
}

impl Parts {
    fn of(counts: &[AtomicU64; PARTS]) -> Parts {
        let c = |p: Part| counts[p as usize].load(Relaxed);
        Parts {
            parameters: c(Part::Parameters),
            gradients: c(Part::Gradients),
            optimizer: c(Part::Optimizer),
            activations: c(Part::Activations),
            communication: c(Part::Communication),
            data: c(Part::Data),
            other: c(Part::Other),
        }
    }

    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.communication
            + self.data
            + self.other
    }
}

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static LIVE_PARTS: [AtomicU64; PARTS] = [const { AtomicU64::new(0) }; PARTS];
static PEAK_PARTS: [AtomicU64; PARTS] = [const { AtomicU64::new(0) }; PARTS];
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static CURRENT: Cell<u8> = const { Cell::new(Part::Other as u8) };
}

/// The header before each block: the part (in its first byte).
const HEADER: usize = 16;

/// The system allocator, counted by part (see the module doc).
pub struct CountingAllocator;

fn current() -> u8 {
    CURRENT.try_with(Cell::get).unwrap_or(Part::Other as u8)
}

/// The layout asked of the system for `layout`, and where the caller's
/// block starts in it.
fn outer(layout: Layout) -> Option<(Layout, usize)> {
    let align = layout.align().max(HEADER);
    let offset = align;
    let size = layout.size().checked_add(offset)?;
    Some((Layout::from_size_align(size, align).ok()?, offset))
}

fn grew(part: u8, bytes: usize) {
    LIVE_PARTS[part as usize].fetch_add(bytes as u64, Relaxed);
    let now = LIVE.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    if now > PEAK.fetch_max(now, Relaxed) {
        // A new peak: what each part holds now (nearly: other threads may
        // move the counts meanwhile).
        for (p, l) in PEAK_PARTS.iter().zip(&LIVE_PARTS) {
            p.store(l.load(Relaxed), Relaxed);
        }
    }
}

fn shrank(part: u8, bytes: usize) {
    LIVE_PARTS[part as usize].fetch_sub(bytes as u64, Relaxed);
    LIVE.fetch_sub(bytes as u64, Relaxed);
}

/// # Safety
/// `base` is a block of `outer(layout)` from the system allocator.
unsafe fn finish(base: *mut u8, layout: Layout, offset: usize) -> *mut u8 {
    if base.is_null() {
        return base;
    }
    if !INSTALLED.load(Relaxed) {
        INSTALLED.store(true, Relaxed);
    }
    let part = current();
    let user = base.add(offset);
    user.sub(HEADER).write(part);
    grew(part, layout.size());
    user
}

// SAFETY: every block is the system allocator's, asked for with a header
// in front that keeps the caller's alignment; dealloc and realloc find the
// system's block again from the same layout.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some((o, offset)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        finish(System.alloc(o), layout, offset)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some((o, offset)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        finish(System.alloc_zeroed(o), layout, offset)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // The layout was accepted when the block was made.
        let Some((o, offset)) = outer(layout) else {
            return;
        };
        let part = ptr.sub(HEADER).read();
        shrank(part, layout.size());
        System.dealloc(ptr.sub(offset), o);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Some((o, offset)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        let Some(total) = new_size.checked_add(offset) else {
            return std::ptr::null_mut();
        };
        let part = ptr.sub(HEADER).read();
        // The header moves with the block (it is inside what is copied).
        let base = System.realloc(ptr.sub(offset), o, total);
        if base.is_null() {
            return base;
        }
        if new_size >= layout.size() {
            grew(part, new_size - layout.size());
        } else {
            shrank(part, layout.size() - new_size);
        }
        base.add(offset)
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

/// [`live_bytes`] by part; `None` unless [`installed`].
pub fn live_parts() -> Option<Parts> {
    installed().then(|| Parts::of(&LIVE_PARTS))
}

/// The largest [`live_bytes`] since start or the last [`reset_peak`];
/// `None` unless [`installed`].
pub fn peak_bytes() -> Option<u64> {
    installed().then(|| PEAK.load(Relaxed))
}

/// What each part held when the heap was at its [`peak_bytes`]; `None`
/// unless [`installed`].
pub fn peak_parts() -> Option<Parts> {
    installed().then(|| Parts::of(&PEAK_PARTS))
}

/// Starts a new peak at what is live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
    for (p, l) in PEAK_PARTS.iter().zip(&LIVE_PARTS) {
        p.store(l.load(Relaxed), Relaxed);
    }
}

/// This thread's allocations count to `part` until the guard drops (then
/// to what they counted to before).
#[must_use = "allocations count to the part only while the guard lives"]
pub fn counting_as(part: Part) -> CountingAs {
    let before = current();
    let _ = CURRENT.try_with(|c| c.set(part as u8));
    CountingAs { before }
}

/// The guard of [`counting_as`].
pub struct CountingAs {
    before: u8,
}

impl Drop for CountingAs {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.set(self.before));
    }
}
