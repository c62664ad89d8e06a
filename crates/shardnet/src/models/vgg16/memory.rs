//! VGG16's memory for the planner (rank r, its group's share b of the
//! batch): the rank's convolution weights (its chunk for `output`/`input`,
//! its group's for `grouped`), batch norms and the classifier twice, and
//! the optimizer's state of them (Adam's twice, SGD's once) shared out over
//! the data-parallel groups (but for the input split's weights), or a 1/G
//! share of each convolution's gradient and state (and, fully sharded, of
//! its weight) and the largest gradient (and weight) whole while its layer
//! runs;
//! per image, each convolution's output, batch norm's, ReLU's and the
//! pooled tensor (on the rank's channels for the exact splits, plus the
//! output split's gathered copy), the backward's gradients at the
//! largest layer (1.5 times its input and output; 2.5 times with the
//! output split, whose whole dx is allreduced); two im2col buffers; the Winograd
//! layers' packed U (16/9 of their weights) held from each forward to its
//! backward; rank 0 holds the images (f32). Measured (width 0.5, batch 64,
//! 2 thread ranks; `tests/plan.rs`): each part within 8% of what the heap
//! held of it at its peak, and the whole 1.06× the process's peak with the
//! output split, 1.12× with the input split, 1.14× with 2 data-parallel
//! groups, 1.11× on 1 rank (every kept activation counted at once).

use super::{Config, ImageSet};
use crate::comm::chunk_range;
use crate::optim::ShardState;
use crate::train::plan::{
    mnist_bytes, MemoryEstimate, RankMemory, Scaling, MNIST_TEST, MNIST_TRAIN,
};
use std::sync::Arc;

impl MemoryEstimate for Config {
    fn name(&self) -> &'static str {
        "vgg16"
    }

    fn describe(&self, _ranks: usize) -> String {
        format!(
            "width {}, --parallel-conv {}, batch {} in {} group(s)",
            self.width, self.split, self.batch_size, self.data_parallel
        )
    }

    fn rank(&self, ranks: usize, rank: usize) -> RankMemory {
        self::rank(self, ranks, rank)
    }

    fn scaling(&self, _ranks: usize) -> Scaling {
        Scaling {
            model: Arc::new(self.clone()),
            most: self.scaled(64) * self.data_parallel.max(1),
            limit:
                "one channel each at the narrowest layer; give a smaller --batch-size or --width"
                    .into(),
            hint: String::new(),
        }
    }
}

