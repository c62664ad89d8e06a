//! The MLP's memory for the planner: each rank's layers four times (value,
//! gradient, moments), three copies of the activations of the micro-batches
//! its schedule holds at once (walked along the rank's passes: + a chunk's
//! micro-batch at F, − at B, or at W when the backward is split), and at
//! the end the parameters gathered on rank 0 for the report (its own twice,
//! everyone's once, the largest rank's bytes once more; every other rank
//! its own once); rank 0 also holds MNIST.

use super::Config;
use crate::comm::{chunk_range, chunk_sizes};
use crate::links::Pass;
use crate::optim::ShardState;
use crate::train::plan::{
    linear_bytes, mnist_bytes, slack, MemoryEstimate, RankMemory, Scaling, MNIST_EVAL_ROWS, PIXELS,
};
use std::sync::Arc;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        "mnist-mlp"
    }

    fn describe(&self, ranks: usize) -> String {
        let mut s = format!(
            "{} units, {} stages, batch {}",
            self.units,
            self.stages_on(ranks),
            self.batch_size
        );
        if self.micro_batches > 1 && ranks > 1 {
            let v = self.virtual_stages_on(ranks);
            s.push_str(&format!(
                ", {} micro-batches, schedule {}{}",
                self.micro_batches,
                self.schedule_on(ranks),
                if v > 1 {
                    format!(" ({v} chunks per rank)")
                } else {
                    String::new()
                }
            ));
            if let Ok(plan) = self.pipeline_plan(ranks) {
                s.push_str(&format!(
                    ", expected bubble {:.1}% (estimated stage costs)",
                    100.0 * plan.timeline.bubble()
                ));
            }
        }
        s
    }

    fn rank(&self, ranks: usize, rank: usize) -> RankMemory {
        self::rank(self, ranks, rank)
    }

    fn scaling(&self, ranks: usize) -> Scaling {
        // The same model: its stage count fixed.
        let stages = self.stages_on(ranks);
        let mut c = self.clone();
        c.stages = Some(stages);
        Scaling {
            model: Arc::new(c),
            most: stages.max(1),
            limit: format!("one stage each, the most --stages {stages} allows"),
            hint: format!(", --stages {stages}"),
        }
    }
}

