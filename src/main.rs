//! The `shardnet` command: `train`, `demo`, `selftest` and `bench`.

use clap::{Parser, Subcommand};
use shardnet::comm::{self, Communicator, ReduceOp};
use shardnet::{Error, Result};

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

#[derive(clap::Args, Clone)]
struct RankArgs {
    /// Number of ranks for the local backend (ignored under mpiexec).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Communicator backend: local (threads), mpi (under mpiexec) or auto.
    #[arg(long, default_value = "auto")]
    comm: String,
}

#[derive(clap::Args, Clone)]
struct TrainArgs {
    /// The model: mnist-mlp (seed 001), face-head or mnist-arcface (seed 003).
    model: String,
    #[command(flatten)]
    ranks: RankArgs,
    /// Epochs over the training set (face-head: of --steps-per-epoch steps)
    /// [default: 5; face-head: 1].
    #[arg(long)]
    epochs: Option<usize>,
    /// Stop after this many steps in all.
    #[arg(long)]
    max_steps: Option<usize>,
    /// Examples per step [default: 100; face-head: 256; mnist-arcface: 128].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Hidden units.
    #[arg(long, default_value_t = 100)]
    units: usize,
    /// Pipeline stages of the MLP (default: 2, or the number of ranks if more).
    #[arg(long)]
    stages: Option<usize>,
    /// Micro-batches per step (GPipe pipelining); 1: none.
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Adam's learning rate [default: 1e-3; face-head: 1e-2].
    #[arg(long)]
    lr: Option<f64>,
    /// The dataset: mnist, or fashion-mnist (Debian's dataset-fashion-mnist, or --data).
    #[arg(long, default_value = "mnist")]
    dataset: String,
    /// Directory holding mnist/ (default: $SHARDNET_DATA, else a download cache).
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Steps at the start excluded from samples/s (for benchmarks; they still train).
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Write per-epoch metrics and peak memory as JSON to this file.
    #[arg(long)]
    metrics: Option<std::path::PathBuf>,
    /// Write every trained parameter to this safetensors file.
    #[arg(long)]
    save_params: Option<std::path::PathBuf>,
    /// Skip the test-set evaluation after each epoch.
    #[arg(long)]
    no_eval: bool,
    #[command(flatten)]
    head: HeadArgs,
}

/// Flags of the sharded-head models (face-head, mnist-arcface).
#[derive(clap::Args, Clone)]
struct HeadArgs {
    /// face-head: number of identities C.
    #[arg(long, default_value_t = 10_000)]
    classes: usize,
    /// face-head: feature dimension d [default: 512; mnist-arcface: 64].
    #[arg(long)]
    dim: Option<usize>,
    /// The head's margin: arcface, cosface, sphereface, combined, normalized or none.
    #[arg(long, default_value = "arcface")]
    margin: String,
    /// Logit scale s [default: 64 for margins, 30 for mnist-arcface].
    #[arg(long)]
    scale: Option<f64>,
    /// Precision of features, feature gradients and logits: f32, bf16 or f16
    /// (master weights stay f32; half precision uses a dynamic loss scale).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Partial FC: the fraction r of each shard's classes used per step (1: full head).
    #[arg(long, default_value_t = 1.0)]
    sample_rate: f64,
    /// face-head: the seed's naive head instead (logits concatenated on rank 0;
    /// plain logits, f32): for comparison.
    #[arg(long)]
    naive_head: bool,
    /// face-head: steps per reported epoch.
    #[arg(long, default_value_t = 100)]
    steps_per_epoch: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model: mnist-mlp (seed 001's model-parallel MLP), face-head
    /// (seed 003's sharded classifier on synthetic identities) or
    /// mnist-arcface (the same with ArcFace on MNIST).
    Train(Box<TrainArgs>),
    /// Show the collectives at work across ranks.
    Demo(RankArgs),
    /// Verify an installation: every collective, differentiable op and the
    /// sharded classifier against their definitions, on this backend and
    /// rank count (run it under mpiexec on a new cluster).
    Selftest {
        #[command(flatten)]
        ranks: RankArgs,
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
        #[arg(long, default_value_t = 64 << 20)]
        max_bytes: usize,
        /// Seconds to spend per measurement (at least 3 repetitions).
        #[arg(long, default_value_t = 0.3)]
        seconds: f64,
    },
    /// Differentiable allgather/allreduce (forward + backward) next to the same calls made directly.
    Functions {
        #[command(flatten)]
        ranks: RankArgs,
        /// Largest per-rank input in bytes.
        #[arg(long, default_value_t = 16 << 20)]
        max_bytes: usize,
        /// Seconds to spend per measurement (at least 3 repetitions).
        #[arg(long, default_value_t = 0.3)]
        seconds: f64,
    },
}

fn main() {
    shardnet::tune_allocator();
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli.command) {
        eprintln!("shardnet: {e}");
        std::process::exit(1);
    }
}

fn dispatch(cmd: Command) -> Result<()> {
    match cmd {
        Command::Train(a) => {
            share_cores(&a.ranks);
            train(&a)
        }
        Command::Demo(a) => {
            share_cores(&a);
            comm::run(&a.comm, a.ranks, demo).map(|_| ())
        }
        Command::Selftest { ranks } => {
            share_cores(&ranks);
            let results = comm::run(&ranks.comm, ranks.ranks, |c| selftest(&c))?;
            let failed: usize = results.iter().sum();
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
            shardnet::bench::comm(&ranks.comm, ranks.ranks, max_bytes, seconds)
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
            shardnet::bench::functions(&ranks.comm, ranks.ranks, max_bytes, seconds)
        }
    }
}

