//! The in-layer splits' memory for the planner: each rank's layers four
//! times (value, gradient, Adam's moments), three copies of every layer's
//! input and output per example of the batch (training) or two per row of
//! an evaluation batch, whichever is more, and at the end the parameters
//! gathered whole on rank 0 for the report; rank 0 also holds MNIST.
//!
//! | split | rank r of n holds |
//! |---|---|
//! | MnistMLPParallel | parts `first`/`second` r (both on one rank): 784 → U/2 → U/2 → U and U → U/2 → U/2 → 10 |
//! | tensor | its rows of 784 → U, its columns of U → U, all of U → 10 |

use super::{Config, Split};
use crate::comm::chunk_range;
use crate::train::plan::{
    linear_bytes, mnist_bytes, slack, MemoryEstimate, RankMemory, Scaling, MNIST_EVAL_ROWS, PIXELS,
};
use std::sync::Arc;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        match self.split {
            Split::Chainer => "mnist-mlp-parallel",
            Split::Tensor => "mnist-mlp --parallel tensor",
        }
    }

    fn describe(&self, _ranks: usize) -> String {
        format!("{} units, batch {}", self.units, self.batch_size)
    }

    fn rank(&self, ranks: usize, rank: usize) -> RankMemory {
        self::rank(self, ranks, rank)
    }

    fn scaling(&self, _ranks: usize) -> Scaling {
        let (most, limit) = match self.split {
            Split::Chainer => (2, "the model has two parts".to_string()),
            Split::Tensor => (
                self.units.max(1),
                format!(
                    "one hidden unit each, the most --units {} allows",
                    self.units
                ),
            ),
        };
        Scaling {
            model: Arc::new(self.clone()),
            most,
            limit,
            hint: String::new(),
        }
    }
}

/// Rank `r` of `n`: (parameter bytes, the layers' input and output widths
/// per example) of what it holds, and of the whole model.
fn held(c: &Config, n: usize, r: usize) -> ((f64, f64), f64) {
    let u = c.units as f64;
    match c.split {
        Split::Chainer => {
            let h = (c.units / 2) as f64;
            let part = linear_bytes(PIXELS, h)
                + linear_bytes(h, h)
                + linear_bytes(h, u)
                + linear_bytes(u, h)
                + linear_bytes(h, h)
                + linear_bytes(h, 10.0);
            let widths = PIXELS + 2.0 * h + u + u + 2.0 * h + 10.0;
            let parts = if n == 1 { 2.0 } else { 1.0 };
            ((parts * part, parts * widths), 2.0 * part)
        }
        Split::Tensor => {
            let mine = chunk_range(c.units, n.max(1), r).len() as f64;
            let bytes = linear_bytes(PIXELS, mine) + (u * mine + u) * 4.0 + linear_bytes(u, 10.0);
            let widths = PIXELS + mine + u + u + 10.0;
            let whole = linear_bytes(PIXELS, u) + linear_bytes(u, u) + linear_bytes(u, 10.0);
            ((bytes, widths), whole)
        }
    }
}

fn rank(c: &Config, n: usize, r: usize) -> RankMemory {
    let ((p, widths), whole) = held(c, n, r);
    let train = c.batch_size as f64 * widths * 4.0 * 3.0;
    let eval = if c.train.evaluate {
        MNIST_EVAL_ROWS * widths * 4.0 * 2.0
    } else {
        0.0
    };
    let mut m = RankMemory {
        parameters: p,
        gradients: p,
        optimizer: c.train.optimizer.slots() as f64 * p,
        activations: train.max(eval),
        gather: p,
        ..RankMemory::default()
    };
    if r == 0 {
        m.gather = 2.0 * p + whole;
        (m.data, m.loading) = mnist_bytes();
    }
    m.slack = slack(m.parameters, m.logits);
    m
}
