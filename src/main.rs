//! The `shardnet` command: `train`, `plan`, `plot`, `demo`, `selftest` and `bench`.

use clap::{Parser, Subcommand};
use shardnet::comm::{self, Communicator, ReduceOp};
use shardnet::models::mnist_mlp;
use shardnet::models::mnist_parallel::{Config as ParallelConfig, Split};
use shardnet::models::sharded_head::{Config, Source};
use shardnet::plot;
use shardnet::train::{Checkpointing, ModelConfig, Options, Report};
use shardnet::{Error, Result};
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

#[derive(clap::Args, Clone, serde::Serialize)]
struct RankArgs {
    /// Number of ranks for the local backend (ignored under mpiexec).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    ranks: usize,
    /// Communicator backend: local (threads), mpi (under mpiexec) or auto.
    #[arg(long, default_value = "auto", value_parser = ["auto", "local", "mpi"])]
    comm: String,
}

/// The flags every model takes. `--epochs`, `--batch-size` and `--lr` have
/// no default here: each model's subcommand sets its own.
#[derive(clap::Args, Clone, serde::Serialize)]
struct TrainArgs {
    #[command(flatten)]
    ranks: RankArgs,
    /// Epochs over the training set.
    #[arg(long)]
    epochs: usize,
    /// Stop after this many steps in all.
    #[arg(long)]
    max_steps: Option<usize>,
    /// Examples per step (the global batch).
    #[arg(long)]
    batch_size: usize,
    /// The optimizer's learning rate (at the start, for a schedule that decays).
    #[arg(long, allow_negative_numbers = true)]
    lr: f64,
    /// The optimizer: sgd (with momentum and weight decay, PyTorch's
    /// torch.optim.SGD) or adam (torch.optim.Adam).
    #[arg(long, default_value = "adam", value_parser = ["sgd", "adam"])]
    optimizer: String,
    /// SGD's momentum μ, in [0, 1).
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    momentum: f64,
    /// L2 weight decay λ added to the gradient [default: 5e-4 with sgd, 0
    /// with adam].
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f64>,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Steps at the start excluded from samples/s (for benchmarks; they still train).
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Write per-epoch metrics, peak memory and bytes per step as JSON to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Skip the test-set evaluation after each epoch.
    #[arg(long)]
    no_eval: bool,
    /// Write sharded checkpoints here (every rank its own file, one
    /// manifest): every --checkpoint-every steps, after the last step, and
    /// when stopped by SIGINT/SIGTERM.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (needs --checkpoint-dir) [default: only at
    /// the end and when stopped].
    #[arg(long, value_parser = at_least_one)]
    checkpoint_every: Option<usize>,
    /// Checkpoints to keep in --checkpoint-dir (the newest).
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    keep: usize,
    /// Continue from a checkpoint: a checkpoint's directory, or a
    /// --checkpoint-dir (its newest); any number of ranks. --epochs and
    /// --max-steps count the whole run.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Append per-step and per-epoch metrics as JSON lines to this
    /// directory (`shardnet plot` draws them).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Stop after this many steps in all, as SIGINT would: a checkpoint is
    /// written (with --checkpoint-dir) and the learning-rate schedule stays
    /// the whole run's, so --resume continues it exactly (for job time
    /// limits).
    #[arg(long, value_parser = at_least_one)]
    stop_after: Option<usize>,
}

/// Where MNIST is read from.
#[derive(clap::Args, Clone, serde::Serialize)]
struct DataArgs {
    /// Directory holding mnist/ (default: $SHARDNET_DATA, else a download cache).
    #[arg(long)]
    data: Option<PathBuf>,
}

/// The flags of the sharded classifier head (face-head, mnist-arcface).
/// `--dim` has no default here: each model sets its own.
#[derive(clap::Args, Clone, serde::Serialize)]
struct HeadArgs {
    /// Feature dimension d (the backbone's output, the head's input).
    #[arg(long)]
    dim: usize,
    /// The head's margin: arcface, cosface, sphereface, combined, normalized or none.
    #[arg(long, default_value = "arcface")]
    margin: String,
    /// Logit scale s [default: the margin's: 64; 30 for normalized, 1 for none].
    #[arg(long, allow_negative_numbers = true)]
    scale: Option<f64>,
    /// Precision of features, feature gradients and logits: f32, bf16 or f16
    /// (master weights stay f32; half precision uses a dynamic loss scale).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Partial FC: the fraction r of each shard's classes used per step (1: full head).
    #[arg(long, default_value_t = 1.0)]
    sample_rate: f64,
    /// Accumulate the head's weight gradient and step after backward,
    /// instead of the fused update inside backward (which holds no gradient
    /// of the shard): for comparison.
    #[arg(long)]
    unfused_update: bool,
}

