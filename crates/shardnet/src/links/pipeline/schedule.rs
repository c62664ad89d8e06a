//! Pipeline schedules: which pass of which micro-batch each rank runs, and
//! in what order.
//!
//! p ranks, M micro-batches, V chunks of layers per rank. Global chunk
//! c = v·p + r lives on rank r (Megatron's interleaved placement), so the
//! data go 0 → 1 → … → p−1 → 0 → … and the last chunk is on rank p−1.
//! F is a chunk's forward, B its backward (dx and dW; under zero-bubble dx
//! only) and W its deferred weight gradients.
//!
//! | schedule | order on rank r | micro-batches held on rank r | bubble, F = 1, B = 2 (W = 1 when split) |
//! |----------|-----------------|-----------------------------|-----------------------------|
//! | `gpipe` | every F, then every B | M | (p−1)/(M+p−1) |
//! | `1f1b` | p−1−r F, then one F and one B in turn, then the last B | p − r | (p−1)/(M+p−1) |
//! | `interleaved` | Megatron's: (p−r−1)·2 + (V−1)·p F over V chunks (micro-batches in groups of p), then F and B in turn | that + 1, of 1/V the size | (p−1)/(V·M+p−1) when p divides M |
//! | `zero-bubble` | B first, then F while fewer than 2(p − r) are held, else W (B is dx only; W the deferred dW) | 2(p − r) | p = 2, M = 8: 0.040 (1F1B 0.111) |
//!
//! GPipe, 1F1B and interleaved fix each rank's order up front (above); the
//! simulation (`simulate.rs`) runs those orders with the chunks' costs and reports
//! their time, bubble and memory. An interleaved order with M not a multiple
//! of p can wait in a circle (Megatron refuses such M): the simulation finds
//! that and falls back to the list scheduler's greedy order under the same
//! limit. Zero-bubble's order is made by the list scheduler itself: it
//! simulates every rank with the stage costs and each rank, when free, takes
//! by the schedule's rule the next pass whose input has arrived — a B before
//! an F, an F only while fewer micro-batches than its limit are held, a W
//! when nothing else is ready, so the weight gradients fill the time a rank
//! would wait. Either way the recorded order comes from one valid execution,
//! so it completes for any real timing (a pass only waits for passes
//! recorded before it).
//!
//! The simulation is event-driven: a rank with nothing to run sleeps until
//! an input of its next passes is due, and is woken when the pass making
//! it is scheduled, so a plan costs O(M·V·p·log p) — 2 s for 1000 ranks
//! and 1000 micro-batches — and a plan (`plan.rs`) is made once: every
//! rank, and the memory plan for each rank, share it.
//!
//! Every schedule runs each chunk's backward passes in ascending
//! micro-batch order, so the weight gradients sum in the same order and
//! every schedule trains bit-identical parameters.

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// A pipeline schedule (`--schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Every forward, then every backward (GPipe).
    GPipe,
    /// One forward, one backward (PipeDream-Flush): at most p − r
    /// micro-batches' activations on rank r.
    OneFOneB,
    /// 1F1B over V non-adjacent chunks per rank (Megatron-LM).
    Interleaved,
    /// 1F1B with each backward split into its input- and weight-gradient
    /// parts; the weight gradients fill the time ranks would wait (in the
    /// spirit of ZB-H1, with up to 2(p − r) micro-batches held).
    ZeroBubble,
}

impl Schedule {
    /// Every schedule, by name.
    pub const ALL: [Schedule; 4] = [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved,
        Schedule::ZeroBubble,
    ];

    /// The flag's word for it.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZeroBubble => "zero-bubble",
        }
    }

    /// Whether its backward leaves the weight gradients to a W pass.
    pub fn splits_backward(self) -> bool {
        self == Schedule::ZeroBubble
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Schedule {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Schedule::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "--schedule {s}: give one of gpipe, 1f1b, interleaved, zero-bubble"
                ))
            })
    }
}

/// A pass of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    F,
    /// Backward (input gradient; also the weight gradients unless the
    /// schedule splits them off).
    B,
    /// The deferred weight gradients.
    W,
}

/// One thing a rank does: a pass of its chunk `chunk` (0..V, its own
/// numbering) on micro-batch `micro_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// F, B or W.
    pub pass: Pass,
    /// This rank's chunk v (global chunk v·p + r).
    pub chunk: usize,
    /// The micro-batch.
    pub micro_batch: usize,
}

/// The time each pass of each global chunk takes in the simulation (any
/// unit). `backward` is the whole backward; a split schedule runs
/// `backward − weight` in B and `weight` in W.
#[derive(Clone, Debug)]
pub struct Costs {
    /// F per global chunk.
    pub forward: Vec<f64>,
    /// B (dx and dW) per global chunk.
    pub backward: Vec<f64>,
    /// The dW part of `backward` per global chunk.
    pub weight: Vec<f64>,
}

impl Costs {
    /// F = 1, B = 2 with W = 1 for every one of `chunks` chunks.
    pub fn uniform(chunks: usize) -> Self {
        Costs {
            forward: vec![1.0; chunks],
            backward: vec![2.0; chunks],
            weight: vec![1.0; chunks],
        }
    }
}

impl Costs {
    /// Every cost's bits, in order.
    pub(super) fn bits(&self) -> Vec<u64> {
        [&self.forward, &self.backward, &self.weight]
            .into_iter()
            .flatten()
            .map(|x| x.to_bits())
            .collect()
    }
}

/// What the simulation found.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// When the last pass ends.
    pub makespan: f64,
    /// Time each rank computes.
    pub busy: Vec<f64>,
    /// Per rank, the most (chunk, micro-batch) pairs whose activations are
    /// held at once (from F until B, or until W when split).
    pub peak_held: Vec<usize>,
}

impl Timeline {
    /// The fraction of the ranks' time spent waiting: 1 − Σ busy / (p ·
    /// makespan).
    pub fn bubble(&self) -> f64 {
        let p = self.busy.len() as f64;
        if self.makespan <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<f64>() / (p * self.makespan)
    }
}
