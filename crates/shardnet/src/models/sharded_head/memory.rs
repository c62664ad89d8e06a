//! The sharded classifier's memory for the planner (rank r of n, C_r
//! classes, batch B, dimension d): the shard W_r (C_r·d·4 bytes), the
//! optimizer's slots (SGD's momentum: 1; Adam: 2), its gradient only with
//! the unfused update (the fused step updates each class block as its
//! gradient is produced), and the logits B·C_r in the logits precision (4
//! or 2 bytes), held from forward to backward; Partial FC shrinks them to
//! ⌈r·C_r⌉ columns; one class block's scratch. Evaluation runs the full head
//! one class block at a time. The data-parallel backbone: its parameters
//! four times, its gradient allreduce's buffers three more, two copies of
//! each of its activations for this rank's B/n rows, and six B × d feature
//! buffers around the head.

use super::{Config, Source};
use crate::comm::chunk_range;
use crate::train::plan::{
    linear_bytes, mnist_bytes, slack, MemoryEstimate, MemoryPlan, Placement, RankMemory, Scaling,
    MNIST_EVAL_ROWS, PIXELS,
};
use candle_core::DType;
use std::fmt::Write as _;
use std::sync::Arc;

/// Classes per block of the head's kernels (each block's scratch).
const CLASS_BLOCK: f64 = crate::functions::CLASS_BLOCK as f64;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        self.command()
    }

    fn describe(&self, ranks: usize) -> String {
        let precision = match self.precision {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            _ => "f32",
        };
        let mut s = format!(
            "{} classes ({} on rank 0), d = {}, batch {}, {precision} logits",
            self.classes,
            chunk_range(self.classes, ranks, 0).len(),
            self.dim,
            self.batch_size,
        );
        if self.sample_rate < 1.0 {
            let _ = write!(s, ", Partial FC at rate {}", self.sample_rate);
        }
        if self.naive {
            s.push_str(", naive head");
        }
        s
    }

    fn rank(&self, ranks: usize, rank: usize) -> RankMemory {
        self::rank(self, ranks, rank)
    }

    fn scaling(&self, _ranks: usize) -> Scaling {
        Scaling {
            model: Arc::new(self.clone()),
            most: self.batch_size.max(1),
            limit: format!(
                "the most --batch-size {} allows: every rank needs a sample",
                self.batch_size
            ),
            hint: String::new(),
        }
    }

    fn advice(&self, placement: Placement, avail: f64) -> String {
        let c = self;
        if c.naive {
            return String::new();
        }
        let n = placement.ranks;
        let mut quiet = c.clone();
        quiet.train.evaluate = false;
        match sample_rate_that_fits(c, placement, avail) {
            Some(rate) => {
                format!(" On these {n} ranks, Partial FC with --sample-rate {rate} would fit.")
            }
            None => match (
                c.train.evaluate,
                sample_rate_that_fits(&quiet, placement, avail),
            ) {
                (true, Some(rate)) if rate == c.sample_rate => format!(
                    " On these {n} ranks it would fit with --no-eval (evaluation runs the \
                     full head)."
                ),
                (true, Some(rate)) => format!(
                    " On these {n} ranks it would fit with --no-eval (evaluation runs the \
                     full head) and Partial FC at --sample-rate {rate}."
                ),
                _ => format!(" No Partial FC sample rate fits on these {n} ranks."),
            },
        }
    }
}

