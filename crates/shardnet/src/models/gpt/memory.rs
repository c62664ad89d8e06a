//! The GPT's memory for the planner. Rank r = (g·p + s)·t + j holds stage
//! s's blocks split j of t ways, and of each (chunk, micro-batch) the
//! schedule keeps in flight, the activations of its blocks on the
//! micro-batch's b·T tokens (b = B/(d·M) windows).
//!
//! Per token and block, in floats (counted from what the layers keep for
//! backward): 12·D split over the group (q, k, v, attention's output, the
//! MLP's 4D hidden before and after GELU) and 6·D for the block's input,
//! the residual between its halves, the layer norms' outputs and the two
//! branches' outputs: whole on every rank of a group; under sequence
//! parallelism this rank's positions only (the regions' fused
//! entries keep their input before the allgather, their exits the layer's
//! input, not the partial sums: [`crate::links::enter_linear`]). Dropout
//! keeps 4·D more (each branch's biased output and its dropped copy).
//! `--recompute full` keeps D per block (its
//! input) and one block's activations while its backward runs. Beside the
//! blocks: the embeddings' outputs on the first stage (3·D per token), the
//! head's B·T × V_j logits and probabilities on the last, the backward's
//! gradients of one block more, each parameter's gradient and the
//! optimizer's slots (not shared out over the replicas), the corpus as u32
//! tokens (every process reads it, once for its thread ranks; counted as
//! bytes, BPE's fewer tokens aside) and the allocator's slack.

use super::Config;
use crate::comm::chunk_range;
use crate::links::Plan;
use crate::train::plan::{slack, MemoryEstimate, RankMemory, Scaling};
use std::sync::Arc;

/// Floats per token and block split over the tensor-parallel group.
const SPLIT: f64 = 12.0;
/// Floats per token and block outside the regions on one rank (the
/// module doc says which).
const OUTSIDE: f64 = 6.0;
/// What dropout adds to [`OUTSIDE`].
const DROPOUT: f64 = 4.0;
/// The corpus's bytes per process: Debian's fortunes, 2.8 MB of text, as
/// u32 tokens (a `--corpus` is counted at this size too).
const CORPUS: f64 = 2.8e6 * 4.0;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        "gpt"
    }

    /// Every process reads the corpus; its thread ranks share the tokens
    /// (`Text::shared_tokens`).
    fn data_per_process(&self) -> bool {
        true
    }

    fn describe(&self, ranks: usize) -> String {
        let (d, p, t) = self.grid(ranks).unwrap_or((1, 1, 1));
        format!(
            "L = {}, D = {}, H = {}, T = {}, batch {}, t = {t}{}, p = {p} ({} micro-batches, {:?}), \
             d = {d}, recompute {:?}",
            self.layers,
            self.dim,
            self.heads,
            self.seq,
            self.batch_size,
            if self.sequence_parallel {
                " (sequence parallel)"
            } else {
                ""
            },
            self.micro_batches,
            self.schedule(),
            self.recompute
        )
    }

    fn rank(&self, ranks: usize, rank: usize) -> RankMemory {
        self::rank(self, ranks, rank)
    }

    fn scaling(&self, ranks: usize) -> Scaling {
        let (d, p, t) = self.grid(ranks).unwrap_or((1, 1, 1));
        Scaling {
            model: Arc::new(self.clone()),
            most: ranks.max(t * p * d),
            limit: "the grid's ranks (give other --tensor-parallel, --pipeline or \
                    --data-parallel factors)"
                .into(),
            hint: String::new(),
        }
    }
}