/// VGG16 on rank `r` of `n`: G groups of P = n/G ranks, this rank at
/// position p of its group with chunk g of the batch.
fn rank(c: &Config, n: usize, r: usize) -> RankMemory {
    use crate::links::ChannelSplit as S;
    let groups = c.data_parallel.max(1);
    let p_n = (n / groups).max(1);
    let (p, g) = (r % p_n, (r / p_n).min(groups - 1));
    let b = chunk_range(c.batch_size, groups, g).len() as f64;
    let own = |ch: usize| chunk_range(ch, p_n, p).len() as f64;
    let (mut params, mut act, mut largest) = (0.0, 0.0, 0.0f64);
    let mut along_inputs = 0.0f64;
    let mut conv_weights = 0.0f64;
    let (mut largest_weight, mut largest_col) = (0.0f64, 0.0f64);
    // The U (16/9 of the 3 × 3 weights) that the Winograd path keeps from
    // forward to backward: layers of its fewest channels in or more on images of
    // 4 × 4 or more (2 × 2 images take the dense path).
    let mut kept_u = 0.0f64;
    let mut cin = c.dataset.channels();
    let mut side = 32.0f64;
    let convs: Vec<usize> = super::VGG16.to_vec();
    for (at, &w) in convs.iter().enumerate() {
        if w == 0 {
            continue;
        }
        let cout = c.scaled(w);
        let pooled = convs.get(at + 1) == Some(&0);
        let area = side * side;
        let (fo, fi) = (cout as f64, cin as f64);
        let weights = match c.split {
            S::None => fo * fi,
            S::Grouped => own(cout) * ((cin + p_n - 1 - p) / p_n) as f64,
            S::Output => own(cout) * fi,
            S::Input => fo * own(cin),
        } * 9.0;
        let norm = if c.batch_norm { 2.0 } else { 1.0 };
        let channels_here = match c.split {
            S::Output | S::Input => own(cout),
            _ => fo,
        };
        params += weights + norm * channels_here;
        conv_weights += weights;
        if c.split == S::Input {
            // Shards along the input channels: their optimizer state is
            // not shared out over the groups.
            along_inputs += weights;
        }
        largest_weight = largest_weight.max(weights);
        if cin >= crate::nn::WINOGRAD_MIN_CHANNELS && side >= 4.0 {
            kept_u += weights / 9.0 * 16.0;
        }
        // One chunk's im2col matrix: C·9 rows, ≥ 256 columns of pixels.
        let col = fi * 9.0 * area.max(crate::nn::MIN_COLUMNS as f64) * 4.0;
        largest_col = largest_col.max(col.min(crate::nn::MAX_COL_BYTES as f64));
        // Kept for backward, per image (floats): the convolution's output,
        // the fused batch norm + ReLU's (or ReLU's alone), the pooled
        // tensor, and what the split adds (the output split's gathered
        // copy; the input split's partial sums are freed as soon as they
        // are reduce-scattered). Batch norm, ReLU and pooling
        // in one op write no activation before the pooling.
        let post = if pooled { 0.25 } else { 1.0 };
        let per = if pooled && c.batch_norm {
            1.0 + post
        } else {
            2.0 + post
        };
        let kept = match c.split {
            S::None => fo * area * per,
            S::Grouped => own(cout) * area + fo * area * per + own(cin) * area,
            S::Output => own(cout) * area * per + fo * area * post,
            S::Input => own(cout) * area * per,
        };
        act += kept;
        // The backward's gradients at a layer: dy and dx (the input
        // split's dx on its own channels), and for the output split the
        // whole dx's allreduce beside them.
        largest = largest.max(match c.split {
            S::Input => (fo + own(cin)) * area * 1.5,
            S::Output => (fo + fi) * area * 2.5,
            _ => (fo + fi) * area * 1.5,
        });
        if pooled {
            side /= 2.0;
        }
        cin = cout;
    }
    let hidden = c.scaled(512) as f64;
    params += cin as f64 * hidden + hidden + hidden * 10.0 + 10.0;
    let g = groups as f64;
    let fsdp = groups > 1 && c.shard_state == ShardState::Parameters;
    let zero2 = groups > 1 && c.shard_state == ShardState::Gradients;
    // Parameters held, their gradients and the optimizer's state: whole;
    // the state's rows each group updates (`Optimizer::shard_state`), but
    // for the shards along the inputs; or a share of each convolution's
    // gradient and state (and, fully sharded, of its weight).
    let shares = params - conv_weights + conv_weights / g;
    let (params, grads, state) = match c.shard_state {
        _ if groups == 1 => (params, params, params),
        ShardState::None => (params, params, params),
        ShardState::Optimizer => (params, params, (params - along_inputs) / g + along_inputs),
        // The shares, and the weights gathered whole beside them.
        ShardState::Gradients => (params + conv_weights / g, shares, shares),
        ShardState::Parameters => (shares, shares, shares),
    };
    let (params, grads, state) = (params * 4.0, grads * 4.0, state * 4.0);
    // Sharded gradients: the largest convolution's gradient whole while its
    // backward runs; fully sharded, its weight whole beside it (no U is
    // kept between the passes).
    let gathered = if fsdp {
        2.0 * largest_weight * 4.0
    } else if zero2 {
        largest_weight * 4.0
    } else {
        0.0
    };
    // Each of the rank's threads holds its own im2col buffers (parallel
    // chunks), and the weight gradient one dW-sized partial per thread.
    let threads = crate::kernels::threads() as f64;
    let mut m = RankMemory {
        parameters: params,
        gradients: grads,
        // With data parallelism one more gradient-sized buffer: the window
        // MPI ranks on one node sum the gradients in (or the one buffer the
        // copy through MPI's allreduce uses; none on thread ranks, counted
        // anyway).
        communication: if groups > 1 { params } else { 0.0 },
        optimizer: c.train.optimizer.slots() as f64 * state,
        // Kept activations, the backward's gradients at the largest layer,
        // each thread's im2col buffers; the kept U.
        activations: b * 4.0 * (act + largest)
            + threads * (2.0 * largest_col + largest_weight * 4.0)
            + if fsdp || zero2 {
                gathered
            } else {
                kept_u * 4.0
            },
        ..RankMemory::default()
    };
    if r == 0 {
        let features = (c.dataset.channels() * 1024) as f64;
        let (train, test) = match c.dataset {
            ImageSet::Synthetic => {
                let n = c.synthetic_examples as f64;
                (n, (n / 5.0).ceil())
            }
            ImageSet::Cifar10 => (50_000.0, 10_000.0),
            _ => (MNIST_TRAIN, MNIST_TEST),
        };
        m.data = (train + test) * (features * 4.0 + 4.0);
        // Reading: the raw files or MNIST's unpadded arrays beside the result.
        m.loading = match c.dataset {
            ImageSet::Mnist | ImageSet::FashionMnist => mnist_bytes().1 + mnist_bytes().0,
            _ => train * features * 5.0,
        };
        m.gather = params;
    }
    // Its steps free and allocate blocks of the same sizes again: a tenth of
    // the activations stays with the allocator (measured on thread ranks:
    // resident less heap is the baseline and little more).
    m.slack = 0.1 * m.activations;
    m
}