fn rank(c: &Config, ranks: usize, rank: usize) -> RankMemory {
    // One pipeline of n ranks per group; this rank is its rank r.
    let (groups, n) = c.grid(ranks).unwrap_or((1, ranks));
    let (world_rank, r) = (rank, rank % n);
    let stages = c.stages_on(n);
    let u = c.units as f64;
    let batch = chunk_range(c.batch_size, groups, rank / n).len();
    let b = batch as f64;
    // Parameter bytes, output widths and input width of stages a..a+k.
    let run = |a: usize, k: usize| -> (f64, f64, f64) {
        if k == 0 {
            return (0.0, 0.0, 0.0);
        }
        let last = a + k == stages;
        let first_in = if a == 0 { PIXELS } else { u };
        let mut bytes = linear_bytes(first_in, u) + (k - 1) as f64 * linear_bytes(u, u);
        let mut outs = k as f64 * u;
        if last {
            bytes += linear_bytes(u, 10.0);
            outs += 10.0;
        }
        (bytes, outs, first_in)
    };
    // The chunks (an invalid split is refused before the plan is read).
    let chunks = c
        .chunks_on(n)
        .unwrap_or_else(|_| (0..n).map(|q| chunk_range(stages, n, q)).collect());
    let mine: Vec<(f64, f64, f64)> = (r..chunks.len())
        .step_by(n)
        .map(|ch| run(chunks[ch].start, chunks[ch].len()))
        .collect();
    let p: f64 = mine.iter().map(|x| x.0).sum();
    let g = groups as f64;
    // What a sharded layer of i inputs and o outputs holds whole while it
    // runs: its weight, or, fully sharded and shared out by rows (o ≥ i),
    // a block of it (`--gather-block-mib`: the rounds of
    // `Linear::with_gather_block`).
    let held = |i: f64, o: f64| {
        let bytes = linear_bytes(i, o);
        let blocks = c.shard_state == ShardState::Parameters && o >= i && c.gather_block > 0;
        if !blocks {
            return bytes;
        }
        let rounds = (bytes / c.gather_block as f64)
            .ceil()
            .min((o / g).ceil())
            .max(1.0);
        bytes / rounds
    };
    // The largest of those: a layer's weight and its gradient while it runs.
    let largest_layer = mine
        .iter()
        .map(|&(_, outs, first_in)| {
            // Two or more hidden layers hold a U × U one.
            let square = if outs >= 2.0 * u { held(u, u) } else { 0.0 };
            held(first_in, u).max(square).max(held(u, 10.0))
        })
        .fold(0.0, f64::max);
    // Parameters held, their gradients and the optimizer's state: whole;
    // the state's rows each group updates (`Optimizer::shard_state`); or a
    // share of every weight's gradient and state (and, fully sharded, of
    // the weight), the biases whole beside them.
    let (params, grads, state, gathered) = match c.shard_state {
        _ if groups == 1 => (p, p, p, 0.0),
        ShardState::None => (p, p, p, 0.0),
        ShardState::Optimizer => (p, p, p / g, 0.0),
        // The shares, and the weights gathered whole beside them; a
        // layer's whole gradient while its backward runs.
        ShardState::Gradients => (p + p / g, p / g + largest_layer, p / g, 0.0),
        // A layer's weight (or a block of it) while it runs, its gradient
        // (or the block's) beside it in backward.
        ShardState::Parameters => (p / g, p / g + largest_layer, p / g, largest_layer),
    };
    let mut m = RankMemory {
        parameters: params,
        gradients: grads,
        optimizer: c.train.optimizer.slots() as f64 * state,
        // With data parallelism one more gradient-sized buffer: the window
        // MPI ranks on one node sum the gradients in.
        communication: if groups > 1 { params } else { 0.0 },
        ..RankMemory::default()
    };
    if !mine.is_empty() {
        // Three copies of a chunk's inputs and outputs per example held.
        let per_example = |v: usize| (mine[v].2 + mine[v].1) * 4.0 * 3.0;
        let rows = chunk_sizes(batch, c.micro_batches.clamp(1, batch.max(1)));
        // A backward's gradients at its widest layer: dL/dy and dL/dx of
        // one micro-batch, beside what is held.
        let layer_io = |v: usize| {
            let (_, outs, first_in) = mine[v];
            let square = if outs >= 2.0 * u { 2.0 * u } else { 0.0 };
            (first_in + u).max(square) * 4.0
        };
        let train = match c.pipeline_plan(n) {
            Ok(plan) => {
                let split = plan.schedule.splits_backward();
                let (mut now, mut peak) = (0.0f64, 0.0f64);
                for a in &plan.actions[r] {
                    let rows = rows[a.micro_batch] as f64;
                    let bytes = rows * per_example(a.chunk);
                    if a.pass == Pass::B {
                        peak = peak.max(now + rows * layer_io(a.chunk));
                    }
                    match a.pass {
                        Pass::F => now += bytes,
                        Pass::B if !split => now -= bytes,
                        Pass::W => now -= bytes,
                        Pass::B => {}
                    }
                    peak = peak.max(now);
                }
                peak
            }
            Err(_) => (0..mine.len()).map(|v| b * per_example(v)).sum(),
        };
        let widest = (0..mine.len())
            .map(|v| mine[v].2 + mine[v].1)
            .fold(0.0, f64::max);
        let eval = if c.train.evaluate {
            MNIST_EVAL_ROWS * widest * 4.0 * 2.0
        } else {
            0.0
        };
        m.activations = train.max(eval) + gathered;
    }
    // The report: rank 0 gathers every rank's parameters.
    m.gather = params;
    if world_rank == 0 {
        let (total, _, _) = run(0, stages);
        let bytes_of = |q: usize| -> f64 {
            (q..chunks.len())
                .step_by(n)
                .map(|ch| run(chunks[ch].start, chunks[ch].len()).0)
                .sum()
        };
        let largest = [0, 1.min(n - 1), n - 1]
            .into_iter()
            .map(bytes_of)
            .fold(0.0, f64::max);
        // After the last step: the step's activations are free again.
        m.gather = (2.0 * p + total + largest - m.activations).max(0.0);
        (m.data, m.loading) = mnist_bytes();
    }
    m.slack = slack(m.parameters, m.logits);
    m
}
