//! The `shardnet` command: `train`, `plan`, `plot`, `consolidate`, `sample`, `demo`,
//! `selftest` and `bench`.

mod cli;

use clap::{Parser, Subcommand};
use cli::args::{at_least_one, positive_seconds, RankArgs, TrainCommand};
use cli::plan::plan;
use cli::tools::{demo, selftest, share_cores};
use cli::train::train;
use shardnet::comm;
use shardnet::{Error, Result};
use shardnet_cli::plot;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "shardnet",
    version,
    about = "Model-parallel training in Rust: ranks as threads or MPI processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model; each model is a subcommand with exactly its flags.
    Train {
        #[command(subcommand)]
        model: TrainCommand,
    },
    /// Print each rank's memory estimate for a training run (the same model
    /// subcommands and flags as `train`) and the memory available, without
    /// training; exit 1 if it does not fit. With `--device cuda`, the plan
    /// of GPU memory: which ranks share each GPU and what they hold there.
    /// With `--max-size`: the largest model each split of the ranks trains;
    /// with `--fewest-ranks`: the fewest ranks that train it.
    Plan {
        #[command(flatten)]
        gpu: cli::plan::GpuArgs,
        #[command(flatten)]
        size: cli::plan::SizeArgs,
        #[command(subcommand)]
        model: TrainCommand,
    },
    /// Write a checkpoint's parameters as one single-device safetensors
    /// file, whatever the number of ranks that wrote it (one tensor in
    /// memory at a time).
    Consolidate {
        /// A checkpoint's directory, or a --checkpoint-dir (its newest).
        checkpoint: PathBuf,
        /// The safetensors file to write.
        out: PathBuf,
    },
    /// Generate text from a trained GPT (`train gpt`): its checkpoint or
    /// parameter file, a prompt, temperature and top-k.
    Sample(cli::sample::SampleArgs),
    /// Show the collectives at work across ranks.
    Demo(RankArgs),
    /// Verify an installation: every collective, differentiable op and the
    /// sharded classifier against their definitions, on this backend and
    /// rank count (run it under mpiexec on a new cluster).
    Selftest {
        #[command(flatten)]
        ranks: RankArgs,
    },
    /// Draw PNG training curves (loss, accuracy, samples/s, memory per
    /// rank) from the --log-dir of one or more runs, one series per run.
    Plot {
        /// The --log-dir of each run to plot.
        #[arg(required = true, value_name = "DIR")]
        dirs: Vec<PathBuf>,
        /// Directory the PNGs are written to, created if missing [default: the first DIR].
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
    /// Measure communication bandwidth.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Bandwidth of send/recv, allgather, allreduce and alltoall, next to memcpy and raw MPI.
    Comm {
        #[command(flatten)]
        ranks: RankArgs,
        /// Largest message in bytes.
        #[arg(long, default_value_t = 64 << 20, value_parser = at_least_one)]
        max_bytes: usize,
        /// Seconds to spend per measurement (at least 3 repetitions).
        #[arg(long, default_value_t = 0.3, value_parser = positive_seconds)]
        seconds: f64,
    },
    /// Differentiable allgather/allreduce (forward + backward) next to the same calls made directly.
    Functions {
        #[command(flatten)]
        ranks: RankArgs,
        /// Largest per-rank input in bytes.
        #[arg(long, default_value_t = 16 << 20, value_parser = at_least_one)]
        max_bytes: usize,
        /// Seconds to spend per measurement (at least 3 repetitions).
        #[arg(long, default_value_t = 0.3, value_parser = positive_seconds)]
        seconds: f64,
    },
    /// One thread's f32 and bf16 GEMM rates at the sharded head's shapes and at 1024³.
    Gemm {
        /// One JSON object instead of a table (for bench scripts).
        #[arg(long)]
        json: bool,
        /// Timed repetitions per measurement (the median is shown).
        #[arg(long, default_value_t = 9, value_parser = at_least_one)]
        reps: usize,
    },
    /// One SGD and Adam step over a large parameter against memcpy's rate.
    Optim {
        /// Elements of the parameter (f32).
        #[arg(long, default_value_t = 1 << 24, value_parser = at_least_one)]
        elements: usize,
        /// Timed steps per optimizer (the median is shown).
        #[arg(long, default_value_t = 9, value_parser = at_least_one)]
        reps: usize,
        /// Threads the step splits over (RAYON_NUM_THREADS).
        #[arg(long, default_value_t = 1, value_parser = at_least_one)]
        threads: usize,
        /// One JSON object instead of a table (for bench scripts).
        #[arg(long)]
        json: bool,
    },
    /// Every VGG16 convolution shape (forward, forward+backward): our kernels, candle's, and the GEMM bound.
    Conv {
        /// Images per batch.
        #[arg(long, default_value_t = 32, value_parser = at_least_one)]
        batch: usize,
        /// Timed repetitions per measurement (the median is shown).
        #[arg(long, default_value_t = 10, value_parser = at_least_one)]
        reps: usize,
        /// Threads for the GEMMs (RAYON_NUM_THREADS).
        #[arg(long, default_value_t = 1, value_parser = at_least_one)]
        threads: usize,
    },
}

