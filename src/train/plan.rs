//! The memory plan: each rank's peak memory, computed from the configuration
//! before anything is allocated, and checked against the memory the machine
//! has left.
//!
//! [`MemoryPlan`] estimates, for every rank of a run of a model
//! ([`MemoryPlan::mnist_mlp`], [`MemoryPlan::sharded_head`],
//! [`MemoryPlan::vgg16`]), the bytes of
//! each part ([`RankMemory`]): parameters, their gradient buffers, Adam's two
//! moments, activations and the step's buffers, the sharded head's logits
//! block, the data, the final gather of the parameters (the MLP), and a
//! slack for the allocator; plus a baseline per process for the program and
//! its runtime. Ranks on one machine share its memory: the local backend's
//! ranks are threads of one process, which needs the sum over them; under
//! MPI the ranks of one node (the same host name) are counted together.
//!
//! [`check`] (collective), called by `mnist_mlp::run`, `sharded_head::run`
//! and `vgg16::run`
//! before they build anything, refuses a run that does not fit with a
//! [`Error::Usage`] that gives the estimate, the available memory and what
//! would fit: the smallest rank count (under `mpiexec`, as many ranks per
//! node as now), or for the head the Partial FC sample rate. Available memory
//! ([`available_memory`]) is the smallest of `MemAvailable` (/proc/meminfo),
//! the cgroup's limit less its usage (v2 `memory.max` − `memory.current`, v1
//! `memory.limit_in_bytes` − `memory.usage_in_bytes`, inactive page cache
//! counted as free, every level up to the root) and `SHARDNET_MEMORY_LIMIT`
//! (bytes, or with a K/M/G/T suffix, binary); where none can be read nothing
//! is refused. `SHARDNET_MEMORY_CHECK=off` skips the check.
//!
//! All arithmetic is in f64: an absurd configuration (10¹² classes) gets an
//! estimate and a refusal, never an overflow.
//!
//! **The model, measured** (VmHWM of `shardnet train … --no-eval`, 24 GiB
//! machine, glibc, the command's allocator settings; the estimates are within
//! 15% of it, tests/plan.rs):
//! - *Head* (rank r of n, C_r classes, batch B, dimension d): the shard
//!   W_r (C_r·d·4 bytes), the optimizer's slots (SGD's momentum: 1; Adam: 2),
//!   its gradient only with `--unfused-update` (the fused step updates each
//!   class block as its gradient is produced), and the logits B·C_r in the
//!   logits precision (4 or 2 bytes), held from forward to backward; Partial
//!   FC shrinks them to ⌈r·C_r⌉ columns (its rows are read in place, a class
//!   block at a time); one class block's scratch (1024 rows of d, and B × 1024
//!   f32 logits under half precision). Evaluation runs the
//!   full head one class block at a time (B, or 1000 rows of MNIST, × 1024
//!   logits). The data-parallel backbone:
//!   its parameters four times, its gradient allreduce's buffers three more,
//!   two copies of each of its activations for this rank's B/n rows, and six
//!   B × d feature buffers around the head.
//! - *MLP*: each rank's layers four times (value, gradient, moments), three
//!   copies of the activations, and at the end the parameters gathered on
//!   rank 0 for the report (its own twice, everyone's once, the largest
//!   rank's bytes once more; every other rank its own once).
//! - *MNIST*, held by rank 0 of the MLP and by every rank of mnist-arcface:
//!   70,000 × 784 f32 (220 MB); loading peaks at 9 bytes per training pixel
//!   (the inflated bytes, read straight from the gzip stream, and the f32
//!   conversion and scaling), 423 MB.
//!   What loading frees is reused by what comes later, so a rank's peak is
//!   its parameters and data plus the larger of the loading transient and
//!   everything else.
//! - *Allocator slack*: freed blocks the heap cannot reuse (steps allocate
//!   and free the same large buffers; measured to grow by up to ~150 MB per
//!   rank over tens of steps at 100,000+ classes): the smaller of 64 MiB and
//!   min(24 MiB, parameters) + half the logits block.
//! - *VGG16* (rank r, its group's share b of the batch): the rank's
//!   convolution weights (its chunk for `output`/`input`, its group's for
//!   `grouped`), batch norms and the classifier four times; per image, each
//!   convolution's output, batch norm's, ReLU's and the pooled tensor (on
//!   the rank's channels for the exact splits, plus the gathered copy or the
//!   pre-reduce-scatter sums), 1.5 times the largest layer for the
//!   backward's gradients and, on several ranks, 3 times more for the
//!   collectives' buffers; two im2col buffers; rank 0 holds the images
//!   (f32). Measured within 10% on 2 thread ranks, up to 20% high on 1.
//! - *Baseline*: 16 MiB per process (24 MiB per MPI process).
//!
//! The plan covers host memory on the CPU path; ranks computing on another
//! device are not checked.

