//! The flags of `shardnet train <model>` (and `plan <model>`): what every
//! model takes ([`TrainArgs`], [`RankArgs`]) and each model's own, as clap
//! definitions; the value parsers that refuse a bad number at parse time.

use clap::Subcommand;
use std::path::PathBuf;

#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct RankArgs {
    /// Number of ranks for the local backend (ignored under mpiexec).
    #[arg(long, default_value_t = 2, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) ranks: usize,
    /// Communicator backend: local (threads), mpi (under mpiexec) or auto.
    #[arg(long, default_value = "auto", value_parser = ["auto", "local", "mpi"])]
    pub(crate) comm: String,
    /// Where each rank computes: cpu, or cuda (rank r of a node with g GPUs
    /// on cuda:(r mod g), so ranks share GPUs when there are more ranks than
    /// GPUs; needs a build with the cuda feature: scripts/build-cuda.sh).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub(crate) device: String,
    /// The communicator between ranks: host (the --comm backend; GPU tensors
    /// through host memory), nccl (NCCL on the GPUs; needs --device cuda and
    /// the nccl feature) or hierarchical (allreduce in the node first, then
    /// across nodes, as ChainerMN's).
    #[arg(long, default_value = "host", value_parser = ["host", "nccl", "hierarchical"])]
    pub(crate) communicator: String,
}

impl RankArgs {
    /// `--device` and `--communicator`, checked against this build.
    pub(crate) fn setup(&self) -> shardnet::Result<shardnet::comm::Setup> {
        shardnet::comm::Setup::new(&self.device, &self.communicator)
    }
}

/// The flags every model takes. `--epochs`, `--batch-size` and `--lr` have
/// no default here: each model's subcommand sets its own.
#[derive(clap::Args, Clone, serde::Serialize)]
#[command(next_help_heading = "Every model's options")]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) ranks: RankArgs,
    /// Epochs over the training set.
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) epochs: usize,
    /// Stop after this many steps in all.
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) max_steps: Option<usize>,
    /// Examples per step (the global batch).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) batch_size: usize,
    /// The optimizer's learning rate (at the start, for a schedule that decays).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) lr: f64,
    /// The optimizer: sgd (with momentum and weight decay, PyTorch's
    /// torch.optim.SGD), adam (torch.optim.Adam) or adamw (Adam with
    /// decoupled weight decay, torch.optim.AdamW).
    #[arg(long, default_value = "adam", value_parser = ["sgd", "adam", "adamw"])]
    pub(crate) optimizer: String,
    /// SGD's momentum μ, in [0, 1) [default: 0.9] (with --optimizer sgd).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(serialize_with = "momentum_setting")]
    pub(crate) momentum: Option<f64>,
    /// Weight decay λ: an L2 term added to the gradient (sgd, adam), or
    /// adamw's θ ← θ(1 − lr·λ) [default: 5e-4 with sgd, 0 with adam, 0.01
    /// with adamw].
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) weight_decay: Option<f64>,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Steps at the start excluded from samples/s (for benchmarks; they still train).
    #[arg(long, default_value_t = 0, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) warmup_steps: usize,
    /// Write per-epoch metrics, peak memory and bytes per step as JSON to this file.
    #[arg(long)]
    pub(crate) metrics: Option<PathBuf>,
    /// Skip the test-set evaluation after each epoch.
    #[arg(long)]
    pub(crate) no_eval: bool,
    /// Write sharded checkpoints here (every rank its own file, one
    /// manifest): every --checkpoint-every steps, after the last step, and
    /// when stopped by SIGINT/SIGTERM.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (needs --checkpoint-dir) [default: only at
    /// the end and when stopped].
    #[arg(long, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) checkpoint_every: Option<usize>,
    /// Checkpoints to keep in --checkpoint-dir (the newest).
    #[arg(long, default_value_t = 3, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) keep: usize,
    /// Continue from a checkpoint: a checkpoint's directory, or a
    /// --checkpoint-dir (its newest); any number of ranks. --epochs and
    /// --max-steps count the whole run. Without --checkpoint-dir, the run's
    /// checkpoints go on in the directory resumed from.
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// Append per-step and per-epoch metrics as JSON lines to this
    /// directory (`shardnet plot` draws them).
    #[arg(long)]
    pub(crate) log_dir: Option<PathBuf>,
    /// Stop after this many steps in all, as SIGINT would: a checkpoint is
    /// written (with --checkpoint-dir) and the learning-rate schedule stays
    /// the whole run's, so --resume continues it exactly (for job time
    /// limits).
    #[arg(long, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) stop_after: Option<usize>,
    /// Write every trained parameter, whole (shards joined), to this
    /// safetensors file when the run ends (rank 0 writes it).
    #[arg(long)]
    pub(crate) save_params: Option<PathBuf>,
}

