//! `shardnet train <model>`: flags to a model's configuration (the CLI owns
//! the flag names), every output checked before the first step, the
//! library's one runner, then the metrics and `--save-params` written and
//! the way to resume a stopped run.

use super::args::{
    ArcfaceArgs, DataArgs, FaceHeadArgs, GptArgs, HeadArgs, MlpArgs, TrainArgs, TrainCommand,
    Vgg16Args,
};
use shardnet::comm;
use shardnet::models::gpt::Tokens;
use shardnet::models::mnist_mlp;
use shardnet::models::mnist_parallel::{Config as ParallelConfig, Split};
use shardnet::models::sharded_head::{parse_precision, Config, Source};
use shardnet::train::{Checkpointing, ModelConfig, Options, Report};
use shardnet::{Error, Result};
use std::path::PathBuf;

impl TrainCommand {
    /// The flags every model takes.
    pub(crate) fn common(&self) -> &TrainArgs {
        match self {
            TrainCommand::MnistMlp(a) => &a.train,
            TrainCommand::MnistMlpParallel(a) => &a.train,
            TrainCommand::FaceHead(a) => &a.train,
            TrainCommand::MnistArcface(a) => &a.train,
            TrainCommand::Vgg16(a) => &a.train,
            TrainCommand::Gpt(a) => &a.train,
        }
    }
}

impl TrainArgs {
    /// Where checkpoints go: `--checkpoint-dir`, or without it, when
    /// resuming, the directory the resumed checkpoint is in (the run goes
    /// on where it was).
    fn checkpoint_dir(&self) -> Option<PathBuf> {
        self.checkpoint_dir.clone().or_else(|| {
            let r = self.resume.as_ref()?;
            let is_checkpoint = r.join(shardnet::train::checkpoint::MANIFEST).is_file();
            Some(match r.parent() {
                Some(p) if is_checkpoint && p.as_os_str().is_empty() => PathBuf::from("."),
                Some(p) if is_checkpoint => p.to_path_buf(),
                _ => r.clone(),
            })
        })
    }

    /// The model's loop settings (its learning-rate schedule) with these
    /// flags applied.
    fn options(&self, model: Options) -> Result<Options> {
        Ok(Options {
            epochs: self.epochs,
            max_steps: self.max_steps,
            warmup_steps: self.warmup_steps,
            lr: self.lr,
            optimizer: self.optimizer_config()?,
            evaluate: !self.no_eval,
            progress: true,
            checkpoint: self.checkpoint_dir().map(|dir| Checkpointing {
                dir,
                every: self.checkpoint_every,
                keep: self.keep,
            }),
            resume: self.resume.clone(),
            log_dir: self.log_dir.clone(),
            stop_after: self.stop_after,
            ..model
        })
    }

    /// `--optimizer`, `--momentum`, `--weight-decay` (checked by
    /// `Options::validate`).
    fn optimizer_config(&self) -> Result<shardnet::optim::OptimizerConfig> {
        use shardnet::optim::{OptimizerConfig, OptimizerKind};
        let kind: OptimizerKind = self.optimizer.parse()?;
        let defaults = match kind {
            OptimizerKind::Sgd => OptimizerConfig::sgd(),
            OptimizerKind::Adam => OptimizerConfig::default(),
            OptimizerKind::AdamW => OptimizerConfig::adamw(),
        };
        if let (Some(m), OptimizerKind::Adam | OptimizerKind::AdamW) = (self.momentum, kind) {
            return Err(Error::Usage(format!(
                "--momentum {m} applies to --optimizer sgd; Adam's moments use fixed betas \
                 (0.9, 0.999): leave --momentum out, or add --optimizer sgd"
            )));
        }
        Ok(OptimizerConfig {
            kind,
            momentum: self.momentum.unwrap_or(super::args::DEFAULT_MOMENTUM),
            weight_decay: self.weight_decay.unwrap_or(defaults.weight_decay),
        })
    }

