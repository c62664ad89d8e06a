//! The MLP's memory for the planner: each rank's layers four times (value,
//! gradient, moments), three copies of the activations, and at the end the
//! parameters gathered on rank 0 for the report (its own twice, everyone's
//! once, the largest rank's bytes once more; every other rank its own
//! once); rank 0 also holds MNIST.

use super::Config;
use crate::comm::chunk_range;
use crate::train::plan::{
    linear_bytes, mnist_bytes, slack, MemoryEstimate, RankMemory, Scaling, MNIST_EVAL_ROWS, PIXELS,
};
use std::sync::Arc;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        "mnist-mlp"
    }

    fn describe(&self, ranks: usize) -> String {
        format!(
            "{} units, {} stages, batch {}",
            self.units,
            self.stages_on(ranks),
            self.batch_size
        )
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

fn rank(c: &Config, n: usize, r: usize) -> RankMemory {
    let stages = c.stages_on(n);
    let u = c.units as f64;
    let b = c.batch_size as f64;
    // Parameter bytes and output widths of the layers of stages a..a+k.
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
    let mine = chunk_range(stages, n, r);
    let (a, k) = (mine.start, mine.len());
    let (p, outs, input) = run(a, k);
    let mut m = RankMemory {
        parameters: p,
        gradients: p,
        optimizer: c.train.optimizer.slots() as f64 * p,
        ..RankMemory::default()
    };
    if k > 0 {
        let train = b * (input + outs) * 4.0 * 3.0;
        let eval = if c.train.evaluate {
            MNIST_EVAL_ROWS * (input + outs) * 4.0 * 2.0
        } else {
            0.0
        };
        m.activations = train.max(eval);
    }
    // The report: rank 0 gathers every rank's parameters.
    m.gather = p;
    if r == 0 {
        let (total, _, _) = run(0, stages);
        let largest = [0, 1.min(n - 1), n - 1]
            .into_iter()
            .map(|q| {
                let theirs = chunk_range(stages, n, q);
                let (a, k) = (theirs.start, theirs.len());
                run(a, k).0
            })
            .fold(0.0, f64::max);
        m.gather = 2.0 * p + total + largest;
        (m.data, m.loading) = mnist_bytes();
    }
    m.slack = slack(m.parameters, m.logits);
    m
}