use super::{mnist_mlp, sharded_head, vgg16};
use crate::comm::Communicator;
use crate::{Error, Result};
use candle_core::DType;
use std::fmt::Write as _;
use std::path::Path;

const MIB: f64 = 1024.0 * 1024.0;
/// MNIST (and Fashion-MNIST): training and test examples, pixels each.
const MNIST_TRAIN: f64 = 60_000.0;
const MNIST_TEST: f64 = 10_000.0;
const PIXELS: f64 = 784.0;
/// Rows per evaluation batch of MNIST (both models).
const MNIST_EVAL_ROWS: f64 = 1000.0;
/// Classes per block of the head's kernels (each block's scratch).
const CLASS_BLOCK: f64 = crate::functions::CLASS_BLOCK as f64;

/// How the ranks of a run share memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Ranks in the run.
    pub ranks: usize,
    /// Ranks on one machine (node), which share its memory: ranks
    /// `k·per_node .. (k+1)·per_node` are on node k.
    pub per_node: usize,
    /// Whether a node's ranks are threads of one process (the local
    /// backend: one baseline) rather than one process each (MPI).
    pub threads: bool,
}

impl Placement {
    /// `ranks` thread ranks of one process (the local backend).
    pub fn local(ranks: usize) -> Self {
        Placement {
            ranks: ranks.max(1),
            per_node: ranks.max(1),
            threads: true,
        }
    }

    /// `ranks` MPI processes, `per_node` on each machine.
    pub fn mpi(ranks: usize, per_node: usize) -> Self {
        Placement {
            ranks: ranks.max(1),
            per_node: per_node.clamp(1, ranks.max(1)),
            threads: false,
        }
    }

    /// The placement of `comm`'s ranks: local threads, or MPI processes with
    /// the node's rank count.
    pub fn of(comm: &Communicator) -> Self {
        if comm.backend() == "local" {
            Self::local(comm.size())
        } else {
            Self::mpi(comm.size(), comm.intra_size())
        }
    }

    /// The ranks of node `node`.
    pub fn node(&self, node: usize) -> std::ops::Range<usize> {
        let start = node.saturating_mul(self.per_node).min(self.ranks);
        start..start.saturating_add(self.per_node).min(self.ranks)
    }
}

/// One rank's memory at its peak, bytes, by what holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankMemory {
    /// The rank's parameters (f32).
    pub parameters: f64,
    /// Their gradient buffers, one per parameter.
    pub gradients: f64,
    /// Optimizer state: Adam's two moments, SGD's momentum.
    pub optimizer: f64,
    /// Activations kept for backward and the step's other buffers
    /// (feature copies around the head, the gradient allreduce, Partial FC's
    /// row copies, half-precision scratch).
    pub activations: f64,
    /// The sharded head's logits block (training, or evaluation's full head
    /// if larger).
    pub logits: f64,
    /// Data held for the run (MNIST arrays).
    pub data: f64,
    /// More, for a moment, while the data are read (reused afterwards).
    pub loading: f64,
    /// The parameters gathered for the report at the end (the MLP).
    pub gather: f64,
    /// Freed blocks the allocator cannot reuse.
    pub slack: f64,
}

impl RankMemory {
    /// The rank's peak: parameters and data, plus the larger of the loading
    /// transient and everything allocated after it (which reuses it).
    pub fn peak(&self) -> f64 {
        let later = self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.gather
            + self.slack;
        self.parameters + self.data + self.loading.max(later)
    }
}

#[derive(Clone, Debug)]
enum Model {
    Mlp(mnist_mlp::Config),
    Head(sharded_head::Config),
    Vgg(vgg16::Config),
}

/// Every rank's memory for one configuration and placement.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    model: Model,
    /// How the ranks share memory.
    pub placement: Placement,
}

/// `parts` chunks of `n` as `chunk_sizes` makes them: chunk `index`'s start
/// and length, in O(1).
fn chunk(n: usize, parts: usize, index: usize) -> (usize, usize) {
    let parts = parts.max(1);
    let (q, rem) = (n / parts, n % parts);
    (index * q + index.min(rem), q + usize::from(index < rem))
}

