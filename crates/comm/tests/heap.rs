//! The counting allocator under a test binary: blocks of every alignment
//! keep it, reallocation keeps the contents and the part, and every count
//! returns to where it was when the blocks are freed.

use shardnet_comm::heap::{self, CountingAllocator, Part};
use std::alloc::{alloc, alloc_zeroed, dealloc, realloc, Layout};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator;

#[test]
fn blocks_keep_their_alignment_contents_and_part() {
    // One test: the counts are the process's, and tests run on threads.
    let _ = vec![0u8; 1];
    let before = heap::live_parts().unwrap();
    let mut blocks = Vec::with_capacity(24);
    {
        let _opt = heap::counting_as(Part::Optimizer);
        for align in [1usize, 8, 16, 32, 64, 4096] {
            for size in [1usize, 7, 100, 5000] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; freed below with the same layout.
                let p = unsafe {
                    if align == 64 {
                        alloc_zeroed(layout)
                    } else {
                        alloc(layout)
                    }
                };
                assert!(!p.is_null());
                assert_eq!(p as usize % align, 0, "align {align}");
                // SAFETY: the block holds `size` bytes.
                unsafe { std::ptr::write_bytes(p, (size % 251) as u8, size) };
                blocks.push((p, layout));
            }
        }
    }
    let held: u64 = blocks.iter().map(|(_, l)| l.size() as u64).sum();
    let during = heap::live_parts().unwrap();
    assert_eq!(during.optimizer - before.optimizer, held);
    // Grow and shrink each block: contents and part stay.
    for (p, layout) in blocks.iter_mut() {
        let n = layout.size();
        for new in [n * 3, n.div_ceil(2)] {
            // SAFETY: `p` was allocated with `layout`; `new` is non-zero.
            let q = unsafe { realloc(*p, *layout, new) };
            assert!(!q.is_null());
            assert_eq!(q as usize % layout.align(), 0);
            let kept = n.min(new).min(layout.size());
            // SAFETY: the first `kept` bytes were written and kept.
            let bytes = unsafe { std::slice::from_raw_parts(q, kept) };
            assert!(bytes.iter().all(|&b| b == (n % 251) as u8));
            *p = q;
            *layout = Layout::from_size_align(new, layout.align()).unwrap();
        }
    }
    let held: u64 = blocks.iter().map(|(_, l)| l.size() as u64).sum();
    assert_eq!(
        heap::live_parts().unwrap().optimizer - before.optimizer,
        held
    );
    assert!(heap::peak_bytes().unwrap() >= heap::live_bytes().unwrap());
    for (p, layout) in blocks {
        // SAFETY: allocated (or reallocated) with this layout.
        unsafe { dealloc(p, layout) };
    }
    assert_eq!(heap::live_parts().unwrap().optimizer, before.optimizer);
}