/// This model's default for a flag of a shared struct (where the struct
/// leaves it without one).
fn default(value: &'static str) -> impl FnOnce(clap::Arg) -> clap::Arg {
    move |a| a.required(false).default_value(value)
}

/// `shardnet train mnist-mlp`.
#[derive(clap::Args, Clone, serde::Serialize)]
struct MlpArgs {
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    data: DataArgs,
    /// Hidden units U.
    #[arg(long, default_value_t = 100)]
    units: usize,
    /// Pipeline stages of the MLP [default: 2, or the number of ranks if more].
    #[arg(long)]
    stages: Option<usize>,
    /// Micro-batches per step (GPipe pipelining); 1: none.
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// The dataset: mnist, or fashion-mnist (Debian's dataset-fashion-mnist, or --data).
    #[arg(long, default_value = "mnist")]
    dataset: String,
    /// Write every trained parameter to this safetensors file.
    #[arg(long)]
    save_params: Option<PathBuf>,
    /// How the MLP is split: pipeline (ChainerMN's stages over the ranks)
    /// or tensor (784–U–U–10, each layer's weight split over the ranks,
    /// Megatron-style; --stages and --micro-batches do not apply).
    #[arg(long, default_value = "pipeline", value_parser = ["pipeline", "tensor"])]
    parallel: String,
}

/// `shardnet train mnist-mlp-parallel`.
#[derive(clap::Args, Clone, serde::Serialize)]
struct MlpParallelArgs {
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    data: DataArgs,
    /// Hidden units U (each part's MLPs are U/2 wide).
    #[arg(long, default_value_t = 1000)]
    units: usize,
    /// The dataset: mnist, or fashion-mnist.
    #[arg(long, default_value = "mnist")]
    dataset: String,
    /// Write every trained parameter to this safetensors file.
    #[arg(long)]
    save_params: Option<PathBuf>,
}

/// `shardnet train face-head`.
#[derive(clap::Args, Clone, serde::Serialize)]
struct FaceHeadArgs {
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    head: HeadArgs,
    /// Number of identities C (classes of the head).
    #[arg(long, default_value_t = 10_000)]
    classes: usize,
    /// Steps per reported epoch.
    #[arg(long, default_value_t = 100)]
    steps_per_epoch: usize,
    /// The naive head instead (logits concatenated on rank 0, which alone
    /// computes the loss; plain logits, f32): for comparison.
    #[arg(long)]
    naive_head: bool,
}

/// `shardnet train mnist-arcface`.
#[derive(clap::Args, Clone, serde::Serialize)]
struct ArcfaceArgs {
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    head: HeadArgs,
    #[command(flatten)]
    data: DataArgs,
}

/// `shardnet train vgg16`'s own flags.
#[derive(clap::Args, Clone, serde::Serialize)]
struct Vgg16Args {
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    data: DataArgs,
    /// How each convolution's channels are split over the ranks of a group:
    /// grouped (ChainerMN's ParallelConvolution2D: a grouped convolution),
    /// output or input (exact), none (replicated).
    #[arg(long, default_value = "output", value_parser = ["grouped", "output", "input", "none"])]
    parallel_conv: String,
    /// Channel multiplier: every layer has max(1, round(c·W)) channels.
    #[arg(long, default_value_t = 1.0)]
    width: f64,
    /// Images: cifar10 (binary files in --data DIR), synthetic (seeded
    /// 3×32×32), mnist or fashion-mnist (padded to 32×32).
    #[arg(long, default_value = "mnist", value_parser = ["cifar10", "synthetic", "mnist", "fashion-mnist"])]
    dataset: String,
    /// Leave out batch normalisation (the convolutions then have biases).
    #[arg(long)]
    no_batch_norm: bool,
    /// Data-parallel groups G: the ranks form G groups of ranks/G, channel
    /// parallel inside a group, data parallel across groups.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    data_parallel: usize,
    /// Dropout probability in the classifier.
    #[arg(long, default_value_t = 0.5)]
    dropout: f64,
    /// Training examples of --dataset synthetic (its test set is a fifth of it).
    #[arg(long, default_value_t = 10_000, value_parser = at_least_one)]
    synthetic_examples: usize,
}