/// Parameter bytes of a Linear(i, o) with bias, f32.
fn linear_bytes(i: f64, o: f64) -> f64 {
    (i * o + o) * 4.0
}

/// Freed blocks the allocator cannot reuse: what steps allocate and free
/// again (the logits block, GEMM packing buffers) leaves holes.
fn slack(parameters: f64, logits: f64) -> f64 {
    (parameters.min(24.0 * MIB) + 0.5 * logits).min(64.0 * MIB)
}

/// `n rank` or `n ranks`.
fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

/// MNIST's held arrays and the loading transient beyond them.
fn mnist_bytes() -> (f64, f64) {
    let held = (MNIST_TRAIN + MNIST_TEST) * (PIXELS * 4.0 + 4.0);
    let peak = MNIST_TRAIN * PIXELS * 9.0;
    (held, (peak - held).max(0.0))
}

impl MemoryPlan {
    /// The plan of `shardnet train mnist-mlp` with `cfg` on `placement`.
    pub fn mnist_mlp(cfg: &mnist_mlp::Config, placement: Placement) -> Self {
        MemoryPlan {
            model: Model::Mlp(cfg.clone()),
            placement,
        }
    }

    /// The plan of the sharded classifier (`face-head`, `mnist-arcface`)
    /// with `cfg` on `placement`.
    pub fn sharded_head(cfg: &sharded_head::Config, placement: Placement) -> Self {
        MemoryPlan {
            model: Model::Head(cfg.clone()),
            placement,
        }
    }

    /// The plan of `shardnet train vgg16` with `cfg` on `placement`.
    pub fn vgg16(cfg: &vgg16::Config, placement: Placement) -> Self {
        MemoryPlan {
            model: Model::Vgg(cfg.clone()),
            placement,
        }
    }

    /// The same model on another placement.
    pub fn on(&self, placement: Placement) -> Self {
        MemoryPlan {
            model: self.model.clone(),
            placement,
        }
    }