/// The largest Partial FC rate, at most `c`'s own (then two significant
/// digits, rounded down), at which the head `c` fits in `available` on
/// `placement`.
fn sample_rate_that_fits(c: &Config, placement: Placement, available: f64) -> Option<f64> {
    let at = |rate: f64| {
        let mut c = c.clone();
        c.sample_rate = rate;
        MemoryPlan::new(&c, placement).fits(available)
    };
    let (mut lo, mut hi) = (1e-9, c.sample_rate);
    if at(hi) {
        return Some(hi);
    }
    if !at(lo) {
        return None;
    }
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if at(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let scale = 10f64.powi(1 - lo.log10().floor() as i32);
    let rate = (lo * scale).floor() / scale;
    (rate > 0.0 && at(rate)).then_some(rate)
}

fn rank(c: &Config, n: usize, r: usize) -> RankMemory {
    let mnist = matches!(c.source, Source::Mnist { .. });
    let input = if mnist { PIXELS } else { c.dim as f64 };
    let d = c.dim as f64;
    let b = c.batch_size as f64;
    let cr = chunk_range(c.classes, n, r).len() as f64;
    let br = chunk_range(c.batch_size, n, r).len() as f64;
    let e = if c.precision == DType::F32 { 4.0 } else { 2.0 };
    let sampled = c.sample_rate < 1.0 && !c.naive;
    // Columns of the logits block: Partial FC keeps ⌈r·C_r⌉ rows, and every
    // positive of the batch.
    let cols = if sampled {
        (c.sample_rate * cr).ceil().max(b.min(cr)).min(cr)
    } else {
        cr
    };
    let mut widths = vec![input];
    widths.extend(c.hidden.iter().map(|&w| w as f64));
    widths.push(d);
    let layers: Vec<f64> = widths
        .windows(2)
        .map(|w| linear_bytes(w[0], w[1]))
        .collect();
    let whole: f64 = layers.iter().sum();
    // Shared out over the ranks (`--shard-state gradients|parameters`): a
    // share of each weight (its gradient and optimizer state), the biases
    // whole; beside them, `gradients` keeps every weight whole through the
    // step (parameters), `parameters` gathers one layer's while it runs,
    // and a layer's whole gradient is held while it is reduce-scattered.
    let shared = c.shares_backbone() && n > 1;
    let largest = layers.iter().copied().fold(0.0, f64::max);
    let (backbone, kept, gathered) = if shared {
        let share: f64 = widths
            .windows(2)
            .map(|w| w[0] * w[1] * 4.0 / n as f64 + w[1] * 4.0)
            .sum();
        match c.shard_state {
            crate::optim::ShardState::Gradients => (share, whole, largest),
            _ => (share, 0.0, 2.0 * largest),
        }
    } else {
        // Whole, its gradients allreduced in place (MPI ranks on one node
        // sum them in a shared window: communication, below).
        (whole, 0.0, 0.0)
    };
    let shard = cr * d * 4.0;
    let p = backbone + shard;
    let eval_rows = if mnist { MNIST_EVAL_ROWS } else { b };
    // The backbone's activations, kept and their gradients; the features
    // around the head; a shared-out backbone's whole gradients and weights
    // as they move.
    let mut activations =
        br * widths.iter().sum::<f64>() * 4.0 * 2.0 + 6.0 * b * d * 4.0 + gathered;
    // One class block's scratch: its weight gradient (and, under Partial
    // FC, its gathered rows and the sample's indices); half-precision
    // logits, the block's f32 logits.
    let block = CLASS_BLOCK.min(cols.max(1.0));
    activations += block * d * 4.0;
    if sampled {
        activations += block * d * 4.0 + 8.0 * cols;
    }
    if e < 4.0 {
        activations += b.max(eval_rows) * block * 4.0;
    }
    let logits = if c.naive {
        // Each rank's logits, their transpose and gradient; rank 0 gathers
        // all B × C and runs candle's cross-entropy over them (measured ~11
        // copies).
        let own = 3.0 * b * cr * 4.0;
        own + if r == 0 {
            11.0 * b * c.classes as f64 * 4.0
        } else {
            0.0
        }
    } else {
        let train = b * cols * e;
        // Evaluation keeps one class block's logits at a time.
        let eval = if c.train.evaluate {
            eval_rows * cr.min(CLASS_BLOCK) * e
        } else {
            0.0
        };
        train.max(eval)
    };
    let (data, loading) = if mnist { mnist_bytes() } else { (0.0, 0.0) };
    // The fused step holds no gradient of the shard.
    let fused = c.fused_update && !c.naive;
    RankMemory {
        parameters: p + kept,
        gradients: if fused { backbone } else { p },
        optimizer: c.train.optimizer.slots() as f64 * p,
        activations,
        logits,
        data,
        loading,
        gather: 0.0,
        communication: if n > 1 && !shared { backbone } else { 0.0 },
        slack: slack(p, logits),
    }
}