    /// Refuse, before any rank starts, checkpoint and log flags that cannot
    /// work: --checkpoint-every without a directory, a directory that cannot
    /// be made or written, a --resume without a checkpoint.
    fn check_files(&self) -> Result<()> {
        let checkpoint_dir = self.checkpoint_dir();
        // A directory another run writes: said first, whatever else is
        // wrong with it then (it may hold no checkpoint yet).
        for (flag, dir) in [
            ("--checkpoint-dir", &checkpoint_dir),
            ("--log-dir", &self.log_dir),
        ] {
            if let Some(d) = dir {
                shardnet::output::DirLock::check_free(flag, d)?;
            }
        }
        if let Some(r) = &self.resume {
            shardnet::train::checkpoint::find(r)?;
        }
        if self.checkpoint_every.is_some() && checkpoint_dir.is_none() {
            return Err(Error::Usage(
                "--checkpoint-every needs --checkpoint-dir DIR (where to write them)".into(),
            ));
        }
        for (flag, dir) in [
            ("--checkpoint-dir", &checkpoint_dir),
            ("--log-dir", &self.log_dir),
        ] {
            if let Some(d) = dir {
                shardnet::output::make_dir(flag, d)?;
                shardnet::output::check_writable(flag, &d.join("probe"))?;
            }
        }
        if let Some(d) = &checkpoint_dir {
            shardnet::train::checkpoint::check_dir(d, self.resume.as_deref())?;
        }
        Ok(())
    }
}