    /// The model's command name.
    pub fn name(&self) -> &'static str {
        match &self.model {
            Model::Mlp(_) => "mnist-mlp",
            Model::Vgg(_) => "vgg16",
            Model::Head(c) => match c.source {
                sharded_head::Source::Synthetic { .. } => "face-head",
                sharded_head::Source::Mnist { .. } => "mnist-arcface",
            },
        }
    }

    /// The program and runtime of one process, bytes.
    pub fn baseline(&self) -> f64 {
        if self.placement.threads {
            16.0 * MIB
        } else {
            24.0 * MIB
        }
    }

    /// Rank `rank`'s memory.
    pub fn rank(&self, rank: usize) -> RankMemory {
        match &self.model {
            Model::Mlp(c) => mlp_rank(c, self.placement.ranks, rank),
            Model::Vgg(c) => vgg_rank(c, self.placement.ranks, rank),
            Model::Head(c) => head_rank(c, self.placement.ranks, rank),
        }
    }

    /// What `ranks` (on one machine) need together, baselines included.
    /// Beyond 4096 ranks, the middle ones are counted at the mean of the two
    /// around them (ranks differ by one class row or one stage at most).
    pub fn total_of(&self, ranks: std::ops::Range<usize>) -> f64 {
        let count = ranks.len();
        let peak = |r: usize| self.rank(r).peak();
        let sum: f64 = if count <= 4096 {
            ranks.map(peak).sum()
        } else {
            let (head, tail) = (ranks.start + 2048, ranks.end - 2048);
            let ends: f64 = (ranks.start..head).chain(tail..ranks.end).map(peak).sum();
            ends + (tail - head) as f64 * 0.5 * (peak(head) + peak(tail - 1))
        };
        let processes = if self.placement.threads { 1 } else { count };
        sum + self.baseline() * processes as f64
    }

    /// What the first node (rank 0's: its data, its largest shard) needs.
    pub fn total(&self) -> f64 {
        self.total_of(self.placement.node(0))
    }

    /// Whether the first node fits in `available` bytes.
    pub fn fits(&self, available: f64) -> bool {
        self.total() <= available
    }

    /// The rank of the first node with the largest peak.
    fn largest_rank(&self) -> usize {
        let node = self.placement.node(0);
        // Rank 0 holds the most (data, the first class rows); a look at the
        // first 4096 and the last suffices.
        (node.start..node.end.min(node.start + 4096))
            .chain(node.end.checked_sub(1))
            .map(|r| (r, self.rank(r).peak()))
            .fold((0, f64::NEG_INFINITY), |a, b| if b.1 > a.1 { b } else { a })
            .0
    }

    /// One line: the model, its sizes and the placement.
    pub fn describe(&self) -> String {
        let n = self.placement.ranks;
        let mut s = match &self.model {
            Model::Mlp(c) => format!(
                "{}: {} units, {} stages, batch {}, {}",
                self.name(),
                c.units,
                self.stages(c),
                c.batch_size,
                ranks(n)
            ),
            Model::Head(c) => {
                let precision = match c.precision {
                    DType::BF16 => "bf16",
                    DType::F16 => "f16",
                    _ => "f32",
                };
                let mut s = format!(
                    "{}: {} classes ({} on rank 0), d = {}, batch {}, {precision} logits",
                    self.name(),
                    c.classes,
                    chunk(c.classes, n, 0).1,
                    c.dim,
                    c.batch_size,
                );
                if c.sample_rate < 1.0 {
                    let _ = write!(s, ", Partial FC at rate {}", c.sample_rate);
                }
                if c.naive {
                    s.push_str(", naive head");
                }
                let _ = write!(s, ", {}", ranks(n));
                s
            }
            Model::Vgg(c) => format!(
                "{}: width {}, --parallel-conv {}, batch {} in {} group(s), {}",
                self.name(),
                c.width,
                c.split,
                c.batch_size,
                c.data_parallel,
                ranks(n)
            ),
        };
        if self.placement.threads {
            s.push_str(" (local backend: threads of one process)");
        } else {
            let _ = write!(
                s,
                " (MPI: one process per rank, {} per node)",
                self.placement.per_node
            );
        }
        s
    }

    /// The breakdown (the rank of the first node with the largest peak),
    /// the node's (process's) total, and `available`.
    pub fn report(&self, available: &Available) -> String {
        let r = self.largest_rank();
        let m = self.rank(r);
        let node = self.placement.node(0);
        let mut s = format!("memory plan for {}\n", self.describe());
        let _ = writeln!(s, "rank {r} (the largest), per part:");
        let rows = [
            ("parameters", m.parameters, ""),
            ("gradients", m.gradients, ""),
            (
                "optimizer",
                m.optimizer,
                "Adam: two moments; SGD: its momentum",
            ),
            ("activations", m.activations, "and the step's buffers"),
            ("logits", m.logits, "the sharded head's block"),
            ("data", m.data, "held"),
            (
                "data loading",
                m.loading,
                "transient, reused by what follows",
            ),
            ("final gather", m.gather, "parameters gathered on rank 0"),
            ("allocator slack", m.slack, ""),
        ];
        for (name, v, note) in rows {
            let line = format!("  {name:<16} {:>12}  {note}", bytes(v));
            let _ = writeln!(s, "{}", line.trim_end());
        }
        let _ = writeln!(s, "  {:<16} {:>12}", "total per rank", bytes(m.peak()));
        let procs = if self.placement.threads {
            1
        } else {
            node.len()
        };
        let _ = writeln!(
            s,
            "{} ({}, baseline {} × {procs}): {}",
            if self.placement.threads {
                "this process"
            } else {
                "one node"
            },
            ranks(node.len()),
            bytes(self.baseline()),
            bytes(self.total())
        );
        let _ = writeln!(s, "available: {available}");
        s
    }

    /// The refusal (a message) when `ranks` on one machine need `total`
    /// bytes and `available` has less.
    pub fn refusal(
        &self,
        ranks: std::ops::Range<usize>,
        total: f64,
        available: &Available,
    ) -> String {
        let here = if self.placement.threads {
            format!("this process ({} as threads)", self::ranks(ranks.len()))
        } else {
            format!("one node ({})", self::ranks(ranks.len()))
        };
        let r = ranks.start;
        let m = self.rank(r);
        let mut s = format!(
            "{} does not fit in memory: the plan estimates {} for {here}, {} for rank {r} \
             (parameters {}, gradients {}, optimizer {}, activations {}, logits {}, data {}), \
             but {} is available ({}).",
            self.name(),
            bytes(total),
            bytes(m.peak()),
            bytes(m.parameters),
            bytes(m.gradients),
            bytes(m.optimizer),
            bytes(m.activations),
            bytes(m.logits),
            bytes(m.data),
            bytes(available.bytes as f64),
            available.sources()
        );
        let avail = available.bytes as f64;
        let per_node = self.placement.per_node;
        match self.smallest_ranks(avail) {
            Ok(n) => {
                let k = per_node.min(n);
                let _ = write!(
                    s,
                    " It would fit on {} under mpiexec with at most {k} per node ({} with this \
                     much memory{}).",
                    self::ranks(n),
                    match n.div_ceil(k) {
                        1 => "1 node".to_string(),
                        nodes => format!("{nodes} nodes"),
                    },
                    match &self.model {
                        Model::Mlp(c) => format!(", --stages {}", self.stages(c)),
                        Model::Head(_) | Model::Vgg(_) => String::new(),
                    }
                );
            }
            Err((most, need)) => {
                let why = match &self.model {
                    Model::Head(c) => format!(
                        "the most --batch-size {} allows: every rank needs a sample",
                        c.batch_size
                    ),
                    Model::Mlp(c) => {
                        format!(
                            "one stage each, the most --stages {} allows",
                            self.stages(c)
                        )
                    }
                    Model::Vgg(_) => "one channel each at the narrowest layer; give a smaller \
                                      --batch-size or --width"
                        .to_string(),
                };
                let _ = write!(
                    s,
                    " No rank count fits with {per_node} per node: even {} ({why}) need {} per \
                     node.",
                    self::ranks(most),
                    bytes(need)
                );
            }
        }
        if self.placement.threads {
            s.push_str(
                " The local backend's ranks are threads of this one process: more --ranks do \
                 not help here.",
            );
        }
        if let Model::Head(c) = &self.model {
            if !c.naive {
                let n = self.placement.ranks;
                let mut quiet = c.clone();
                quiet.train.evaluate = false;
                let advice = match self.sample_rate_that_fits(c, avail) {
                    Some(rate) => {
                        format!(
                            " On these {n} ranks, Partial FC with --sample-rate {rate} would fit."
                        )
                    }
                    None => match (c.train.evaluate, self.sample_rate_that_fits(&quiet, avail)) {
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
                };
                s.push_str(&advice);
            }
        }
        s.push_str(&format!(
            " `shardnet plan {} …` shows the breakdown; SHARDNET_MEMORY_CHECK=off skips this check.",
            self.name()
        ));
        s
    }

    /// `Err(Error::Usage(refusal))` if the first node does not fit.
    pub fn check_available(&self, available: &Available) -> Result<()> {
        let total = self.total();
        if total <= available.bytes as f64 {
            return Ok(());
        }
        Err(Error::Usage(self.refusal(
            self.placement.node(0),
            total,
            available,
        )))
    }

    fn stages(&self, c: &mnist_mlp::Config) -> usize {
        c.stages.unwrap_or(2.max(self.placement.ranks))
    }

    /// The smallest rank count, MPI processes with at most as many per node
    /// as now, whose first node fits in `available`; or the most ranks the
    /// configuration allows and what their first node needs.
    fn smallest_ranks(&self, available: f64) -> std::result::Result<usize, (usize, f64)> {
        let per_node = self.placement.per_node.max(1);
        let (plan, most) = match &self.model {
            Model::Head(c) => (self.clone(), c.batch_size.max(1)),
            Model::Vgg(c) => (self.clone(), c.scaled(64) * c.data_parallel.max(1)),
            Model::Mlp(c) => {
                // The same model: its stage count fixed.
                let stages = self.stages(c);
                let mut c = c.clone();
                c.stages = Some(stages);
                (MemoryPlan::mnist_mlp(&c, self.placement), stages.max(1))
            }
        };
        let at = |n: usize| plan.on(Placement::mpi(n, per_node.min(n)));
        let need = at(most).total();
        if need > available {
            return Err((most, need));
        }
        let (mut lo, mut hi) = (1usize, most);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if at(mid).fits(available) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(lo)
    }

    /// The largest Partial FC rate, at most `c`'s own (then two significant
    /// digits, rounded down), at which the head `c` fits in `available` on
    /// these ranks.
    fn sample_rate_that_fits(&self, c: &sharded_head::Config, available: f64) -> Option<f64> {
        let at = |rate: f64| {
            let mut c = c.clone();
            c.sample_rate = rate;
            MemoryPlan::sharded_head(&c, self.placement).fits(available)
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
}

fn mlp_rank(c: &mnist_mlp::Config, n: usize, r: usize) -> RankMemory {
    let stages = c.stages.unwrap_or(2.max(n));
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
    let (a, k) = chunk(stages, n, r);
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
                let (a, k) = chunk(stages, n, q);
                run(a, k).0
            })
            .fold(0.0, f64::max);
        m.gather = 2.0 * p + total + largest;
        (m.data, m.loading) = mnist_bytes();
    }
    m.slack = slack(m.parameters, m.logits);
    m
}