/// Counts the heap, so `--metrics` can tell what a run holds from what
/// the allocator keeps.
#[global_allocator]
static HEAP: shardnet::heap::CountingAllocator = shardnet::heap::CountingAllocator;

fn main() {
    quiet_broken_pipe();
    shardnet::tune_allocator();
    shardnet::tune_candle_pool();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version print and exit 0; under mpiexec with other
        // processes, a flag that does not parse ends the whole job.
        Err(e) if e.use_stderr() && comm::launcher_size().is_some_and(|n| n > 1) => {
            comm::end_job(e.render().to_string().trim_end())
        }
        Err(e) => e.exit(),
    };
    // A bad SHARDNET_TIMEOUT, SHARDNET_KERNELS, SHARDNET_AMX or
    // SHARDNET_WINOGRAD is refused before anything starts.
    let checked = comm::timeout()
        .and_then(|_| shardnet::kernels::check_env())
        .and_then(|_| shardnet::train::plan::memory_check_setting().map(drop));
    if let Err(e) = checked.and_then(|_| dispatch(cli.command)) {
        comm::end_job(&e.to_string());
    }
}

/// A reader that closes stdout early (`shardnet bench conv | head -3`)
/// ends the command quietly with status 141, as a shell reports a process
/// that SIGPIPE ended, instead of a panic from `println!` with its
/// backtrace. Every other panic goes to the hook before.
fn quiet_broken_pipe() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        previous(info);
    }));
}

fn dispatch(cmd: Command) -> Result<()> {
    match cmd {
        Command::Train { model } => {
            share_cores(&model.common().ranks);
            train(&model)
        }
        Command::Plan { gpu, size, model } => {
            // The threads each rank would get (the plan counts a buffer per
            // thread), as `train` gives them.
            share_cores(&model.common().ranks);
            plan(&model, &gpu, &size)
        }
        Command::Consolidate { checkpoint, out } => {
            shardnet::output::check_outputs(&[("OUT", out.as_path())])?;
            shardnet::output::check_outside_checkpoints("OUT", &out)?;
            let (n, bytes) = shardnet::train::checkpoint::consolidate(&checkpoint, &out)?;
            println!(
                "wrote {n} tensors ({:.1} MB) to {}",
                bytes as f64 / 1e6,
                out.display()
            );
            Ok(())
        }
        Command::Sample(a) => cli::sample::run(&a),
        Command::Demo(a) => {
            share_cores(&a);
            let setup = a.setup()?;
            comm::run(&a.comm, a.ranks, |c| demo(setup.apply(c)?)).map(|_| ())
        }
        Command::Plot { dirs, out } => {
            let runs = dirs
                .iter()
                .map(|d| plot::read_log(d))
                .collect::<Result<Vec<_>>>()?;
            for note in runs.iter().flat_map(|r| &r.skipped) {
                eprintln!("shardnet: note: {note}");
            }
            let out = out.or_else(|| dirs.first().cloned()).unwrap_or_default();
            for file in plot::plot_runs(&runs, &out)? {
                println!("wrote {}", file.display());
            }
            Ok(())
        }
        Command::Selftest { ranks } => {
            share_cores(&ranks);
            let setup = ranks.setup()?;
            let results = comm::run(&ranks.comm, ranks.ranks, |c| selftest(&setup.apply(c)?))?;
            // Every rank agreed on the outcome: the first result is everyone's.
            let failed = results.first().copied().unwrap_or(0);
            if failed > 0 {
                return Err(Error::Usage(format!("{failed} conformance failures")));
            }
            Ok(())
        }
        Command::Bench {
            what:
                BenchWhat::Comm {
                    ranks,
                    max_bytes,
                    seconds,
                },
        } => {
            share_cores(&ranks);
            let setup = ranks.setup()?;
            shardnet_cli::bench::comm(&ranks.comm, ranks.ranks, &setup, max_bytes, seconds)
        }
        Command::Bench {
            what:
                BenchWhat::Functions {
                    ranks,
                    max_bytes,
                    seconds,
                },
        } => {
            share_cores(&ranks);
            let setup = ranks.setup()?;
            shardnet_cli::bench::functions(&ranks.comm, ranks.ranks, &setup, max_bytes, seconds)
        }
        Command::Bench {
            what: BenchWhat::Gemm { json, reps },
        } => {
            // One thread: the rate one rank gets from one core.
            std::env::set_var("RAYON_NUM_THREADS", "1");
            shardnet_cli::bench::gemm(json, reps)
        }
        Command::Bench {
            what:
                BenchWhat::Optim {
                    elements,
                    reps,
                    threads,
                    json,
                },
        } => {
            // Set before any thread pool starts.
            std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
            shardnet_cli::bench::optim(elements, reps, json)
        }
        Command::Bench {
            what:
                BenchWhat::Conv {
                    batch,
                    reps,
                    threads,
                },
        } => {
            // Set before any thread pool starts.
            std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
            shardnet_cli::bench::conv(batch, reps)
        }
    }
}