/// The models `shardnet train` knows, each with exactly its flags.
#[derive(Subcommand)]
enum TrainCommand {
    /// ChainerMN's model-parallel MLP on MNIST: its stages (Linear + relu)
    /// split over the ranks, activations sent on, logits sent back to rank 0.
    #[command(
        mut_arg("epochs", default("5")),
        mut_arg("batch_size", default("100")),
        mut_arg("lr", default("1e-3"))
    )]
    MnistMlp(MlpArgs),
    /// Chainer's MnistMLPParallel: four MLPs, two parts on 1 or 2 ranks (each
    /// its own device), joined by copies: h = z0 + z1 on both, y = y0 + y1
    /// on rank 0.
    #[command(
        mut_arg("epochs", default("1")),
        mut_arg("batch_size", default("100")),
        mut_arg("lr", default("1e-3"))
    )]
    MnistMlpParallel(MlpParallelArgs),
    /// The memory-balanced sharded classifier on synthetic identities: a
    /// data-parallel MLP backbone, the head's classes split over the ranks;
    /// cosine learning-rate decay.
    #[command(
        mut_arg("epochs", default("1")),
        mut_arg("batch_size", default("256")),
        mut_arg("lr", default("1e-2")),
        mut_arg("dim", default("512"))
    )]
    FaceHead(FaceHeadArgs),
    /// The memory-balanced sharded classifier with ArcFace on MNIST: MLP
    /// 784–512–512–d backbone, 10 classes; cosine learning-rate decay.
    #[command(
        mut_arg("epochs", default("5")),
        mut_arg("batch_size", default("128")),
        mut_arg("lr", default("1e-3")),
        mut_arg("dim", default("64")),
        mut_arg("scale", |a| default("30")(a).help("Logit scale s")),
    )]
    MnistArcface(ArcfaceArgs),
    /// VGG16 for 32×32 images with channel-parallel convolutions (ChainerMN's
    /// channel-wise parallel example), optionally on a grid with data parallelism.
    #[command(
        mut_arg("epochs", default("1")),
        mut_arg("batch_size", default("32")),
        mut_arg("lr", default("1e-3"))
    )]
    Vgg16(Vgg16Args),
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
    /// training; exit 1 if it does not fit.
    Plan {
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

/// A count flag's value: a whole number, at least 1.
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(v) => Ok(v),
        Err(_) => Err("not a whole number".into()),
    }
}

/// A duration flag's value: a finite number of seconds > 0.
fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("give a number of seconds greater than 0".into()),
    }
}

fn main() {
    shardnet::tune_allocator();
    let cli = Cli::parse();
    // A bad SHARDNET_TIMEOUT or SHARDNET_KERNELS is refused before anything
    // starts.
    let checked = comm::timeout().and_then(|_| shardnet::kernels::check_env());
    if let Err(e) = checked.and_then(|_| dispatch(cli.command)) {
        eprintln!("shardnet: {e}");
        std::process::exit(1);
    }
}