/// VGG16 on rank `r` of `n`: G groups of P = n/G ranks, this rank at
/// position p of its group with chunk g of the batch.
fn vgg_rank(c: &vgg16::Config, n: usize, r: usize) -> RankMemory {
    use crate::links::ChannelSplit as S;
    let groups = c.data_parallel.max(1);
    let p_n = (n / groups).max(1);
    let (p, g) = (r % p_n, (r / p_n).min(groups - 1));
    let b = chunk(c.batch_size, groups, g).1 as f64;
    let own = |ch: usize| chunk(ch, p_n, p).1 as f64;
    let (mut params, mut act, mut largest) = (0.0, 0.0, 0.0f64);
    let (mut largest_weight, mut largest_col) = (0.0f64, 0.0f64);
    let mut cin = c.dataset.channels();
    let mut side = 32.0f64;
    let convs: Vec<usize> = vgg16::VGG16.to_vec();
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
        largest_weight = largest_weight.max(weights);
        // One chunk's im2col matrix: C·9 rows, ≥ 256 columns of pixels.
        let col = fi * 9.0 * area.max(crate::nn::MIN_COLUMNS as f64) * 4.0;
        largest_col = largest_col.max(col.min(crate::nn::MAX_COL_BYTES as f64));
        // Kept for backward, per image (floats): the convolution's output,
        // batch norm's and ReLU's, the pooled tensor, and what the split
        // adds (the gathered copy, the pre-reduce-scatter partial sums).
        let post = if pooled { 0.25 } else { 1.0 };
        let kept = match c.split {
            S::None => fo * area * (3.0 + post),
            S::Grouped => own(cout) * area + fo * area * (3.0 + post) + own(cin) * area,
            S::Output => own(cout) * area * (3.0 + post) + fo * area * post,
            S::Input => fo * area + own(cout) * area * (3.0 + post),
        };
        act += kept;
        largest = largest.max((fo + fi) * area);
        if pooled {
            side /= 2.0;
        }
        cin = cout;
    }
    let hidden = c.scaled(512) as f64;
    params += cin as f64 * hidden + hidden + hidden * 10.0 + 10.0;
    let params = params * 4.0;
    // Each of the rank's threads holds its own im2col buffers (parallel
    // chunks), and the weight gradient one dW-sized partial per thread.
    let threads = candle_core::utils::get_num_threads().max(1) as f64;
    let mut m = RankMemory {
        parameters: params,
        gradients: params,
        optimizer: c.train.optimizer.slots() as f64 * params,
        // Kept activations, the backward's gradients (1.5 times the largest
        // layer), each thread's im2col buffers, and with several ranks the
        // collectives' results and deposits in flight (measured: 3 times
        // the largest layer more).
        activations: b * 4.0 * (act + 1.5 * largest + if p_n > 1 { 3.0 * largest } else { 0.0 })
            + threads * (2.0 * largest_col + largest_weight * 4.0),
        ..RankMemory::default()
    };
    if r == 0 {
        let features = (c.dataset.channels() * 1024) as f64;
        let (train, test) = match c.dataset {
            vgg16::ImageSet::Synthetic => {
                let n = c.synthetic_examples as f64;
                (n, (n / 5.0).ceil())
            }
            vgg16::ImageSet::Cifar10 => (50_000.0, 10_000.0),
            _ => (MNIST_TRAIN, MNIST_TEST),
        };
        m.data = (train + test) * (features * 4.0 + 4.0);
        // Reading: the raw files or MNIST's unpadded arrays beside the result.
        m.loading = match c.dataset {
            vgg16::ImageSet::Mnist | vgg16::ImageSet::FashionMnist => {
                mnist_bytes().1 + mnist_bytes().0
            }
            _ => train * features * 5.0,
        };
        m.gather = params;
    }
    m.slack = slack(m.parameters, 0.0) + 0.1 * m.activations;
    m
}