impl TrainCommand {
    /// The model's name, as on the command line.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            TrainCommand::MnistMlp(_) => "mnist-mlp",
            TrainCommand::MnistMlpParallel(_) => "mnist-mlp-parallel",
            TrainCommand::FaceHead(_) => "face-head",
            TrainCommand::MnistArcface(_) => "mnist-arcface",
            TrainCommand::Vgg16(_) => "vgg16",
            TrainCommand::Gpt(_) => "gpt",
        }
    }

    /// The run's settings as (flag, value), for the ranks to agree on:
    /// every flag but those of the launch (`--ranks`, `--comm`, `--device`,
    /// `--communicator`) and the
    /// data directory (which may differ between machines; the data's shape
    /// is agreed on when read).
    fn settings(&self) -> Vec<(String, String)> {
        let value = match self {
            TrainCommand::MnistMlp(a) => serde_json::to_value(a),
            TrainCommand::MnistMlpParallel(a) => serde_json::to_value(a),
            TrainCommand::FaceHead(a) => serde_json::to_value(a),
            TrainCommand::MnistArcface(a) => serde_json::to_value(a),
            TrainCommand::Vgg16(a) => serde_json::to_value(a),
            TrainCommand::Gpt(a) => serde_json::to_value(a),
        };
        let mut out = vec![("model".to_string(), self.name().to_string())];
        fn leaves(v: &serde_json::Value, out: &mut Vec<(String, String)>) {
            if let serde_json::Value::Object(m) = v {
                for (k, v) in m {
                    match v {
                        serde_json::Value::Object(_) => leaves(v, out),
                        _ if ["ranks", "comm", "device", "communicator", "data"]
                            .contains(&k.as_str()) => {}
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

    /// `--save-params FILE`.
    fn save_params(&self) -> Option<&std::path::Path> {
        self.common().save_params.as_deref()
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

pub(crate) fn train(model: &TrainCommand) -> Result<()> {
    // Every output is checked before the first step, not after the run,
    // and none may lie inside a checkpoint.
    shardnet::output::check_outputs(&model.outputs())?;
    let mut outputs = model.outputs();
    if let Some(d) = &model.common().log_dir {
        outputs.push(("--log-dir", d.as_path()));
    }
    for (flag, path) in outputs {
        shardnet::output::check_outside_checkpoints(flag, path)?;
    }
    model.common().check_files()?;
    shardnet::train::stop::install_signal_handlers()?;
    let settings = model.settings();
    let report = model.configure(Launch(settings))?;
    if let (Some(path), Some(r)) = (model.save_params(), &report) {
        save_safetensors(path, &r.params)?;
    }
    let metrics = report.map(|r| r.metrics);
    let interrupted = metrics.as_ref().and_then(|m| m.interrupted.clone());
    if let (Some(path), Some(m)) = (&model.common().metrics, &metrics) {
        let json = serde_json::to_string_pretty(m).map_err(|e| Error::caused("metrics", e))?;
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
    }
    // The shell's convention on every rank, the signalled one or not (the
    // loop agreed on the signal): 128 + the signal's number, what a job
    // script and a batch scheduler read (a planned --stop-after is a
    // success).
    if let Some(signal) = shardnet::train::stop::stop_requested() {
        std::process::exit(128 + signal);
    }
    Ok(())
}

/// This command line with `--resume dir` (in place of any `--resume`).
pub(crate) fn resume_command(dir: &std::path::Path) -> String {
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
        data_parallel: a.data_parallel,
        shard_state: a.shard_state.parse()?,
        gather_block: gather_block(a)?,
        schedule: a.schedule.as_deref().map(str::parse).transpose()?,
        virtual_stages: a.virtual_stages,
        balance: a.balance.parse()?,
        seed: a.train.seed,
        data: a.data.data.clone(),
        dataset: a.dataset.parse()?,
        train: a.train.options(mnist_mlp::Config::default().train)?,
    })
}

/// `--gather-block-mib` in bytes: refused where no weight is shared out.
fn gather_block(a: &MlpArgs) -> Result<usize> {
    let Some(mib) = a.gather_block_mib else {
        return Ok(shardnet::nn::GATHER_BLOCK);
    };
    if a.shard_state != "parameters" || a.data_parallel < 2 {
        return Err(shardnet::Error::Usage(format!(
            "--gather-block-mib {mib}: only the shared-out weights of --data-parallel 2 or \
             more with --shard-state parameters are gathered; give both, or drop the flag"
        )));
    }
    Ok((mib * f64::from(1u32 << 20)).round() as usize)
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
    cfg.train = t.options(cfg.train.clone())?;
    Ok(cfg)
}

fn vgg16_config(a: &Vgg16Args) -> Result<shardnet::models::vgg16::Config> {
    let split = a.parallel_conv.parse().map_err(Error::Usage)?;
    let mut cfg = shardnet::models::vgg16::Config::new(split);
    cfg.width = a.width;
    cfg.batch_norm = !a.no_batch_norm;
    cfg.data_parallel = a.data_parallel;
    cfg.batch_norm_slices = a.local_batch_norm.then_some(a.data_parallel);
    cfg.dropout = a.dropout;
    cfg.batch_size = a.train.batch_size;
    cfg.seed = a.train.seed;
    cfg.dataset = a.dataset.parse()?;
    cfg.data = a.data.data.clone();
    cfg.synthetic_examples = a.synthetic_examples;
    cfg.shard_state = a.shard_state.parse()?;
    cfg.train = a.train.options(cfg.train.clone())?;
    Ok(cfg)
}

fn gpt_config(a: &GptArgs) -> Result<shardnet::models::gpt::Config> {
    let mut cfg = shardnet::models::gpt::Config {
        layers: a.layers,
        dim: a.dim,
        heads: a.heads,
        seq: a.seq,
        tensor_parallel: a.tensor_parallel,
        data_parallel: a.data_parallel,
        sequence_parallel: a.sequence_parallel,
        pipeline: a.pipeline,
        micro_batches: a.micro_batches,
        schedule: a.schedule.as_deref().map(str::parse).transpose()?,
        virtual_stages: a.virtual_stages,
        balance: a.balance.parse()?,
        recompute: a.recompute.parse()?,
        shard_state: a.shard_state.parse()?,
        precision: parse_precision(&a.precision)?,
        batch_size: a.train.batch_size,
        dropout: a.dropout,
        clip_grad_norm: (a.clip_grad_norm != 0.0).then_some(a.clip_grad_norm),
        corpus: a.corpus.clone(),
        tokens: match (a.tokenizer.as_str(), a.vocab_size) {
            ("bpe", v) => Tokens::Bpe {
                vocab: v.unwrap_or(1024),
            },
            (_, None) => Tokens::Bytes,
            (_, Some(v)) => {
                return Err(Error::Usage(format!(
                    "--vocab-size {v} is the size of a BPE: add --tokenizer bpe (bytes are 256)"
                )))
            }
        },
        tokenizer_copies: a
            .train
            .save_params
            .iter()
            .map(|p| shardnet::data::Tokenizer::path_beside(p))
            .collect(),
        seed: a.train.seed,
        ..Default::default()
    };
    cfg.train.schedule = shardnet::train::Schedule::WarmupCosine {
        warmup: a.lr_warmup,
    };
    cfg.train = a.train.options(cfg.train.clone())?;
    Ok(cfg)
}

/// What to do with a model's configuration once the flags are mapped onto
/// it: train it, plan it (one mapping from flags to configuration for
/// every command that takes a model).
pub(crate) trait WithConfig {
    /// What it gives back.
    type Out;
    /// Do it with `cfg`, launched by the flags `t`.
    fn with<C: ModelConfig>(self, cfg: C, t: &TrainArgs) -> Result<Self::Out>;
}

impl TrainCommand {
    /// The model's configuration from its flags, handed to `v`.
    pub(crate) fn configure<V: WithConfig>(&self, v: V) -> Result<V::Out> {
        match self {
            TrainCommand::MnistMlp(a) if a.parallel == "tensor" => {
                if a.stages.is_some()
                    || a.micro_batches != 1
                    || a.schedule.is_some()
                    || a.virtual_stages.is_some()
                    || a.balance != "counts"
                    || a.data_parallel != 1
                {
                    return Err(Error::Usage(
                        "--parallel tensor splits every layer over all the ranks: --stages, \
                         --micro-batches, --schedule, --virtual-stages, --balance and \
                         --data-parallel belong to --parallel pipeline"
                            .into(),
                    ));
                }
                let cfg = parallel_config(Split::Tensor, &a.train, &a.data, a.units, &a.dataset)?;
                v.with(cfg, &a.train)
            }
            TrainCommand::MnistMlp(a) => v.with(mlp_config(a)?, &a.train),
            TrainCommand::MnistMlpParallel(a) => {
                let cfg = parallel_config(Split::Chainer, &a.train, &a.data, a.units, &a.dataset)?;
                v.with(cfg, &a.train)
            }
            TrainCommand::FaceHead(a) => v.with(face_head_config(a)?, &a.train),
            TrainCommand::MnistArcface(a) => v.with(arcface_config(a)?, &a.train),
            TrainCommand::Vgg16(a) => v.with(vgg16_config(a)?, &a.train),
            TrainCommand::Gpt(a) => v.with(gpt_config(a)?, &a.train),
        }
    }
}

/// Train with the library's one runner, the run's settings recorded.
struct Launch(Vec<(String, String)>);

impl WithConfig for Launch {
    type Out = Option<Report>;
    fn with<C: ModelConfig>(self, mut cfg: C, t: &TrainArgs) -> Result<Option<Report>> {
        cfg.options_mut().settings = self.0;
        let setup = t.ranks.setup()?;
        shardnet::train::launch_on(&t.ranks.comm, t.ranks.ranks, &setup, &cfg)
    }
}

/// Write named tensors to `path` as safetensors, atomically.
pub(crate) fn save_safetensors(
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
    cfg.precision = parse_precision(&h.precision)?;
    cfg.sample_rate = h.sample_rate;
    cfg.fused_update = !h.unfused_update;
    cfg.shard_state = h.shard_state.parse()?;
    cfg.batch_size = t.batch_size;
    cfg.seed = t.seed;
    cfg.train = t.options(cfg.train)?;
    Ok(cfg)
}
