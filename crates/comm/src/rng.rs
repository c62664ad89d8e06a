//! Seeded random streams: the one home of the generator every seeded thing
//! in shardnet draws from (initialisers, dropout masks, shuffles, synthetic
//! data, Partial FC's class samples).
//!
//! A stream is a `u64` state advanced by [`splitmix64`]; what keys the state
//! (a layer, a row's global index, a step) is each caller's choice, so the
//! same key gives the same numbers on any rank.

/// A splitmix64 step: a fast, well-mixed sequence from a seed.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The next value of a splitmix64 stream, uniform in [−1, 1).
pub fn unit(state: &mut u64) -> f64 {
    (splitmix64(state) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// Shuffle `v` in place (Fisher–Yates), determined by `seed`.
pub fn shuffle(v: &mut [usize], seed: u64) {
    let mut s = seed;
    for i in (1..v.len()).rev() {
        let j = (splitmix64(&mut s) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}
