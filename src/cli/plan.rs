//! `shardnet plan <model>`: the memory plan of the run the same flags would
//! start, and the memory available, without training.

use super::args::{TrainArgs, TrainCommand};
use super::train::WithConfig;
use shardnet::train::plan::{self, MemoryPlan, Placement};
use shardnet::train::{ModelConfig, Size};
use shardnet::{Error, Result};

/// `shardnet plan <model>`: the memory plan of the run `shardnet train
/// <model>` with the same flags would make, without training. Ranks: the
/// launcher's (under mpiexec, with its ranks per node), else `--ranks`
/// (thread ranks of one process; with `--comm mpi`, processes on this node).
pub(crate) fn plan(model: &TrainCommand, gpu: &GpuArgs, size: &SizeArgs) -> Result<()> {
    if size.max_size || size.fewest_ranks {
        if size.max_size && size.fewest_ranks {
            return Err(Error::Usage(
                "--max-size and --fewest-ranks ask two questions: give one".into(),
            ));
        }
        let memory = match size.memory {
            Some(b) => b as f64,
            None => {
                let a = plan::available_memory()?;
                if a.bytes == u64::MAX {
                    return Err(Error::Usage(
                        "this machine's available memory is unknown: give --memory SIZE (each \
                         rank's, e.g. 16G)"
                            .into(),
                    ));
                }
                a.bytes as f64
            }
        };
        let text = model.configure(Sizes {
            memory,
            max_size: size.max_size,
            max_ranks: size.max_ranks,
        })?;
        print!("{text}");
        return Ok(());
    }
    if size.memory.is_some() {
        return Err(Error::Usage(
            "--memory is each rank's memory for --max-size or --fewest-ranks: add one of them"
                .into(),
        ));
    }
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

/// The questions `plan` answers from the memory model alone.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct SizeArgs {
    /// Print, for every split of the ranks, the largest size each rank's
    /// --memory trains: the GPT's --dim, the MLPs' --units, the face
    /// head's --classes, VGG16's --width.
    #[arg(long, global = true)]
    pub(crate) max_size: bool,
    /// Print the fewest ranks (up to --max-ranks) on which some split
    /// trains the model as given, each rank with --memory of its own, and
    /// every split that does there.
    #[arg(long, global = true)]
    pub(crate) fewest_ranks: bool,
    /// With --fewest-ranks: the most ranks to try.
    #[arg(long, global = true, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub(crate) max_ranks: u64,
    /// With --max-size or --fewest-ranks: each rank's memory (a process
    /// per rank: 16G, 80G, …) [default: this machine's available memory].
    #[arg(long, global = true, value_parser = gpu_bytes)]
    pub(crate) memory: Option<u64>,
}

/// `--max-size` or `--fewest-ranks`, as text.
struct Sizes {
    memory: f64,
    max_size: bool,
    max_ranks: u64,
}

impl WithConfig for Sizes {
    type Out = String;
    fn with<C: ModelConfig>(self, cfg: C, t: &TrainArgs) -> Result<String> {
        let name = cfg
            .memory_plan(Placement::local(1))
            .map(|p| p.name())
            .ok_or_else(|| {
                Error::Usage("shardnet plan has no memory model of this model yet".into())
            })?;
        let size = cfg.size().ok_or_else(|| {
            Error::Usage(format!(
                "shardnet plan --max-size: {name} has no size to search"
            ))
        })?;
        if self.max_size {
            let ranks = Placement::launch(&t.ranks.comm, t.ranks.ranks).ranks;
            largest_text(&cfg, name, size, ranks, self.memory)
        } else {
            fewest_text(&cfg, name, size, self.memory, self.max_ranks as usize)
        }
    }
}

/// `--max-size`: each split's largest size on `ranks` ranks, and the
/// largest of all.
fn largest_text<C: ModelConfig>(
    cfg: &C,
    name: &str,
    size: Size,
    ranks: usize,
    memory: f64,
) -> Result<String> {
    use std::fmt::Write;
    let found = shardnet::train::largest_sizes(cfg, ranks, memory);
    if found.is_empty() {
        return Err(Error::Usage(format!(
            "{name} has no split that validates on {ranks} rank(s): check its flags with \
             `shardnet plan {name} …` first"
        )));
    }
    let mut out = format!(
        "the largest {} of {name} on {ranks} rank(s), each with {} (a process per rank), by \
         split:\n",
        size.flag,
        plan::bytes(memory)
    );
    let width = found.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
    for (split, fit) in &found {
        let _ = match fit {
            Some(f) => writeln!(
                out,
                "  {split:<width$}  {} {:<10}  {} per rank",
                size.flag,
                show(f.size, size.step),
                plan::bytes(f.bytes)
            ),
            None => writeln!(
                out,
                "  {split:<width$}  does not fit even at {} {}",
                size.flag,
                show(size.step, size.step)
            ),
        };
    }
    if let Some(best) = found
        .iter()
        .filter_map(|(_, f)| f.as_ref())
        .max_by(|a, b| a.size.total_cmp(&b.size))
    {
        let _ = writeln!(
            out,
            "largest: {} {} with {}",
            size.flag,
            show(best.size, size.step),
            best.split
        );
    }
    Ok(out)
}

/// `--fewest-ranks`: the fewest ranks, up to `max_ranks`, and their splits.
fn fewest_text<C: ModelConfig>(
    cfg: &C,
    name: &str,
    size: Size,
    memory: f64,
    max_ranks: usize,
) -> Result<String> {
    use std::fmt::Write;
    let at = format!("{} {}", size.flag, show(size.value, size.step));
    let each = plan::bytes(memory);
    let (n, fits) = shardnet::train::fewest_ranks(cfg, memory, max_ranks).ok_or_else(|| {
        Error::Usage(format!(
            "{name} at {at} does not fit {each} a rank on any split of up to {max_ranks} ranks: \
             give more --memory or --max-ranks, or a smaller model"
        ))
    })?;
    let mut out = format!(
        "{name} at {at} trains on {n} rank(s), each with {each} (a process per rank), split as:\n"
    );
    for f in fits {
        let _ = writeln!(out, "  {}  {} per rank", f.split, plan::bytes(f.bytes));
    }
    Ok(out)
}

/// A size as its flag takes it: whole where the step is, else in 1/64s.
fn show(v: f64, step: f64) -> String {
    if step.fract() == 0.0 {
        format!("{}", v.round() as u64)
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
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