fn train(a: &TrainArgs) -> Result<()> {
    let metrics = match a.model.as_str() {
        "mnist-mlp" => train_mlp(a)?,
        "face-head" | "mnist-arcface" => train_head(a)?,
        other => {
            return Err(Error::Usage(format!(
                "unknown model '{other}'; available: mnist-mlp, face-head, mnist-arcface"
            )))
        }
    };
    if let (Some(path), Some(m)) = (&a.metrics, metrics) {
        let json =
            serde_json::to_string_pretty(&m).map_err(|e| Error::Io(format!("metrics: {e}")))?;
        std::fs::write(path, json).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

fn train_mlp(a: &TrainArgs) -> Result<Option<shardnet::train::Metrics>> {
    use shardnet::train::mnist_mlp;
    let cfg = mnist_mlp::Config {
        units: a.units,
        stages: a.stages,
        batch_size: a.batch_size.unwrap_or(100),
        micro_batches: a.micro_batches,
        lr: a.lr.unwrap_or(1e-3),
        epochs: a.epochs.unwrap_or(5),
        max_steps: a.max_steps,
        seed: a.seed,
        warmup_steps: a.warmup_steps,
        data: a.data.clone(),
        dataset: a.dataset.parse()?,
        evaluate: !a.no_eval,
        progress: true,
    };
    let reports = comm::run(&a.ranks.comm, a.ranks.ranks, |c| mnist_mlp::run(&c, &cfg))?;
    let Some(report) = reports.into_iter().flatten().next() else {
        return Ok(None);
    };
    if let Some(path) = &a.save_params {
        let params: std::collections::HashMap<_, _> = report.params.into_iter().collect();
        candle_core::safetensors::save(&params, path)?;
    }
    Ok(Some(report.metrics))
}

fn train_head(a: &TrainArgs) -> Result<Option<shardnet::train::Metrics>> {
    use shardnet::train::sharded_head::{Config, Source};
    let h = &a.head;
    let mut cfg = if a.model == "face-head" {
        let mut c = Config::face_head(h.classes, h.dim.unwrap_or(512));
        c.source = Source::Synthetic {
            steps_per_epoch: h.steps_per_epoch,
        };
        c
    } else {
        let mut c = Config::mnist_arcface(a.data.clone());
        c.dim = h.dim.unwrap_or(c.dim);
        c
    };
    cfg.margin = h.margin.parse()?;
    cfg.scale = h.scale.or(cfg.scale);
    cfg.precision = match h.precision.as_str() {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        "f16" => candle_core::DType::F16,
        other => {
            return Err(Error::Usage(format!(
                "unknown precision '{other}': use f32, bf16 or f16"
            )))
        }
    };
    cfg.sample_rate = h.sample_rate;
    cfg.naive = h.naive_head;
    cfg.batch_size = a.batch_size.unwrap_or(cfg.batch_size);
    cfg.epochs = a.epochs.unwrap_or(cfg.epochs);
    cfg.lr = a.lr.unwrap_or(cfg.lr);
    cfg.max_steps = a.max_steps;
    cfg.seed = a.seed;
    cfg.warmup_steps = a.warmup_steps;
    cfg.evaluate = !a.no_eval;
    if a.save_params.is_some() {
        return Err(Error::Usage(
            "--save-params is for mnist-mlp; the sharded head is saved per shard".into(),
        ));
    }
    let reports = comm::run(&a.ranks.comm, a.ranks.ranks, |c| {
        shardnet::train::sharded_head::run(&c, &cfg)
    })?;
    Ok(reports.into_iter().flatten().next().map(|r| r.metrics))
}

/// Give each rank its share of the cores (candle reads RAYON_NUM_THREADS).
fn share_cores(a: &RankArgs) {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Ranks sharing this machine: processes on this node under a launcher,
    // threads otherwise.
    let ranks_here = comm::launcher_local_size().unwrap_or(a.ranks).max(1);
    let share = (cores / ranks_here).max(1);
    // Set before any thread pool starts.
    std::env::set_var("RAYON_NUM_THREADS", share.to_string());
}

fn demo(c: Communicator) -> Result<()> {
    use candle_core::{Device, Tensor};
    let (r, n) = (c.rank(), c.size());
    let say = |what: String| println!("[{} rank {r}/{n}] {what}", c.backend());
    let x = Tensor::new(&[r as f32 + 1.0, 10.0 * (r as f32 + 1.0)], &Device::Cpu)?;
    say(format!("my tensor {:?}", x.to_vec1::<f32>()?));
    let s = c.allreduce(&x, ReduceOp::Sum)?;
    say(format!("allreduce(sum) = {:?}", s.to_vec1::<f32>()?));
    let rows = Tensor::full(r as f32, (r + 1, 2), &Device::Cpu)?;
    let g = c.allgather(&rows)?;
    say(format!(
        "allgather of {} rows each -> shape {:?}",
        r + 1,
        g.dims()
    ));
    let b: String = c.bcast_obj((r == 0).then_some(&"hello from rank 0".to_string()), 0)?;
    say(format!("bcast_obj: {b}"));
    if n > 1 {
        c.send(&x, (r + 1) % n)?;
        let got = c.recv((r + n - 1) % n)?;
        say(format!(
            "recv from rank {}: {:?}",
            (r + n - 1) % n,
            got.to_vec1::<f32>()?
        ));
    }
    c.barrier()
}

fn selftest(c: &Communicator) -> Result<usize> {
    let (passed, failed) = shardnet::conformance::run_all(c);
    for (name, msg) in &failed {
        eprintln!("rank {}: FAILED {name}: {msg}", c.rank());
    }
    if c.rank() == 0 {
        println!(
            "{} backend, {} ranks: {passed} passed, {} failed",
            c.backend(),
            c.size(),
            failed.len()
        );
    }
    c.barrier()?;
    Ok(failed.len())
}
