//! The plan's answers to a user's two questions, from the memory model
//! alone: the largest size each split of the ranks can train
//! ([`largest_sizes`]: `shardnet plan <model> --max-size`), and the fewest
//! ranks that train a given size ([`fewest_ranks`]: `--fewest-ranks`).
//!
//! Each rank has `memory` bytes of its own (a process per rank, as under
//! `mpiexec` with a GPU or a node each): a split fits where its largest
//! rank's planned peak, with a process's baseline, is at most that. Sizes
//! are searched in the model's steps ([`Size`]): doubling, then halving
//! the interval, since no rank's memory shrinks as the model grows.

use super::plan::{MemoryPlan, Placement};
use super::run::{ModelConfig, Size};

/// A split that fits: its flags, the size searched, the largest rank's
/// bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The flags choosing the split (`--tensor-parallel 2 --pipeline 2`).
    pub split: String,
    /// The size (the largest that fits, for [`largest_sizes`]).
    pub size: f64,
    /// Its largest rank's planned peak with a process's baseline, bytes.
    pub bytes: f64,
}

/// The largest rank's planned peak with a process's baseline, bytes, on a
/// process per rank ([`MemoryPlan::largest_of`] every rank).
pub fn rank_bytes(plan: &MemoryPlan) -> f64 {
    plan.largest_of(0..plan.placement.ranks).1.max(0.0) + plan.baseline()
}

/// `cfg`'s bytes on `ranks` ranks, a process each; `None` where it does
/// not validate or has no memory model.
fn bytes_of<C: ModelConfig>(cfg: &C, ranks: usize) -> Option<f64> {
    cfg.validate(ranks).ok()?;
    Some(rank_bytes(&cfg.memory_plan(Placement::mpi(ranks, 1))?))
}

/// For every split of `cfg` over `ranks` ranks ([`ModelConfig::splits`]),
/// the largest size ([`ModelConfig::size`]) whose every rank fits in
/// `memory` bytes, or `None` where not even the smallest step fits.
/// Empty where the model has no size or no split that validates at the
/// smallest.
pub fn largest_sizes<C: ModelConfig>(
    cfg: &C,
    ranks: usize,
    memory: f64,
) -> Vec<(String, Option<Fit>)> {
    let Some(size) = cfg.size() else {
        return Vec::new();
    };
    cfg.splits(ranks)
        .into_iter()
        // A split that holds at the smallest size (the others name flags
        // that do not go together on `ranks`: more stages than blocks, …).
        .filter(|(_, c)| c.with_size(size.step).validate(ranks).is_ok())
        .map(|(split, c)| {
            let fit = largest(&c, size, ranks, memory).map(|(k, bytes)| Fit {
                split: split.clone(),
                size: k as f64 * size.step,
                bytes,
            });
            (split, fit)
        })
        .collect()
}

/// The largest k such that `cfg` at size k·step fits, with its bytes.
fn largest<C: ModelConfig>(cfg: &C, size: Size, ranks: usize, memory: f64) -> Option<(u64, f64)> {
    let fits =
        |k: u64| bytes_of(&cfg.with_size(k as f64 * size.step), ranks).filter(|&b| b <= memory);
    let mut lo = (1, fits(1)?);
    // Double until it no longer fits (or 2^40 steps: far past any memory).
    let mut hi = 2;
    while hi < 1 << 40 {
        match fits(hi) {
            Some(b) => {
                lo = (hi, b);
                hi *= 2;
            }
            None => break,
        }
    }
    while hi - lo.0 > 1 {
        let mid = lo.0 + (hi - lo.0) / 2;
        match fits(mid) {
            Some(b) => lo = (mid, b),
            None => hi = mid,
        }
    }
    Some(lo)
}

/// The fewest ranks, up to `max_ranks`, on which some split of `cfg` (at
/// its own size) fits every rank in `memory` bytes, with every split that
/// does there; `None` where no count up to `max_ranks` does.
pub fn fewest_ranks<C: ModelConfig>(
    cfg: &C,
    memory: f64,
    max_ranks: usize,
) -> Option<(usize, Vec<Fit>)> {
    let size = cfg.size().map_or(0.0, |s| s.value);
    (1..=max_ranks).find_map(|n| {
        let fits: Vec<Fit> = cfg
            .splits(n)
            .into_iter()
            .filter_map(|(split, c)| {
                let bytes = bytes_of(&c, n).filter(|&b| b <= memory)?;
                Some(Fit { split, size, bytes })
            })
            .collect();
        (!fits.is_empty()).then_some((n, fits))
    })
}

/// The divisors of `n`, ascending.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// A split's flags from (flag, ranks) pairs, leaving out those of 1 rank
/// (`--tensor-parallel 2 --pipeline 2`); `one rank` where none is left.
pub fn split_flags(parts: &[(&str, usize)]) -> String {
    let s: Vec<String> = parts
        .iter()
        .filter(|(_, n)| *n > 1)
        .map(|(f, n)| format!("{f} {n}"))
        .collect();
    if s.is_empty() {
        "one rank".into()
    } else {
        s.join(" ")
    }
}
