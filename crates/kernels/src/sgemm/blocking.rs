//! The block sizes: how much of A, B and C each loop level holds, so that
//! A's strip stays in L1 and B's panel in L2. KC and NC are computed once
//! per process from the caches the CPU reports ([`crate::caches`]).

use crate::caches::{caches, Caches};
use std::sync::OnceLock;

/// The most k per block.
const MAX_KC: usize = 512;
/// The fewest k per block.
const MIN_KC: usize = 128;
/// The most columns per panel (the driver's strip table is sized for it).
pub const MAX_NC: usize = 512;
/// B's rows at least this many floats apart (2 KiB, a page's half) are
/// packed a panel at a time ([`super::pack_b::Panels::pack_panel`]), each
/// row read across the panel's strips; nearer rows (Winograd's chunks,
/// rows of at most 128 columns) strip by strip into the panel's buffer.
pub const FAR_ROWS: usize = 512;
/// Rows of every microkernel's tile (either level).
pub const MR: usize = 6;
/// The widest strip of B (AVX-512).
const MAX_NR: usize = 64;
/// The widest tile (AVX-512): the local tile buffer's size.
pub const MAX_TILE: usize = MR * MAX_NR;
/// The deepest strip of B read where it lies rather than packed, where
/// B's rows lie [`FAR_ROWS`] or more apart (a shallow strip's packing
/// costs a good part of its use); nearer rows are read in place at any
/// depth.
pub const IN_PLACE_MAX_K: usize = 128;

/// Rows of a strip of the A that `gemm_transposed` reads across.
pub const MR_ACROSS: usize = 6;

/// Floats a [`super::PackedA`] needs past its last strip for
/// `gemm_transposed`: a tile cut short at a block's end still reads MR
/// rows (the rows it does not store).
pub const ACROSS_SLACK: usize = MR_ACROSS * MR_ACROSS;

/// The block sizes of one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocking {
    /// k per block: the depth of every microkernel call.
    pub kc: usize,
    /// Columns of B packed together per block of k (a panel of strips).
    pub nc: usize,
}

impl Blocking {
    /// The rule, for caches `c`:
    /// - **kc**: the widest B strip (kc × 64 floats) takes at most an
    ///   eighth of L2 and A's strip (MR × kc) at most half of L1, so both
    ///   stay cached while the panel streams; capped at 512 (deeper
    ///   blocks load and store C's tiles less often, and 512 is as deep as
    ///   the strips stay in L2 on a 1 MiB L2), at least 128; a multiple
    ///   of 64.
    /// - **nc**: the panel (kc × nc floats) takes at most half of L2, in
    ///   whole strips of 64, between 64 and [`MAX_NC`].
    ///
    /// On a 32–48 KiB L1 and a 1 MiB L2: kc = 512, nc = 256.
    pub fn for_caches(c: Caches) -> Blocking {
        let f = std::mem::size_of::<f32>();
        let by_l2 = c.l2 / 8 / (MAX_NR * f);
        let by_l1 = c.l1d / 2 / (MR * f);
        let kc = (by_l2.min(by_l1).min(MAX_KC) / 64 * 64).max(MIN_KC);
        let nc = (c.l2 / 2 / (kc * f) / MAX_NR * MAX_NR).clamp(MAX_NR, MAX_NC);
        Blocking { kc, nc }
    }
}

/// This process's block sizes (from [`caches`], computed once).
pub fn blocking() -> Blocking {
    static ONCE: OnceLock<Blocking> = OnceLock::new();
    *ONCE.get_or_init(|| Blocking::for_caches(caches()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_on_the_caches_of_current_cores() {
        let kib = |l1: usize, l2: usize| Caches {
            l1d: l1 << 10,
            l2: l2 << 10,
        };
        // Zen 4 and 5, Cascade Lake: 32 or 48 KiB, 1 MiB.
        for l1 in [32, 48] {
            assert_eq!(
                Blocking::for_caches(kib(l1, 1024)),
                Blocking { kc: 512, nc: 256 }
            );
        }
        // Sapphire Rapids: a 2 MiB L2 holds a wider panel.
        assert_eq!(
            Blocking::for_caches(kib(48, 2048)),
            Blocking { kc: 512, nc: 512 }
        );
        // A 256 KiB L2 (older client cores): shallower blocks.
        assert_eq!(
            Blocking::for_caches(kib(32, 256)),
            Blocking { kc: 128, nc: 256 }
        );
        // Tiny or absurd reports stay within the bounds.
        let small = Blocking::for_caches(kib(1, 1));
        assert_eq!(small, Blocking { kc: MIN_KC, nc: 64 });
        let huge = Blocking::for_caches(kib(1 << 20, 1 << 20));
        assert_eq!(
            huge,
            Blocking {
                kc: MAX_KC,
                nc: MAX_NC
            }
        );
    }
}