fn head_rank(c: &sharded_head::Config, n: usize, r: usize) -> RankMemory {
    let mnist = matches!(c.source, sharded_head::Source::Mnist { .. });
    let input = if mnist { PIXELS } else { c.dim as f64 };
    let d = c.dim as f64;
    let b = c.batch_size as f64;
    let cr = chunk(c.classes, n, r).1 as f64;
    let br = chunk(c.batch_size, n, r).1 as f64;
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
    let backbone: f64 = widths.windows(2).map(|w| linear_bytes(w[0], w[1])).sum();
    let shard = cr * d * 4.0;
    let p = backbone + shard;
    let eval_rows = if mnist { MNIST_EVAL_ROWS } else { b };
    let mut activations = br * widths.iter().sum::<f64>() * 4.0 * 2.0 // backbone, kept and their gradients
        + 6.0 * b * d * 4.0 // features around the head
        + 3.0 * backbone; // the backbone's gradient allreduce
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
        parameters: p,
        gradients: if fused { backbone } else { p },
        optimizer: c.train.optimizer.slots() as f64 * p,
        activations,
        logits,
        data,
        loading,
        gather: 0.0,
        slack: slack(p, logits),
    }
}

/// Bytes for people: `512 B`, `3.4 MiB`, `1.23 GiB`, …
pub fn bytes(v: f64) -> String {
    if !v.is_finite() {
        return "unbounded".into();
    }
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = v.max(0.0);
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{x:.0} B"),
        _ if x >= 1e6 => format!("{x:.3e} {}", UNITS[unit]),
        _ if x >= 100.0 => format!("{x:.0} {}", UNITS[unit]),
        _ if x >= 10.0 => format!("{x:.1} {}", UNITS[unit]),
        _ => format!("{x:.2} {}", UNITS[unit]),
    }
}