/// Where MNIST is read from.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct DataArgs {
    /// Directory holding mnist/ (default: $SHARDNET_DATA, else a download cache).
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
}

/// The flags of the sharded classifier head (face-head, mnist-arcface).
/// `--dim` has no default here: each model sets its own.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct HeadArgs {
    /// Feature dimension d (the backbone's output, the head's input).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) dim: usize,
    /// The head's margin: arcface, cosface, sphereface, combined, normalized or none.
    #[arg(long, default_value = "arcface")]
    pub(crate) margin: String,
    /// Logit scale s [default: the margin's: 64; 30 for normalized, 1 for none].
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) scale: Option<f64>,
    /// Precision of features, feature gradients and logits: f32, bf16 or f16
    /// (master weights stay f32; half precision uses a dynamic loss scale).
    #[arg(long, default_value = "f32")]
    pub(crate) precision: String,
    /// Partial FC: the fraction r of each shard's classes used per step (1: full head).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) sample_rate: f64,
    /// Accumulate the head's weight gradient and step after backward,
    /// instead of the fused update inside backward (which holds no gradient
    /// of the shard): for comparison.
    #[arg(long)]
    pub(crate) unfused_update: bool,
    /// What the ranks share out of the backbone: none (each holds it whole,
    /// its gradients allreduced); gradients (a share of each weight's
    /// gradient and optimizer state, reduce-scattered as each layer's
    /// backward ends; the weights gathered whole once a step: ZeRO stage 2);
    /// or parameters (the weights shared out too, each gathered only while
    /// its layer runs: ZeRO stage 3, FSDP's design). The head is sharded by
    /// class whatever this is.
    #[arg(long, default_value = "none", value_parser = ["none", "gradients", "parameters"])]
    pub(crate) shard_state: String,
}

/// This model's default for a flag of a shared struct (where the struct
/// leaves it without one).
pub(crate) fn default(value: &'static str) -> impl FnOnce(clap::Arg) -> clap::Arg {
    move |a| a.required(false).default_value(value)
}

