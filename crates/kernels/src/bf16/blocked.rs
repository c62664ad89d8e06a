//! The blocked GEMM both bf16 kernels run ([`blocked`]): the panel and
//! block loops; each kernel a [`Tiles`] (its sizes, A's packing and its
//! microkernel).

use super::input::Input;
use super::pack::pack;
use crate::Operand;

/// One bf16 kernel's tiles, for [`blocked`]: the sizes of its blocks, how
/// its A panel is packed and its microkernel. B is always packed by
/// [`pack`] in strips of `NR` columns with `pairs(kc)` k pairs each.
#[cfg(target_arch = "x86_64")]
pub(super) trait Tiles {
    /// Rows and columns of the microkernel's block of C (MR·NR ≤ 1024).
    const MR: usize;
    const NR: usize;
    /// k per panel, rows per A block, columns per B panel.
    const KC: usize;
    const MC: usize;
    const NC: usize;
    /// k pairs per strip for a panel of `kc` (at least ⌈kc/2⌉).
    fn pairs(kc: usize) -> usize;
    /// Pack rows 0..m of A, k `k0 .. k0 + kc`, into strips of `MR` rows
    /// of `kps` pairs each (`MR·kps` words a strip).
    fn pack_a<E: Input>(
        a: Operand<'_, E>,
        m: usize,
        k: (usize, usize, usize),
        out: &mut [u32],
        tmp: &mut Vec<u16>,
    );
    /// Called before each microkernel (a prefetch hook).
    fn before_tile() {}
    /// C (+)= A strip · B strip for one MR × NR block at `c`, `rs` floats
    /// between rows.
    ///
    /// # Safety
    /// The CPU runs the kernel; `a` holds MR·kps and `b` kps·NR words; MR
    /// rows of NR floats at `c`, `rs` apart, are writable.
    unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool);
}

/// The blocked GEMM shared by the bf16 kernels (the caller checked the
/// CPU and k > 0): A packed once per k panel, B once per column panel, a
/// microkernel per MR × NR block of C, straight into dst where the block
/// is whole and row-major, through a local block at the edges.
#[cfg(target_arch = "x86_64")]
pub(super) fn blocked<T: Tiles, A: Input, B: Input>(
    (m, n, k): (usize, usize, usize),
    (dst, drs, dcs): (&mut [f32], usize, usize),
    accumulate: bool,
    (a, ars, acs): Operand<'_, A>,
    (b, brs, bcs): Operand<'_, B>,
) {
    // The panels, kept by the thread from call to call (a head step makes
    // three calls per class block: fresh buffers would be zeroed and
    // faulted in every time).
    thread_local! {
        static PANELS: std::cell::RefCell<(Vec<u32>, Vec<u32>, Vec<u16>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    }
    const { assert!(T::MR * T::NR <= EDGE) };
    let (mr, nr) = (T::MR, T::NR);
    PANELS.with(|p| {
        let mut guard = p.borrow_mut();
        let (ap, bp, tmp) = &mut *guard;
        for pc in (0..k).step_by(T::KC) {
            let kc = T::KC.min(k - pc);
            let kps = T::pairs(kc);
            // Grown to the largest shape seen; the packers overwrite (or
            // zero-fill) what they use.
            ap.resize(ap.len().max(m.div_ceil(mr) * mr * kps), 0);
            bp.resize(bp.len().max(T::NC.div_ceil(nr) * nr * kps), 0);
            T::pack_a((a, ars, acs), m, (pc, kc, kps), ap, tmp);
            let add = accumulate || pc > 0;
            for jc in (0..n).step_by(T::NC) {
                let nc = T::NC.min(n - jc);
                // B (k, n) as rows of n along k: element (j, kk) at kk·brs + j·bcs.
                pack((b, bcs, brs), jc, nc, nr, (pc, kc, kps), bp, tmp);
                for ic in (0..m).step_by(T::MC) {
                    let mc = T::MC.min(m - ic);
                    for (sj, j0) in (0..nc).step_by(nr).enumerate() {
                        let cols = nr.min(nc - j0);
                        let bs = &bp[sj * kps * nr..(sj + 1) * kps * nr];
                        for i0 in (ic..ic + mc).step_by(mr) {
                            let rows = mr.min(m - i0);
                            let si = i0 / mr;
                            let as_ = &ap[si * mr * kps..(si + 1) * mr * kps];
                            let (r0, c0) = (i0, jc + j0);
                            let last = (r0 + rows - 1) * drs + (c0 + cols - 1) * dcs;
                            T::before_tile();
                            if dcs == 1 && rows == mr && cols == nr && last < dst.len() {
                                // SAFETY: the caller checked the CPU; the
                                // strips hold MR·kps and kps·NR words; the MR
                                // rows of NR floats at r0·drs + c0 lie in dst
                                // (checked: `last`).
                                unsafe {
                                    T::micro(
                                        kps,
                                        as_,
                                        bs,
                                        dst.as_mut_ptr().add(r0 * drs + c0),
                                        drs,
                                        add,
                                    )
                                };
                                continue;
                            }
                            let mut block = [0f32; EDGE];
                            // SAFETY: as above, into a local block of MR
                            // rows of NR floats (MR·NR ≤ EDGE, asserted).
                            unsafe { T::micro(kps, as_, bs, block.as_mut_ptr(), nr, false) };
                            for r in 0..rows {
                                let base = (r0 + r) * drs + c0 * dcs;
                                for (c, v) in block[r * nr..][..cols].iter().enumerate() {
                                    let d = &mut dst[base + c * dcs];
                                    *d = if add { *d + v } else { *v };
                                }
                            }
                        }
                    }
                }
            }
        }
    })
}

/// The largest MR·NR of a [`Tiles`] (its edge blocks are computed aside).
#[cfg(target_arch = "x86_64")]
const EDGE: usize = 32 * 32;