/// Rank `r` of `n`.
fn rank(c: &Config, n: usize, r: usize) -> RankMemory {
    let Ok((d, p, t)) = c.grid(n) else {
        return RankMemory::default();
    };
    let (j, s) = (r % t, (r / t) % p);
    let dim = c.dim as f64;
    let heads = chunk_range(c.heads, t, j).len() as f64;
    let width = heads * (c.dim / c.heads.max(1)) as f64;
    let hidden = chunk_range(4 * c.dim, t, j).len() as f64;
    let vocab = chunk_range(c.vocab(), t, j).len() as f64;
    // A block's floats on this rank: the layer norms (4D), q, k, v and
    // their biases, the attention's output projection (its bias whole),
    // the MLP.
    let block = 4.0 * dim
        + 3.0 * (dim * width + width)
        + width * dim
        + dim
        + dim * hidden
        + hidden
        + hidden * dim
        + dim;
    let chunks = c.chunks().unwrap_or_default();
    let v = c.virtual_stages().max(1);
    let mine: Vec<&std::ops::Range<usize>> =
        chunks.iter().skip(s).step_by(p.max(1)).take(v).collect();
    let blocks: usize = mine.iter().map(|r| r.len()).sum();
    let largest_chunk = mine.iter().map(|r| r.len()).max().unwrap_or(0) as f64;
    let (first, last) = (s == 0, s + 1 == p);
    let mut params = blocks as f64 * block;
    if first {
        params += vocab * dim + c.seq as f64 * dim;
    }
    if last {
        params += 2.0 * dim + if first { 0.0 } else { vocab * dim };
    }
    let params = params * 4.0;
    // What a replica holds of the parameters (and so of their gradients)
    // and of the optimizer's state, and one block whole while it runs:
    // - ZeRO stage 1: its rows of each parameter's state, but for the
    //   row-parallel weights of t > 1 (sharded along their inputs), whose
    //   state stays whole;
    // - fully sharded blocks (ZeRO stage 3): its shares of the blocks'
    //   parameters, gradients and state, and one block whole while it
    //   runs: its parameters gathered (counted with the step's buffers)
    //   and, in backward, its gradients, written back to front while the
    //   activations' gradients come and go (about half of them at the
    //   peak; the other half's room counted with the step's buffers).
    let (params, state, whole_block) = match c.shard_state {
        crate::optim::ShardState::Optimizer if d > 1 => {
            let whole = if t > 1 {
                blocks as f64 * (width * dim + hidden * dim) * 4.0
            } else {
                0.0
            };
            (params, (params - whole) / d as f64 + whole, 0.0)
        }
        crate::optim::ShardState::Parameters if d > 1 => {
            let blocks_bytes = blocks as f64 * block * 4.0;
            let held = params - blocks_bytes + blocks_bytes / d as f64;
            (held, held, block * 4.0)
        }
        _ => (params, params, 0.0),
    };

    // Tokens of one micro-batch on this replica.
    let windows = chunk_range(c.batch_size, d, 0).len();
    let tokens = chunk_range(windows, c.micro_batches.max(1), 0).len() as f64 * c.seq as f64;
    // Outside the regions: whole, or this rank's positions.
    let mut outside = OUTSIDE + if c.dropout > 0.0 { DROPOUT } else { 0.0 };
    if t > 1 && c.sequence_parallel {
        outside *= chunk_range(c.seq, t, j).len() as f64 / c.seq.max(1) as f64;
    }
    let per_block = tokens * dim * (SPLIT * width / dim.max(1.0) + outside) * 4.0;
    // The (chunk, micro-batch) pairs this stage holds at its peak.
    let held = Plan::new(c.schedule(), p, c.micro_batches, v, &c.costs(&chunks))
        .ok()
        .and_then(|plan| plan.timeline.peak_held.get(s).copied())
        .unwrap_or(c.micro_batches) as f64;
    let kept = match c.recompute {
        super::Recompute::Full => held * largest_chunk * tokens * dim * 4.0 + per_block,
        _ => held * largest_chunk * per_block,
    };
    let mut act = kept + per_block + 1.5 * whole_block;
    if first {
        act += held * tokens * 3.0 * dim * 4.0;
    }
    let mut logits = 0.0;
    if last {
        act += held * tokens * 2.0 * dim * 4.0;
        logits = 2.0 * tokens * vocab * 4.0;
    }
    let mut m = RankMemory {
        parameters: params,
        gradients: params + 0.5 * whole_block,
        optimizer: c.train.optimizer.slots() as f64 * state,
        activations: act,
        logits,
        data: CORPUS,
        ..RankMemory::default()
    };
    m.slack = slack(m.parameters, m.logits);
    m
}
