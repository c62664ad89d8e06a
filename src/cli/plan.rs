//! `shardnet plan <model>`: the memory plan of the run the same flags would
//! start, and the memory available, without training.

use super::args::{TrainArgs, TrainCommand};
use super::train::WithConfig;
use shardnet::train::plan::{self, MemoryPlan, Placement};
use shardnet::train::ModelConfig;
use shardnet::{Error, Result};

/// `shardnet plan <model>`: the memory plan of the run `shardnet train
/// <model>` with the same flags would make, without training. Ranks: the
/// launcher's (under mpiexec, with its ranks per node), else `--ranks`
/// (thread ranks of one process; with `--comm mpi`, processes on this node).
pub(crate) fn plan(model: &TrainCommand, gpu: &GpuArgs) -> Result<()> {
    let p = model.configure(Plan)?.ok_or_else(|| {
        Error::Usage(format!(
            "shardnet plan has no memory model of {} yet",
            model.name()
        ))
    })?;
    // Planned from any build: a laptop plans for a GPU cluster.
    if model.common().ranks.device == "cuda" {
        return gpu_plan(&p, gpu);
    }
    if gpu.gpu_memory.is_some() || gpu.gpus.is_some() {
        return Err(Error::Usage(
            "--gpu-memory and --gpus plan GPU memory: add --device cuda".into(),
        ));
    }
    let available = plan::available_memory()?;
    print!("{}", p.report(&available));
    p.check_available(&available)?;
    if available.bytes == u64::MAX {
        println!("not checked: the available memory is unknown");
    } else {
        println!(
            "fits: {} of {}",
            plan::bytes(p.total()),
            plan::bytes(available.bytes as f64)
        );
    }
    Ok(())
}

/// The GPUs that `plan … --device cuda` plans for.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct GpuArgs {
    /// With --device cuda: the memory of one GPU (80G, 141G, 24GiB, …)
    /// [default: what this machine's first GPU has].
    #[arg(long, global = true, value_parser = gpu_bytes)]
    pub(crate) gpu_memory: Option<u64>,
    /// With --device cuda: the GPUs of a node, rank r of a node on
    /// cuda:(r mod GPUS) [default: this machine's, else 1].
    #[arg(long, global = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) gpus: Option<u64>,
}

fn gpu_bytes(s: &str) -> std::result::Result<u64, String> {
    match plan::parse_bytes(s) {
        Some(b) if b > 0 => Ok(b),
        _ => Err(format!(
            "'{s}' is not a memory size: give bytes, or a number with K, M, G or T (80G)"
        )),
    }
}

/// `plan … --device cuda`: the largest rank's parts, each GPU's ranks and
/// bytes, against one GPU's memory (the flags', or this machine's).
fn gpu_plan(p: &MemoryPlan, gpu: &GpuArgs) -> Result<()> {
    let here = plan::gpu_memory_here();
    let bytes = gpu
        .gpu_memory
        .map(|b| b as f64)
        .or(here.map(|h| h.bytes))
        .ok_or_else(|| {
            Error::Usage(
                "plan --device cuda: no GPU here to ask its memory: give --gpu-memory SIZE \
                 (one GPU's, e.g. 80G) and --gpus N (GPUs per node)"
                    .into(),
            )
        })?;
    let gpus = gpu
        .gpus
        .map(|g| g as usize)
        .or(here.map(|h| h.gpus))
        .unwrap_or(1);
    let memory = plan::GpuMemory { gpus, bytes };
    print!("{}{}", p.breakdown(), p.gpu_report(&memory));
    p.check_gpu(&memory)?;
    println!(
        "fits: {} on the fullest GPU of {}",
        plan::bytes(p.largest_gpu(gpus).total),
        plan::bytes(bytes)
    );
    Ok(())
}

/// The memory plan of a checked configuration on the launch's placement.
struct Plan;

impl WithConfig for Plan {
    type Out = Option<MemoryPlan>;
    fn with<C: ModelConfig>(self, cfg: C, t: &TrainArgs) -> Result<Option<MemoryPlan>> {
        let placement = Placement::launch(&t.ranks.comm, t.ranks.ranks);
        cfg.validate(placement.ranks)?;
        Ok(cfg.memory_plan(placement))
    }
}