fn dispatch(cmd: Command) -> Result<()> {
    match cmd {
        Command::Train { model } => {
            share_cores(&model.common().ranks);
            train(&model)
        }
        Command::Plan { model } => plan(&model),
        Command::Consolidate { checkpoint, out } => {
            shardnet::output::check_outputs(&[("OUT", out.as_path())])?;
            let (n, bytes) = shardnet::train::checkpoint::consolidate(&checkpoint, &out)?;
            println!(
                "wrote {n} tensors ({:.1} MB) to {}",
                bytes as f64 / 1e6,
                out.display()
            );
            Ok(())
        }
        Command::Demo(a) => {
            share_cores(&a);
            comm::run(&a.comm, a.ranks, demo).map(|_| ())
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
            let results = comm::run(&ranks.comm, ranks.ranks, |c| selftest(&c))?;
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
        Command::Bench {
            what: BenchWhat::Gemm { json, reps },
        } => {
            // One thread: the rate one rank gets from one core.
            std::env::set_var("RAYON_NUM_THREADS", "1");
            shardnet::bench::gemm(json, reps)
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
            shardnet::bench::conv(batch, reps)
        }
    }
}

impl TrainCommand {
    /// The flags every model takes.
    fn common(&self) -> &TrainArgs {
        match self {
            TrainCommand::MnistMlp(a) => &a.train,
            TrainCommand::MnistMlpParallel(a) => &a.train,
            TrainCommand::FaceHead(a) => &a.train,
            TrainCommand::MnistArcface(a) => &a.train,
            TrainCommand::Vgg16(a) => &a.train,
        }
    }
}

impl TrainArgs {
    /// The model's loop settings (its learning-rate schedule) with these
    /// flags applied.
    fn options(&self, model: Options) -> Options {
        Options {
            epochs: self.epochs,
            max_steps: self.max_steps,
            warmup_steps: self.warmup_steps,
            lr: self.lr,
            optimizer: self.optimizer_config(),
            evaluate: !self.no_eval,
            progress: true,
            checkpoint: self.checkpoint_dir.as_ref().map(|dir| Checkpointing {
                dir: dir.clone(),
                every: self.checkpoint_every,
                keep: self.keep,
            }),
            resume: self.resume.clone(),
            log_dir: self.log_dir.clone(),
            stop_after: self.stop_after,
            ..model
        }
    }

    /// `--optimizer`, `--momentum`, `--weight-decay` (checked by
    /// `Options::validate`).
    fn optimizer_config(&self) -> shardnet::optim::OptimizerConfig {
        use shardnet::optim::{OptimizerConfig, OptimizerKind};
        let kind = if self.optimizer == "sgd" {
            OptimizerKind::Sgd
        } else {
            OptimizerKind::Adam
        };
        let default_decay = match kind {
            OptimizerKind::Sgd => OptimizerConfig::sgd().weight_decay,
            OptimizerKind::Adam => 0.0,
        };
        OptimizerConfig {
            kind,
            momentum: self.momentum,
            weight_decay: self.weight_decay.unwrap_or(default_decay),
        }
    }

    /// Refuse, before any rank starts, checkpoint and log flags that cannot
    /// work: --checkpoint-every without a directory, a directory that cannot
    /// be made or written, a --resume without a checkpoint.
    fn check_files(&self) -> Result<()> {
        if self.checkpoint_every.is_some() && self.checkpoint_dir.is_none() {
            return Err(Error::Usage(
                "--checkpoint-every needs --checkpoint-dir DIR (where to write them)".into(),
            ));
        }
        for (flag, dir) in [
            ("--checkpoint-dir", &self.checkpoint_dir),
            ("--log-dir", &self.log_dir),
        ] {
            if let Some(d) = dir {
                std::fs::create_dir_all(d)
                    .map_err(|e| Error::Usage(format!("{flag} {}: {e}", d.display())))?;
                shardnet::output::check_writable(flag, &d.join("probe"))?;
            }
        }
        if let Some(r) = &self.resume {
            shardnet::train::checkpoint::find(r)?;
        }
        if let Some(d) = &self.checkpoint_dir {
            shardnet::train::checkpoint::check_dir(d, self.resume.as_deref())?;
        }
        Ok(())
    }
}

impl TrainCommand {
    /// The model's name, as on the command line.
    fn name(&self) -> &'static str {
        match self {
            TrainCommand::MnistMlp(_) => "mnist-mlp",
            TrainCommand::MnistMlpParallel(_) => "mnist-mlp-parallel",
            TrainCommand::FaceHead(_) => "face-head",
            TrainCommand::MnistArcface(_) => "mnist-arcface",
            TrainCommand::Vgg16(_) => "vgg16",
        }
    }

    /// The run's settings as (flag, value), for the ranks to agree on:
    /// every flag but those of the launch (`--ranks`, `--comm`) and the
    /// data directory (which may differ between machines; the data's shape
    /// is agreed on when read).
    fn settings(&self) -> Vec<(String, String)> {
        let value = match self {
            TrainCommand::MnistMlp(a) => serde_json::to_value(a),
            TrainCommand::MnistMlpParallel(a) => serde_json::to_value(a),
            TrainCommand::FaceHead(a) => serde_json::to_value(a),
            TrainCommand::MnistArcface(a) => serde_json::to_value(a),
            TrainCommand::Vgg16(a) => serde_json::to_value(a),
        };
        let mut out = vec![("model".to_string(), self.name().to_string())];
        fn leaves(v: &serde_json::Value, out: &mut Vec<(String, String)>) {
            if let serde_json::Value::Object(m) = v {
                for (k, v) in m {
                    match v {
                        serde_json::Value::Object(_) => leaves(v, out),
                        _ if ["ranks", "comm", "data"].contains(&k.as_str()) => {}
                        _ => out.push((format!("--{}", k.replace('_', "-")), v.to_string())),
                    }
                }
            }
        }
        if let Ok(v) = value {
            leaves(&v, &mut out);
        }
        out
    }

    /// `--save-params FILE`, for the models that take it.
    fn save_params(&self) -> Option<&std::path::Path> {
        match self {
            TrainCommand::MnistMlp(a) => a.save_params.as_deref(),
            TrainCommand::MnistMlpParallel(a) => a.save_params.as_deref(),
            _ => None,
        }
    }

    /// Every output file of this run, with its flag.
    fn outputs(&self) -> Vec<(&'static str, &std::path::Path)> {
        let mut out = Vec::new();
        if let Some(p) = &self.common().metrics {
            out.push(("--metrics", p.as_path()));
        }
        if let Some(p) = self.save_params() {
            out.push(("--save-params", p));
        }
        out
    }
}

