//! The memory plan: each rank's peak memory, computed from the configuration
//! before anything is allocated, and checked against the memory the machine
//! has left.
//!
//! [`MemoryPlan`] estimates, for every rank of a run of a model (any
//! configuration that implements [`MemoryEstimate`]: each model's file holds
//! its own), the bytes of
//! each part ([`RankMemory`]): parameters, their gradient buffers, Adam's two
//! moments, activations and the step's buffers, the sharded head's logits
//! block, the data, the final gather of the parameters (the MLP), and a
//! slack for the allocator; plus a baseline per process for the program and
//! its runtime. Ranks on one machine share its memory: the local backend's
//! ranks are threads of one process, which needs the sum over them; under
//! MPI the ranks of one node (the same host name) are counted together.
//!
//! [`check`] (collective), called by the runner before a model is built, refuses a run that does not fit with a
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
//! - *Each model*: its parameters, gradients, optimizer state,
//!   activations and buffers, as its own `memory.rs` counts them.
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
//! - *Baseline*: 16 MiB per process (24 MiB per MPI process).
//!
//! With `--device cuda` the check is of GPU memory ([`GpuMemory`]): the ranks
//! of each GPU (rank r of a node on `cuda:(r mod g)`) and a CUDA context per
//! process on it, against the smallest free memory any rank's GPU reports
//! at the start.

mod gpu;
mod probe;

pub use gpu::{gpu_memory_here, GpuLoad, GpuMemory, CUDA_CONTEXT};

pub use probe::{
    available_memory, available_memory_at, check_enabled, memory_check_setting, parse_bytes,
    Available,
};

use crate::comm::Communicator;
use crate::{Error, Result};
use std::fmt::Write as _;
use std::sync::Arc;

pub(crate) const MIB: f64 = 1024.0 * 1024.0;

/// What a `cuda` build's libraries (cuBLAS, cuBLASLt, NCCL, cuRAND, the
/// CUDA runtime) keep resident in a process before it touches a GPU:
/// measured 96–174 MiB above the CPU build's peak in tests/plan.rs.
#[cfg(feature = "cuda")]
const CUDA_LIBRARIES: f64 = 150.0 * MIB;
#[cfg(not(feature = "cuda"))]
const CUDA_LIBRARIES: f64 = 0.0;
/// MNIST (and Fashion-MNIST): training and test examples, pixels each.
pub(crate) const MNIST_TRAIN: f64 = 60_000.0;
pub(crate) const MNIST_TEST: f64 = 10_000.0;
pub(crate) const PIXELS: f64 = 784.0;
/// Rows per evaluation batch of MNIST (both models).
pub(crate) const MNIST_EVAL_ROWS: f64 = 1000.0;

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

    /// The placement a run launched on `backend` (`local`, `mpi`, `auto`)
    /// with `ranks` thread ranks would get, before it starts: under a
    /// launcher, its processes with the node's count; `--comm mpi` without
    /// one, `ranks` processes on this node; else `ranks` threads.
    pub fn launch(backend: &str, ranks: usize) -> Self {
        let launched = crate::comm::launcher_size().filter(|&n| n > 1);
        match (backend, launched) {
            ("local", _) | ("auto", None) => Self::local(ranks),
            (_, Some(n)) => Self::mpi(n, crate::comm::launcher_local_size().unwrap_or(n)),
            (_, None) => Self::mpi(ranks, ranks),
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
    /// Communication buffers outside the heap: the shared-memory window
    /// MPI ranks on one node sum gradients in (data parallelism).
    pub communication: f64,
    /// Freed blocks the allocator cannot reuse.
    pub slack: f64,
}

impl RankMemory {
    /// `parameters …, gradients …, optimizer …, activations …, logits …,
    /// data …`: the parts a refusal names.
    pub fn parts(&self) -> String {
        format!(
            "parameters {}, gradients {}, optimizer {}, activations {}, logits {}, data {}",
            bytes(self.parameters),
            bytes(self.gradients),
            bytes(self.optimizer),
            bytes(self.activations),
            bytes(self.logits),
            bytes(self.data)
        )
    }

    /// The rank's peak: parameters and data, plus the larger of the loading
    /// transient and everything allocated after it (which reuses it).
    pub fn peak(&self) -> f64 {
        let later = self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.gather
            + self.communication
            + self.slack;
        self.parameters + self.data + self.loading.max(later)
    }
}

/// What the planner needs of a model: each rank's memory and how the model
/// scales with the rank count. Each model implements it on its
/// configuration, beside the model (the planner knows no model).
pub trait MemoryEstimate: std::fmt::Debug + Send + Sync {
    /// The model's command name (`mnist-mlp`, `face-head`, …).
    fn name(&self) -> &'static str;

    /// The model's sizes on `ranks` ranks, for the plan's first line
    /// (`100 units, 2 stages, batch 100`).
    fn describe(&self, ranks: usize) -> String;

    /// Rank `rank` of `ranks`: its memory at its peak.
    fn rank(&self, ranks: usize, rank: usize) -> RankMemory;

    /// How far the model, as configured for `ranks` ranks, scales out: the
    /// planner looks for the smallest rank count that fits.
    fn scaling(&self, ranks: usize) -> Scaling;

    /// Whether [`RankMemory::data`] is each process's (read by every
    /// process, shared by its thread ranks: the GPT's corpus), counted
    /// then on one rank of a process; otherwise each rank's, as the model
    /// says. False by default.
    fn data_per_process(&self) -> bool {
        false
    }

    /// More advice for a refusal on `placement` with `available` bytes (the
    /// sharded head's Partial FC rate); empty by default.
    fn advice(&self, placement: Placement, available: f64) -> String {
        let _ = (placement, available);
        String::new()
    }
}

/// How a model scales out (see [`MemoryEstimate::scaling`]).
#[derive(Clone, Debug)]
pub struct Scaling {
    /// The same model with what depends on the rank count fixed (the MLP's
    /// stage count), to be planned on other rank counts.
    pub model: Arc<dyn MemoryEstimate>,
    /// The most ranks it can use.
    pub most: usize,
    /// Why no more (`one stage each, the most --stages 4 allows`).
    pub limit: String,
    /// What a suggested command line needs besides the ranks
    /// (`, --stages 4`), or nothing.
    pub hint: String,
}

/// Every rank's memory for one configuration and placement.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    model: Arc<dyn MemoryEstimate>,
    /// How the ranks share memory.
    pub placement: Placement,
}