/// The memory a run may use on this machine, and where the figure comes
/// from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Available {
    /// The smallest of the figures below, bytes (`u64::MAX` when none is
    /// known: nothing is refused).
    pub bytes: u64,
    /// `MemAvailable` from /proc/meminfo.
    pub mem_available: Option<u64>,
    /// The tightest cgroup's limit less its usage (inactive page cache
    /// counted as free), where a limit is set.
    pub cgroup: Option<u64>,
    /// `SHARDNET_MEMORY_LIMIT`, if set.
    pub limit: Option<u64>,
}

impl Available {
    /// From the three figures: the smallest one that is known.
    pub fn new(mem_available: Option<u64>, cgroup: Option<u64>, limit: Option<u64>) -> Self {
        let bytes = [mem_available, cgroup, limit]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(u64::MAX);
        Available {
            bytes,
            mem_available,
            cgroup,
            limit,
        }
    }

    /// Where the figure comes from: `MemAvailable 21.3 GiB; cgroup: no limit`.
    pub fn sources(&self) -> String {
        let fig = |v: Option<u64>, none: &str| v.map_or(none.to_string(), |b| bytes(b as f64));
        let mut s = format!(
            "MemAvailable {}; cgroup: {}",
            fig(self.mem_available, "unknown"),
            self.cgroup.map_or("no limit".to_string(), |b| format!(
                "{} left",
                bytes(b as f64)
            ))
        );
        if let Some(l) = self.limit {
            let _ = write!(s, "; SHARDNET_MEMORY_LIMIT {}", bytes(l as f64));
        }
        s
    }
}

impl std::fmt::Display for Available {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.bytes == u64::MAX {
            return write!(f, "unknown ({}): not checked", self.sources());
        }
        write!(f, "{} ({})", bytes(self.bytes as f64), self.sources())
    }
}

/// The memory available to this process: [`available_memory_at`] the root
/// of the file system, with `SHARDNET_MEMORY_LIMIT` applied.
pub fn available_memory() -> Result<Available> {
    let limit = match std::env::var("SHARDNET_MEMORY_LIMIT") {
        Ok(v) => Some(parse_bytes(&v).ok_or_else(|| {
            Error::Usage(format!(
                "SHARDNET_MEMORY_LIMIT={v}: give bytes, or a number with K, M, G or T (binary: \
                 16G is 16 GiB)"
            ))
        })?),
        Err(_) => None,
    };
    let found = available_memory_at(Path::new("/"));
    Ok(Available::new(found.mem_available, found.cgroup, limit))
}

/// `MemAvailable` and the cgroup headroom as seen under `root` (`/`; a
/// copy of /proc and /sys for tests): `proc/meminfo`, `proc/self/cgroup`,
/// and the limits in `sys/fs/cgroup` (v2: `memory.max`, `memory.current`;
/// v1: `memory/…/memory.limit_in_bytes`, `memory.usage_in_bytes`), at the
/// process's cgroup and every level above it.
pub fn available_memory_at(root: &Path) -> Available {
    let meminfo = std::fs::read_to_string(root.join("proc/meminfo")).ok();
    let mem_available = meminfo.as_deref().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    Available::new(mem_available, cgroup_headroom(root), None)
}