/// `shardnet train mnist-mlp`.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct MlpArgs {
    #[command(flatten)]
    pub(crate) data: DataArgs,
    /// Hidden units U.
    #[arg(long, default_value_t = 100, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) units: usize,
    /// Pipeline stages of the MLP [default: 2, or the number of ranks if more].
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) stages: Option<usize>,
    /// Micro-batches per step (pipelining); 1: none.
    #[arg(long, default_value_t = 1, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) micro_batches: usize,
    /// Data-parallel groups G: the ranks form G pipelines of ranks/G ranks,
    /// each training on its share of every batch (--micro-batches each).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) data_parallel: usize,
    /// What the data-parallel groups shard: none (each holds Adam's whole
    /// state; gradients allreduced); optimizer (each holds and updates its
    /// rows' moments only: ZeRO stage 1); gradients (each holds a share of
    /// every weight's gradient and moments, reduce-scattered after each
    /// micro-batch's backward; the weights gathered whole once a step: ZeRO
    /// stage 2); or parameters (the weights shared out too, each gathered
    /// whole only while its layer runs: ZeRO stage 3, FSDP's design).
    /// Nothing without --data-parallel.
    #[arg(long, default_value = "optimizer", value_parser = ["none", "optimizer", "gradients", "parameters"])]
    pub(crate) shard_state: String,
    /// With --shard-state parameters: the most MiB of a weight a layer
    /// gathers at a time [default: 8]. A layer's pass gathers its weight a
    /// block of rows at a time and reduce-scatters each block's gradient,
    /// holding one block of each instead of the whole weight and its whole
    /// gradient; 0 gathers each weight whole.
    #[arg(long, value_parser = mebibytes, allow_negative_numbers = true)]
    pub(crate) gather_block_mib: Option<f64>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zero-bubble
    /// [default: the fastest that fits: zero-bubble with 2 or more ranks
    /// and micro-batches].
    #[arg(long, value_parser = ["gpipe", "1f1b", "interleaved", "zero-bubble"])]
    pub(crate) schedule: Option<String>,
    /// Chunks of layers per rank under --schedule interleaved [default: 2].
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) virtual_stages: Option<usize>,
    /// How stages are cut into chunks: counts (even numbers of stages) or
    /// auto (by each stage's cost).
    #[arg(long, default_value = "counts", value_parser = ["counts", "auto"])]
    pub(crate) balance: String,
    /// The dataset: mnist, or fashion-mnist (Debian's dataset-fashion-mnist, or --data).
    #[arg(long, default_value = "mnist")]
    pub(crate) dataset: String,
    /// How the MLP is split: pipeline (ChainerMN's stages over the ranks)
    /// or tensor (784–U–U–10, each layer's weight split over the ranks,
    /// Megatron-style; --stages, --micro-batches, --schedule,
    /// --virtual-stages and --balance do not apply).
    #[arg(long, default_value = "pipeline", value_parser = ["pipeline", "tensor"])]
    pub(crate) parallel: String,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// `shardnet train mnist-mlp-parallel`.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct MlpParallelArgs {
    #[command(flatten)]
    pub(crate) data: DataArgs,
    /// Hidden units U (each part's MLPs are U/2 wide).
    #[arg(long, default_value_t = 1000, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) units: usize,
    /// The dataset: mnist, or fashion-mnist.
    #[arg(long, default_value = "mnist")]
    pub(crate) dataset: String,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// `shardnet train face-head`.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct FaceHeadArgs {
    #[command(flatten)]
    pub(crate) head: HeadArgs,
    /// Number of identities C (classes of the head).
    #[arg(long, default_value_t = 10_000, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) classes: usize,
    /// Steps per reported epoch.
    #[arg(long, default_value_t = 100, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) steps_per_epoch: usize,
    /// The naive head instead (logits concatenated on rank 0, which alone
    /// computes the loss; plain logits, f32): for comparison.
    #[arg(long)]
    pub(crate) naive_head: bool,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// `shardnet train mnist-arcface`.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct ArcfaceArgs {
    #[command(flatten)]
    pub(crate) head: HeadArgs,
    #[command(flatten)]
    pub(crate) data: DataArgs,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// `shardnet train vgg16`'s own flags.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct Vgg16Args {
    #[command(flatten)]
    pub(crate) data: DataArgs,
    /// How each convolution's channels are split over the ranks of a group:
    /// grouped (ChainerMN's ParallelConvolution2D: a grouped convolution),
    /// output or input (exact), none (replicated).
    #[arg(long, default_value = "output", value_parser = ["grouped", "output", "input", "none"])]
    pub(crate) parallel_conv: String,
    /// Channel multiplier: every layer has max(1, round(c·W)) channels.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) width: f64,
    /// Images: cifar10 (binary files in --data DIR), synthetic (seeded
    /// 3×32×32), mnist or fashion-mnist (padded to 32×32).
    #[arg(long, default_value = "mnist", value_parser = ["cifar10", "synthetic", "mnist", "fashion-mnist"])]
    pub(crate) dataset: String,
    /// Leave out batch normalisation (the convolutions then have biases).
    #[arg(long)]
    pub(crate) no_batch_norm: bool,
    /// Data-parallel groups G: the ranks form G groups of ranks/G, channel
    /// parallel inside a group, data parallel across groups.
    #[arg(long, default_value_t = 1, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) data_parallel: usize,
    /// Batch normalisation over each data-parallel replica's own images (as
    /// PyTorch's DDP and ChainerMN's plain BatchNormalization do), not the
    /// whole batch's: no communication in batch norm, but not the one-device
    /// model (it is one device normalising --data-parallel slices of each
    /// batch alone); the running statistics are averaged over the replicas
    /// after each step. Needs --data-parallel G > 1.
    #[arg(long)]
    pub(crate) local_batch_norm: bool,
    /// What the data-parallel groups shard: none (each holds Adam's whole
    /// state; gradients allreduced); optimizer (each holds and updates its
    /// rows' moments only: ZeRO stage 1); gradients (each holds a share of
    /// every convolution's gradient and moments, reduce-scattered as its
    /// backward ends; the weights gathered whole once a step: ZeRO stage
    /// 2); or parameters (the weights shared out too, each gathered whole
    /// only while its layer runs: ZeRO stage 3, FSDP's design). Nothing
    /// without --data-parallel.
    #[arg(long, default_value = "optimizer", value_parser = ["none", "optimizer", "gradients", "parameters"])]
    pub(crate) shard_state: String,
    /// Dropout probability in the classifier.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) dropout: f64,
    /// Training examples of --dataset synthetic (its test set is a fifth of it).
    #[arg(long, default_value_t = 10_000, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) synthetic_examples: usize,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// The GPT's flags.