/// Parameter bytes of a Linear(i, o) with bias, f32.
pub(crate) fn linear_bytes(i: f64, o: f64) -> f64 {
    (i * o + o) * 4.0
}

/// Freed blocks the allocator cannot reuse: what steps allocate and free
/// again (the logits block, GEMM packing buffers) leaves holes.
pub(crate) fn slack(parameters: f64, logits: f64) -> f64 {
    (parameters.min(24.0 * MIB) + 0.5 * logits).min(64.0 * MIB)
}

/// `n rank` or `n ranks`.
fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

/// MNIST's held arrays and the loading transient beyond them.
pub(crate) fn mnist_bytes() -> (f64, f64) {
    let held = (MNIST_TRAIN + MNIST_TEST) * (PIXELS * 4.0 + 4.0);
    let peak = MNIST_TRAIN * PIXELS * 9.0;
    (held, (peak - held).max(0.0))
}

impl MemoryPlan {
    /// The plan of a run of the model configured by `model` on `placement`.
    pub fn new<M: MemoryEstimate + Clone + 'static>(model: &M, placement: Placement) -> Self {
        MemoryPlan {
            model: Arc::new(model.clone()),
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
        self.model.name()
    }
    /// The program and runtime of one process, bytes.
    pub fn baseline(&self) -> f64 {
        let program = if self.placement.threads {
            16.0 * MIB
        } else {
            24.0 * MIB
        };
        program + CUDA_LIBRARIES
    }

    /// Rank `rank`'s memory.
    pub fn rank(&self, rank: usize) -> RankMemory {
        let mut m = self.model.rank(self.placement.ranks, rank);
        if self.placement.threads {
            // Thread ranks sum in the heap's own buffers: no window.
            m.communication = 0.0;
            // One process: data it reads once is counted on its first rank.
            if rank > 0 && self.model.data_per_process() {
                m.data = 0.0;
            }
        }
        m
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
        self.largest_of(self.placement.node(0)).0
    }

