//! GPU memory in the plan (`--device cuda`): which ranks each GPU holds and
//! what they keep there.
//!
//! Rank r of a node with g GPUs computes on `cuda:(r mod g)`
//! ([`crate::comm::gpu_of`]), so a GPU holds every g-th rank of its node.
//! On it, each of those ranks keeps what [`RankMemory::on_gpu`] counts
//! (parameters, gradients, optimizer state, activations, logits, the data
//! the model moves to the device, allocator slack), and each process with a
//! rank there keeps one CUDA context ([`CUDA_CONTEXT`]; the local backend's
//! thread ranks are one process and share theirs). The data loading
//! transient and the process baseline stay in host memory.
//!
//! `CUDA_CONTEXT` is an estimate (the context itself, candle's kernel
//! modules, cuBLAS's workspace), not yet a measurement on a GPU.

use super::{bytes, MemoryPlan, RankMemory, MIB};
use crate::{Error, Result};
use std::fmt::Write as _;

/// One CUDA context per process and GPU: the driver's context, the kernel
/// modules loaded into it and cuBLAS's workspace (an estimate).
pub const CUDA_CONTEXT: f64 = 512.0 * MIB;

/// The GPUs of a node: how many, and the memory of each, bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuMemory {
    /// GPUs per node.
    pub gpus: usize,
    /// Bytes of each GPU (its total, or what is free at the start).
    pub bytes: f64,
}

impl RankMemory {
    /// What the rank keeps on its GPU: everything but the host's data
    /// loading transient and the final gather (made in host memory).
    pub fn on_gpu(&self) -> f64 {
        self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.data
            + self.slack
    }
}

/// One GPU of the first node: its ranks and the bytes they need there.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuLoad {
    /// The GPU's index on the node.
    pub gpu: usize,
    /// The ranks computing on it.
    pub ranks: Vec<usize>,
    /// Their bytes on it, contexts included.
    pub total: f64,
}

impl MemoryPlan {
    /// Each GPU of the first node with `gpus` GPUs: its ranks and bytes.
    pub fn gpu_loads(&self, gpus: usize) -> Vec<GpuLoad> {
        let node = self.placement.node(0);
        let gpus = gpus.max(1);
        (0..gpus.min(node.len()))
            .map(|g| {
                let ranks: Vec<usize> = node
                    .clone()
                    .filter(|&r| crate::comm::gpu_of(r - node.start, gpus) == g)
                    .collect();
                let contexts = if self.placement.threads {
                    1
                } else {
                    ranks.len()
                };
                let total = ranks.iter().map(|&r| self.rank(r).on_gpu()).sum::<f64>()
                    + CUDA_CONTEXT * contexts as f64;
                GpuLoad {
                    gpu: g,
                    ranks,
                    total,
                }
            })
            .collect()
    }

    /// The GPU that needs the most.
    pub fn largest_gpu(&self, gpus: usize) -> GpuLoad {
        self.gpu_loads(gpus)
            .into_iter()
            .fold(None::<GpuLoad>, |a, b| match a {
                Some(a) if a.total >= b.total => Some(a),
                _ => Some(b),
            })
            .unwrap_or(GpuLoad {
                gpu: 0,
                ranks: Vec::new(),
                total: 0.0,
            })
    }

    /// The GPU part of `shardnet plan … --device cuda`: each GPU of the
    /// first node, its ranks and bytes, against `memory`.
    pub fn gpu_report(&self, memory: &GpuMemory) -> String {
        let mut s = format!(
            "on the GPUs ({} of {} per node; a CUDA context of {} per process on each GPU, an estimate):\n",
            plural(memory.gpus, "GPU"),
            bytes(memory.bytes),
            bytes(CUDA_CONTEXT)
        );
        for load in self.gpu_loads(memory.gpus) {
            let ranks = load
                .ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                s,
                "  cuda:{} holds {} ({ranks}): {}",
                load.gpu,
                plural(load.ranks.len(), "rank"),
                bytes(load.total)
            );
        }
        s
    }

    /// `Err(Error::Usage)` saying what does not fit when the first node's
    /// most loaded GPU needs more than `memory.bytes`.
    pub fn check_gpu(&self, memory: &GpuMemory) -> Result<()> {
        let load = self.largest_gpu(memory.gpus);
        if load.total <= memory.bytes {
            return Ok(());
        }
        let r = load.ranks.first().copied().unwrap_or(0);
        let m = self.rank(r);
        let ranks_per_gpu = load.ranks.len();
        let more = if ranks_per_gpu > 1 {
            format!(
                " {ranks_per_gpu} ranks share cuda:{}: a node with more GPUs (or fewer ranks per node) gives each its own.",
                load.gpu
            )
        } else {
            String::new()
        };
        Err(Error::Usage(format!(
            "{} does not fit in GPU memory: cuda:{} would hold {} for {} (rank {r}: {}; a CUDA \
             context {} per process), but a GPU has {}.{more} `shardnet plan {} … --device cuda` \
             shows the breakdown; SHARDNET_MEMORY_CHECK=off skips this check.",
            self.name(),
            load.gpu,
            bytes(load.total),
            plural(ranks_per_gpu, "rank"),
            m.parts(),
            bytes(CUDA_CONTEXT),
            bytes(memory.bytes),
            self.name()
        )))
    }
}

/// `n thing` or `n things`.
fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// The GPUs this machine has and the memory of the first, as its driver
/// reports them (a `cuda` build on a machine with a GPU); `None` elsewhere.
pub fn gpu_memory_here() -> Option<GpuMemory> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let gpus = usize::try_from(CudaContext::device_count().ok()?).ok()?;
        if gpus == 0 {
            return None;
        }
        let (_, total) = CudaContext::new(0).ok()?.mem_get_info().ok()?;
        Some(GpuMemory {
            gpus,
            bytes: total as f64,
        })
    }
    #[cfg(not(feature = "cuda"))]
    None
}

/// The free bytes of this rank's GPU, `cuda:ordinal` (a `cuda` build).
pub(super) fn gpu_free(ordinal: usize) -> Option<f64> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let (free, _) = CudaContext::new(ordinal).ok()?.mem_get_info().ok()?;
        Some(free as f64)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        None
    }
}