#[derive(clap::Args, Clone, serde::Serialize)]
pub(crate) struct GptArgs {
    /// Transformer blocks L.
    #[arg(long, default_value_t = 4, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) layers: usize,
    /// Width D (a multiple of --heads).
    #[arg(long, default_value_t = 128, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) dim: usize,
    /// Attention heads H.
    #[arg(long, default_value_t = 4, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) heads: usize,
    /// Tokens of context T (each training example is a window of T tokens
    /// and the T next ones).
    #[arg(long, default_value_t = 64, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) seq: usize,
    /// Ranks of a tensor-parallel group t (heads and hidden features split
    /// Megatron's way; need not divide them).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) tensor_parallel: usize,
    /// Data-parallel groups d [default: the ranks / --tensor-parallel];
    /// t × d must be the ranks.
    #[arg(long, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) data_parallel: Option<usize>,
    /// Pipeline stages p: the blocks cut into p·V chunks over the stages;
    /// t × p × d must be the ranks.
    #[arg(long, default_value_t = 1, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) pipeline: usize,
    /// Micro-batches per step M: each replica's windows in M parts, their
    /// gradients accumulated (pipelined when --pipeline > 1).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) micro_batches: usize,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zero-bubble
    /// [default: 1f1b with --micro-batches > 1 (with one stage: each
    /// micro-batch's backward right after its forward), else gpipe].
    #[arg(long)]
    pub(crate) schedule: Option<String>,
    /// Chunks of blocks per stage under --schedule interleaved [default: 2].
    #[arg(long, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) virtual_stages: Option<usize>,
    /// How blocks are cut into chunks: counts (even counts) or auto (by
    /// estimated cost: the embedding and head weigh on the end stages).
    #[arg(long, default_value = "counts", value_parser = ["counts", "auto"])]
    pub(crate) balance: String,
    /// What backward recomputes: none, selective (attention's softmax: its
    /// kernel always does) or full (each block again from its input, which
    /// alone is kept).
    #[arg(long, default_value = "none", value_parser = ["none", "selective", "full"])]
    pub(crate) recompute: String,
    /// What the data-parallel replicas shard: none; optimizer (each holds
    /// and updates its rows' AdamW moments only: ZeRO stage 1; gradients
    /// reduce-scattered, parameters allgathered); or parameters (each
    /// holds a share of every block's parameters, gradients and moments,
    /// a block gathered whole only while it runs: ZeRO stage 3, FSDP's
    /// design; with --recompute full). (gradients, ZeRO stage 2, is
    /// VGG16's.)
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "gradients", "parameters"])]
    pub(crate) shard_state: String,
    /// The GEMMs' inputs: f32, or bf16 (mixed precision: every linear
    /// layer's and the head's GEMMs on bf16 inputs with f32 sums; the
    /// parameters, the optimizer, attention, layer norms and the loss in
    /// f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub(crate) precision: String,
    /// Megatron's sequence parallelism: between the tensor-parallel regions
    /// each rank of a group keeps its positions only (layer norms and
    /// residuals on 1/t of the activations); needs --tensor-parallel 2+.
    #[arg(long)]
    pub(crate) sequence_parallel: bool,
    /// The text: a file, or a directory whose files without an extension
    /// are read [default: Debian's fortunes, /usr/share/games/fortunes].
    #[arg(long)]
    #[serde(skip)]
    pub(crate) corpus: Option<PathBuf>,
    /// How the text becomes tokens: bytes (a vocabulary of 256) or bpe (a
    /// byte-level BPE learned from the training text with Hugging Face's
    /// tokenizers, saved as tokenizer.json in --checkpoint-dir and beside
    /// --save-params, where `shardnet sample` finds it).
    #[arg(long, default_value = "bytes", value_parser = ["bytes", "bpe"])]
    pub(crate) tokenizer: String,
    /// The BPE's tokens, the 256 bytes included [default: 1024] (with
    /// --tokenizer bpe).
    #[arg(long, value_parser = at_least_one, allow_negative_numbers = true)]
    pub(crate) vocab_size: Option<usize>,
    /// Dropout after the embeddings and on each residual branch (GPT-2's
    /// embd_pdrop and resid_pdrop).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) dropout: f64,
    /// Clip the gradients to this global norm (over every split); 0: no
    /// clipping.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub(crate) clip_grad_norm: f64,
    /// Steps of linear learning-rate warm-up before the cosine decay (to
    /// --lr / 10 at the end).
    #[arg(long, default_value_t = 100, value_parser = whole, allow_negative_numbers = true)]
    pub(crate) lr_warmup: usize,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
}