    /// The rank of `ranks` with the largest peak, and that peak (bytes,
    /// without a baseline). Rank 0 holds the most (data, the first class
    /// rows); a look at the first 4096 and the last suffices.
    pub fn largest_of(&self, ranks: std::ops::Range<usize>) -> (usize, f64) {
        (ranks.start..ranks.end.min(ranks.start + 4096))
            .chain(ranks.end.checked_sub(1))
            .map(|r| (r, self.rank(r).peak()))
            .fold((0, f64::NEG_INFINITY), |a, b| if b.1 > a.1 { b } else { a })
    }

    /// One line: the model, its sizes and the placement.
    pub fn describe(&self) -> String {
        let n = self.placement.ranks;
        let mut s = format!("{}: {}, {}", self.name(), self.model.describe(n), ranks(n));
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
        let node = self.placement.node(0);
        let mut s = self.breakdown();
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

    /// The plan's first line and the largest rank's parts.
    pub fn breakdown(&self) -> String {
        let r = self.largest_rank();
        let m = self.rank(r);
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
            (
                "communication",
                m.communication,
                "the gradient sum's shared window, outside the heap",
            ),
            ("allocator slack", m.slack, ""),
        ];
        for (name, v, note) in rows {
            let line = format!("  {name:<16} {:>12}  {note}", bytes(v));
            let _ = writeln!(s, "{}", line.trim_end());
        }
        let _ = writeln!(s, "  {:<16} {:>12}", "total per rank", bytes(m.peak()));
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
             ({}), but {} is available ({}).",
            self.name(),
            bytes(total),
            bytes(m.peak()),
            m.parts(),
            bytes(available.bytes as f64),
            available.sources()
        );
        let avail = available.bytes as f64;
        let per_node = self.placement.per_node;
        let scaling = self.model.scaling(self.placement.ranks);
        match self.smallest_ranks(&scaling, avail) {
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
                    scaling.hint
                );
            }
            Err((most, need)) => {
                let why = &scaling.limit;
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
        s.push_str(&self.model.advice(self.placement, avail));
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

    /// The smallest rank count, MPI processes with at most as many per node
    /// as now, whose first node fits in `available`; or the most ranks the
    /// configuration allows and what their first node needs.
    fn smallest_ranks(
        &self,
        scaling: &Scaling,
        available: f64,
    ) -> std::result::Result<usize, (usize, f64)> {
        let per_node = self.placement.per_node.max(1);
        let most = scaling.most.max(1);
        let plan = MemoryPlan {
            model: scaling.model.clone(),
            placement: self.placement,
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

/// Refuse, on every rank alike, a run whose plan does not fit: each rank
/// reports its peak, its host and the memory available there; the ranks of
/// one host (all of them, for the local backend's threads) are summed with
/// their baselines and compared with it. On GPUs, the ranks of each GPU
/// against the smallest free GPU memory any rank reads
/// ([`MemoryPlan::check_gpu`]). Collective; call it before building
/// anything. A no-op with `SHARDNET_MEMORY_CHECK=off`, or where the
/// available memory cannot be read.
pub fn check(comm: &Communicator, plan: &MemoryPlan) -> Result<()> {
    if !check_enabled() {
        return Ok(());
    }
    if comm.device().is_cuda() {
        return check_gpus(comm, plan);
    }
    if !comm.device().is_cpu() {
        return Ok(());
    }
    let available = available_memory()?;
    let mine = (
        crate::output::host_name(),
        plan.rank(comm.rank()).peak(),
        available,
    );
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

/// [`check`] on GPUs: every rank reads the GPU count and its own GPU's free
/// memory; all agree on the smallest (so all refuse alike) and check the
/// most loaded GPU of the first node against it.
fn check_gpus(comm: &Communicator, plan: &MemoryPlan) -> Result<()> {
    let gpus = gpu_memory_here().map(|m| m.gpus);
    let free = gpus.and_then(|g| gpu::gpu_free(crate::comm::gpu_of(comm.intra_rank(), g)));
    let all: Vec<Option<(usize, f64)>> = comm.allgather_obj(&gpus.zip(free))?;
    let Some(seen) = all.into_iter().collect::<Option<Vec<_>>>() else {
        return Ok(());
    };
    let gpus = seen.iter().map(|s| s.0).min().unwrap_or(1);
    let bytes = seen.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    plan.check_gpu(&GpuMemory { gpus, bytes })
}