fn train(model: &TrainCommand) -> Result<()> {
    // Every output is checked before the first step, not after the run.
    shardnet::output::check_outputs(&model.outputs())?;
    model.common().check_files()?;
    shardnet::train::stop::install_signal_handlers()?;
    let settings = model.settings();
    let report = match model {
        TrainCommand::MnistMlp(a) if a.parallel == "tensor" => {
            if a.stages.is_some() || a.micro_batches != 1 {
                return Err(Error::Usage(
                    "--parallel tensor splits every layer over all the ranks: --stages and \
                     --micro-batches belong to --parallel pipeline"
                        .into(),
                ));
            }
            let mut cfg = parallel_config(Split::Tensor, &a.train, &a.data, a.units, &a.dataset)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
        TrainCommand::MnistMlp(a) => {
            let mut cfg = mlp_config(a)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
        TrainCommand::MnistMlpParallel(a) => {
            let mut cfg = parallel_config(Split::Chainer, &a.train, &a.data, a.units, &a.dataset)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
        TrainCommand::FaceHead(a) => {
            let mut cfg = face_head_config(a)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
        TrainCommand::MnistArcface(a) => {
            let mut cfg = arcface_config(a)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
        TrainCommand::Vgg16(a) => {
            let mut cfg = vgg16_config(a)?;
            cfg.train.settings = settings;
            launch(&a.train, &cfg)?
        }
    };
    if let (Some(path), Some(r)) = (model.save_params(), &report) {
        save_safetensors(path, &r.params)?;
    }
    let metrics = report.map(|r| r.metrics);
    let interrupted = metrics.as_ref().and_then(|m| m.interrupted.clone());
    if let (Some(path), Some(m)) = (&model.common().metrics, &metrics) {
        let json =
            serde_json::to_string_pretty(m).map_err(|e| Error::Io(format!("metrics: {e}")))?;
        shardnet::output::write_atomic(path, json.as_bytes())?;
    }
    if let (Some(i), Some(m)) = (interrupted, &metrics) {
        let kept = match &model.common().metrics {
            Some(p) => format!(", written to {}", p.display()),
            None => String::new(),
        };
        let by = if i.signal.starts_with("--") {
            "as asked by"
        } else {
            "by"
        };
        eprintln!(
            "shardnet: stopped {by} {} after step {}: {} finished epoch(s) kept{kept}",
            i.signal,
            i.after_step,
            m.epochs.len()
        );
        match &i.checkpoint {
            Some(dir) => eprintln!(
                "shardnet: checkpoint of step {} written to {}; to continue, run\n  {}",
                i.after_step,
                dir.display(),
                resume_command(dir)
            ),
            None => eprintln!(
                "shardnet: no checkpoint was written (no --checkpoint-dir): the run cannot be \
                 continued; give --checkpoint-dir DIR to be able to"
            ),
        }
        // The shell's convention: 128 + the signal's number (a planned
        // --stop-after is a success).
        if let Some(signal) = shardnet::train::stop::stop_requested() {
            std::process::exit(128 + signal);
        }
    }
    Ok(())
}

/// This command line with `--resume dir` (in place of any `--resume`).
fn resume_command(dir: &std::path::Path) -> String {
    let mut args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--resume") {
        args.drain(i..(i + 2).min(args.len()));
    }
    args.retain(|a| !a.starts_with("--resume="));
    args.push("--resume".into());
    args.push(dir.display().to_string());
    let line = args.join(" ");
    // Under mpiexec, with its launch (any number of ranks will do).
    match comm::launcher_size() {
        Some(n) if n > 1 => format!("mpiexec -n {n} {line}    (or any other number of ranks)"),
        _ => format!("{line}    (or any other --ranks)"),
    }
}

/// `mnist-mlp`'s configuration from its flags.
fn mlp_config(a: &MlpArgs) -> Result<mnist_mlp::Config> {
    Ok(mnist_mlp::Config {
        units: a.units,
        stages: a.stages,
        batch_size: a.train.batch_size,
        micro_batches: a.micro_batches,
        seed: a.train.seed,
        data: a.data.data.clone(),
        dataset: a.dataset.parse()?,
        train: a.train.options(mnist_mlp::Config::default().train),
    })
}

/// `face-head`'s configuration from its flags.
fn face_head_config(a: &FaceHeadArgs) -> Result<Config> {
    let mut cfg = head_config(Config::face_head(a.classes, a.head.dim), &a.train, &a.head)?;
    cfg.source = Source::Synthetic {
        steps_per_epoch: a.steps_per_epoch,
    };
    cfg.naive = a.naive_head;
    Ok(cfg)
}

/// `mnist-arcface`'s configuration from its flags.
fn arcface_config(a: &ArcfaceArgs) -> Result<Config> {
    let mut cfg = Config::mnist_arcface(a.data.data.clone());
    cfg.dim = a.head.dim;
    head_config(cfg, &a.train, &a.head)
}

/// The MLP split within its layers (`mnist-mlp-parallel`, `mnist-mlp
/// --parallel tensor`), with the flags applied.
fn parallel_config(
    split: Split,
    t: &TrainArgs,
    d: &DataArgs,
    units: usize,
    dataset: &str,
) -> Result<ParallelConfig> {
    let mut cfg = ParallelConfig::new(split);
    cfg.units = units;
    cfg.batch_size = t.batch_size;
    cfg.seed = t.seed;
    cfg.data = d.data.clone();
    cfg.dataset = dataset.parse()?;
    cfg.train = t.options(cfg.train.clone());
    cfg.validate()?;
    Ok(cfg)
}

fn vgg16_config(a: &Vgg16Args) -> Result<shardnet::models::vgg16::Config> {
    let split = a.parallel_conv.parse().map_err(Error::Usage)?;
    let mut cfg = shardnet::models::vgg16::Config::new(split);
    cfg.width = a.width;
    cfg.batch_norm = !a.no_batch_norm;
    cfg.data_parallel = a.data_parallel;
    cfg.dropout = a.dropout;
    cfg.batch_size = a.train.batch_size;
    cfg.seed = a.train.seed;
    cfg.dataset = a.dataset.parse()?;
    cfg.data = a.data.data.clone();
    cfg.synthetic_examples = a.synthetic_examples;
    cfg.train = a.train.options(cfg.train.clone());
    cfg.validate()?;
    // Thread ranks: refused before any starts (under MPI, every rank checks).
    if a.train.ranks.comm != "mpi" {
        cfg.grid(a.train.ranks.ranks)?;
    }
    Ok(cfg)
}

/// Train `cfg` with the library's one runner on the ranks of `t`.
fn launch<C: ModelConfig>(t: &TrainArgs, cfg: &C) -> Result<Option<Report>> {
    shardnet::train::launch(&t.ranks.comm, t.ranks.ranks, cfg)
}

/// Write named tensors to `path` as safetensors, atomically.
fn save_safetensors(
    path: &std::path::Path,
    params: &std::collections::BTreeMap<String, candle_core::Tensor>,
) -> Result<()> {
    let params: std::collections::HashMap<_, _> = params.clone().into_iter().collect();
    shardnet::output::write_atomic_with(path, |tmp| {
        Ok(candle_core::safetensors::save(&params, tmp)?)
    })
}

/// A head model's `cfg` with the common and head flags applied.
fn head_config(mut cfg: Config, t: &TrainArgs, h: &HeadArgs) -> Result<Config> {
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
    cfg.fused_update = !h.unfused_update;
    cfg.batch_size = t.batch_size;
    cfg.seed = t.seed;
    cfg.train = t.options(cfg.train);
    Ok(cfg)
}

/// `shardnet plan <model>`: the memory plan of the run `shardnet train
/// <model>` with the same flags would make, without training. Ranks: the
/// launcher's (under mpiexec, with its ranks per node), else `--ranks`
/// (thread ranks of one process; with `--comm mpi`, processes on this node).
fn plan(model: &TrainCommand) -> Result<()> {
    use shardnet::train::plan::{self, MemoryPlan, Placement};
    let r = &model.common().ranks;
    let launched = comm::launcher_size().filter(|&n| n > 1);
    let placement = match (r.comm.as_str(), launched) {
        ("local", _) | ("auto", None) => Placement::local(r.ranks),
        (_, Some(n)) => Placement::mpi(n, comm::launcher_local_size().unwrap_or(n)),
        (_, None) => Placement::mpi(r.ranks, r.ranks),
    };
    let p = match model {
        TrainCommand::MnistMlp(a) if a.parallel == "pipeline" => {
            let cfg = mlp_config(a)?;
            cfg.validate()?;
            MemoryPlan::new(&cfg, placement)
        }
        TrainCommand::Vgg16(a) => MemoryPlan::new(&vgg16_config(a)?, placement),
        TrainCommand::MnistMlp(_) | TrainCommand::MnistMlpParallel(_) => {
            return Err(Error::Usage(format!(
                "shardnet plan has no memory model of {} yet (it knows mnist-mlp's pipeline, \
                 face-head, mnist-arcface and vgg16)",
                match model {
                    TrainCommand::MnistMlp(_) => "mnist-mlp --parallel tensor",
                    _ => "mnist-mlp-parallel",
                }
            )))
        }
        TrainCommand::FaceHead(a) => {
            let cfg = face_head_config(a)?;
            cfg.validate()?;
            MemoryPlan::new(&cfg, placement)
        }
        TrainCommand::MnistArcface(a) => {
            let cfg = arcface_config(a)?;
            cfg.validate()?;
            MemoryPlan::new(&cfg, placement)
        }
    };
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
    use candle_core::Tensor;
    let (r, n) = (c.rank(), c.size());
    let say = |what: String| println!("[{} rank {r}/{n}] {what}", c.backend());
    let x = Tensor::new(&[r as f32 + 1.0, 10.0 * (r as f32 + 1.0)], c.device())?;
    say(format!("my tensor {:?}", x.to_vec1::<f32>()?));
    let s = c.allreduce(&x, ReduceOp::Sum)?;
    say(format!("allreduce(sum) = {:?}", s.to_vec1::<f32>()?));
    let rows = Tensor::full(r as f32, (r + 1, 2), c.device())?;
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
    let tally = shardnet::conformance::run_all(c)?;
    // Every rank holds the same outcome (the ranks agree after each case):
    // rank 0 reports it.
    if c.rank() == 0 {
        for (name, msg) in &tally.failed {
            eprintln!("FAILED {name}: {msg}");
        }
        if c.size() > shardnet::conformance::MAX_RANKS {
            println!(
                "note: u8 sums are checked on up to {} ranks only (a larger sum does not fit in u8)",
                shardnet::conformance::MAX_RANKS
            );
        }
        println!(
            "{} backend, {} ranks: {} passed, {} failed",
            c.backend(),
            c.size(),
            tally.passed,
            tally.failed.len()
        );
    }
    c.barrier()?;
    Ok(tally.failed.len())
}