/// The models `shardnet train` knows, each with exactly its flags.
#[derive(Subcommand)]
pub(crate) enum TrainCommand {
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
    /// A GPT (GPT-2's blocks, byte tokens) on text: tensor parallel inside
    /// groups of --tensor-parallel ranks (and sequence parallel), pipelined
    /// over --pipeline stages, data parallel across the replicas; AdamW with
    /// warm-up and cosine decay, gradient clipping.
    #[command(
        mut_arg("epochs", default("1")),
        mut_arg("batch_size", default("32")),
        mut_arg("lr", default("1e-3")),
        mut_arg("optimizer", default("adamw"))
    )]
    Gpt(GptArgs),
}

/// A count flag's value: a whole number, at least 1.
pub(crate) fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match whole(s)? {
        0 => Err("give a whole number of at least 1".into()),
        v => Ok(v),
    }
}

/// A count flag's value: a whole number from 0 to the largest this machine
/// counts to, each other value refused saying why.
pub(crate) fn whole(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    match t.parse::<usize>() {
        Ok(v) => Ok(v),
        Err(_) if t.starts_with('-') => {
            Err("a count cannot be negative: give a whole number".into())
        }
        Err(_) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => {
            Err(format!("too large: at most {}", usize::MAX))
        }
        Err(_) => Err("give a whole number (digits only, as 100)".into()),
    }
}

/// The momentum as the run's settings record it: the value SGD uses (0.9
/// when not given), so that a checkpoint's settings read the same either
/// way.
fn momentum_setting<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(v.unwrap_or(DEFAULT_MOMENTUM))
}

/// SGD's momentum when `--momentum` is not given.
pub(crate) const DEFAULT_MOMENTUM: f64 = 0.9;

/// A size flag's value: a finite number of MiB ≥ 0.
pub(crate) fn mebibytes(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err("give a number of MiB, 0 or more (as 8, or 0.5)".into()),
    }
}

/// A duration flag's value: a finite number of seconds > 0.
pub(crate) fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("give a number of seconds greater than 0".into()),
    }
}