/// The smallest limit − usage over the process's memory cgroups (v2 and
/// v1), each level up to the hierarchy's root.
fn cgroup_headroom(root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let sys = root.join("sys/fs/cgroup");
    let mut best: Option<u64> = None;
    let mut take = |v: Option<u64>| {
        if let Some(v) = v {
            best = Some(best.map_or(v, |b| b.min(v)));
        }
    };
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            for mount in [sys.clone(), sys.join("unified")] {
                for dir in levels(&mount, path) {
                    take(v2_headroom(&dir));
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            for dir in levels(&sys.join("memory"), path) {
                take(v1_headroom(&dir));
            }
        }
    }
    best
}

/// `mount/path` and each directory above it, up to `mount`.
fn levels(mount: &Path, path: &str) -> Vec<std::path::PathBuf> {
    let mut dir = mount.join(path);
    let mut out = Vec::new();
    loop {
        out.push(dir.clone());
        if dir == mount || !dir.pop() || !dir.starts_with(mount) {
            break;
        }
    }
    out
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key`'s value in a cgroup's memory.stat.
fn stat(dir: &Path, key: &str) -> u64 {
    std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
            })
        })
        .unwrap_or(0)
}

fn v2_headroom(dir: &Path) -> Option<u64> {
    let max = read_u64(&dir.join("memory.max"))?; // "max": no limit
    let current = read_u64(&dir.join("memory.current")).unwrap_or(0);
    let used = current.saturating_sub(stat(dir, "inactive_file"));
    Some(max.saturating_sub(used))
}

fn v1_headroom(dir: &Path) -> Option<u64> {
    let limit = read_u64(&dir.join("memory.limit_in_bytes"))?;
    if limit >= 1 << 60 {
        return None; // no limit (the kernel writes ~2⁶³)
    }
    let usage = read_u64(&dir.join("memory.usage_in_bytes")).unwrap_or(0);
    let used = usage.saturating_sub(stat(dir, "total_inactive_file"));
    Some(limit.saturating_sub(used))
}

/// `16G`, `512MiB`, `1.5t`, `1e9`, `1073741824`: bytes (K, M, G, T binary).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let unit_at = lower
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e')
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(unit_at);
    let scale: f64 = match unit.trim() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => 1024.0 * MIB,
        "t" | "tb" | "tib" => 1024.0 * 1024.0 * MIB,
        _ => return None,
    };
    let v = num.trim().parse::<f64>().ok()? * scale;
    (v.is_finite() && v >= 0.0 && v < u64::MAX as f64).then_some(v as u64)
}

/// Whether [`check`] runs (`SHARDNET_MEMORY_CHECK=off` turns it off).
pub fn check_enabled() -> bool {
    !std::env::var("SHARDNET_MEMORY_CHECK").is_ok_and(|v| v.eq_ignore_ascii_case("off"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Refuse, on every rank alike, a run whose plan does not fit: each rank
/// reports its peak, its host and the memory available there; the ranks of
/// one host (all of them, for the local backend's threads) are summed with
/// their baselines and compared with it. Collective; call it before
/// building anything. A no-op with `SHARDNET_MEMORY_CHECK=off` or on a
/// device other than the CPU.
pub fn check(comm: &Communicator, plan: &MemoryPlan) -> Result<()> {
    if !check_enabled() || !comm.device().is_cpu() {
        return Ok(());
    }
    let available = available_memory()?;
    let mine = (hostname(), plan.rank(comm.rank()).peak(), available);
    let all: Vec<(String, f64, Available)> = comm.allgather_obj(&mine)?;
    let mut hosts: Vec<&str> = Vec::new();
    for (h, _, _) in &all {
        if !hosts.contains(&h.as_str()) {
            hosts.push(h);
        }
    }
    for host in hosts {
        let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r].0 == host).collect();
        let processes = if plan.placement.threads {
            1
        } else {
            ranks.len()
        };
        let total: f64 =
            ranks.iter().map(|&r| all[r].1).sum::<f64>() + plan.baseline() * processes as f64;
        let available = &all[ranks[0]].2;
        if total > available.bytes as f64 {
            let first = ranks[0];
            return Err(Error::Usage(plan.refusal(
                first..first + ranks.len(),
                total,
                available,
            )));
        }
    }
    Ok(())
}
