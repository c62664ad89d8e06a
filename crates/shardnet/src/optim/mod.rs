//! Optimizers over [`crate::nn::Param`]s.
//!
//! | optimizer | per element | state (`StateTensor` names) |
//! |---|---|---|
//! | [`Sgd`] (`--optimizer sgd`) | d = g + λθ; b ← μb + d; θ ← θ − lr·b | `sgd.momentum/{param}` (μ > 0) |
//! | [`Adam`] (`--optimizer adam`) | g ← g + λθ; m, v; θ ← θ − lr·m̂/(√v̂ + ε) | `adam.m/{param}`, `adam.v/{param}` |
//! | [`Adam`] decoupled (`--optimizer adamw`) | θ ← θ(1 − lr·λ); m, v; θ ← θ − lr·m̂/(√v̂ + ε) | as Adam's |
//!
//! Both are one fused pass per parameter (value, state and gradient read
//! once, written once), in place, and equal PyTorch's `torch.optim.SGD`
//! (dampening 0), `torch.optim.Adam` and `torch.optim.AdamW` (tested
//! against values PyTorch produced, and AdamW against its f64 definition). On the CPU each is a fused kernel, elsewhere candle ops; every
//! constant is formed in f64 and rounded once, in PyTorch's order of
//! operations, so both paths give the same bits from the same gradients.
//! Both can also be **fused into backward** for a weight whose
//! kernel supports it (the sharded head): [`Optimizer::fuse`] marks it,
//! [`Optimizer::prepare_fused`] arms them with the step's learning rate
//! before backward, and the kernel updates the weight's rows as their gradient is
//! produced (the CPU kernel block by block, the generic path the rows
//! taking part at once, in candle's ops), so the shard's gradient is never
//! held. A fused step updates the rows it is passed and their state only:
//! under Partial FC the unsampled rows keep their weights and state (the
//! lazy update), on either path.
//!
//! - [`allreduce_grads`]: the multi-node optimizer's gradient allreduce for
//!   data-parallel parameters (sum or mean, and when each is right).
//! - [`sharded_step`]: the data-parallel step with the optimizer's state
//!   sharded over the replicas ([`Optimizer::shard_state`], ZeRO stage 1):
//!   gradients reduce-scattered, each rank's rows updated, parameters
//!   allgathered.
//! - [`LossScaler`]: dynamic loss scaling for half-precision training.

mod adam;
mod fused;
mod multi_node;
mod sgd;

pub use adam::Adam;
pub use multi_node::{
    allgather_params, allreduce_grads, reduce_scatter_grads, sharded_step, LossScaler,
};
pub use sgd::Sgd;

use crate::nn::{Param, StateTensor};
use crate::{Error, Result};

/// Which optimizer (`--optimizer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with momentum and weight decay.
    Sgd,
    /// Adam.
    Adam,
    /// Adam with decoupled weight decay (Loshchilov & Hutter; PyTorch's
    /// `AdamW`).
    AdamW,
}

impl std::str::FromStr for OptimizerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sgd" => Ok(OptimizerKind::Sgd),
            "adam" => Ok(OptimizerKind::Adam),
            "adamw" => Ok(OptimizerKind::AdamW),
            _ => Err(Error::Usage(format!(
                "--optimizer {s}: the optimizers are sgd (with momentum and weight decay), adam \
                 and adamw (Adam with decoupled weight decay)"
            ))),
        }
    }
}

/// What data-parallel replicas hold a share of rather than the whole
/// (`--shard-state`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardState {
    /// Nothing: every replica holds the whole optimizer state; gradients
    /// are allreduced.
    #[default]
    None,
    /// The optimizer's state (ZeRO stage 1): each replica holds and updates
    /// the state of its rows only; gradients are reduce-scattered and the
    /// parameters allgathered ([`sharded_step`]), the same traffic as one
    /// allreduce.
    Optimizer,
    /// The gradients and the optimizer's state (ZeRO stage 2): each
    /// replica keeps the whole parameters but only a share of each sharded
    /// parameter's gradient, reduce-scattered into it as soon as its
    /// layer's backward is done, and of its state; the shares stepped are
    /// gathered whole again before they are used. Where a model supports
    /// it (VGG16's convolutions).
    Gradients,
    /// The parameters, their gradients and the optimizer's state (ZeRO
    /// stage 3, PyTorch FSDP's design): each replica holds a share of
    /// every sharded parameter, gathered whole only while its layer runs,
    /// its gradient reduce-scattered into the share as soon as it is
    /// ready. Where a model supports it (the GPT's blocks, VGG16's
    /// convolutions).
    Parameters,
}

impl std::str::FromStr for ShardState {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(ShardState::None),
            "optimizer" => Ok(ShardState::Optimizer),
            "gradients" => Ok(ShardState::Gradients),
            "parameters" => Ok(ShardState::Parameters),
            _ => Err(Error::Usage(format!(
                "--shard-state {s}: give none, optimizer, gradients or parameters"
            ))),
        }
    }
}

impl std::fmt::Display for ShardState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardState::None => "none",
            ShardState::Optimizer => "optimizer",
            ShardState::Gradients => "gradients",
            ShardState::Parameters => "parameters",
        })
    }
}

/// An optimizer's settings besides the learning rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    /// Which.
    pub kind: OptimizerKind,
    /// SGD's momentum μ (ignored by Adam).
    pub momentum: f64,
    /// λ: the L2 weight decay added to the gradient (SGD, Adam), or
    /// AdamW's decoupled decay θ ← θ(1 − lr·λ).
    pub weight_decay: f64,
}

impl Default for OptimizerConfig {
    /// Adam without weight decay (what every model used before SGD).
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adam,
            momentum: 0.9,
            weight_decay: 0.0,
        }
    }
}

impl OptimizerConfig {
    /// InsightFace's SGD for the head: μ = 0.9, λ = 5e-4.
    pub fn sgd() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Sgd,
            momentum: 0.9,
            weight_decay: 5e-4,
        }
    }

    /// Refuse settings that cannot train: μ in [0, 1), λ ≥ 0, both finite.
    pub fn validate(&self) -> Result<()> {
        if !(self.momentum >= 0.0 && self.momentum < 1.0) {
            return Err(Error::Usage(format!(
                "--momentum {}: SGD's momentum is in [0, 1)",
                self.momentum
            )));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(Error::Usage(format!(
                "--weight-decay {}: a finite number ≥ 0",
                self.weight_decay
            )));
        }
        Ok(())
    }

    /// AdamW with PyTorch's defaults: λ = 0.01.
    pub fn adamw() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::AdamW,
            momentum: 0.9,
            weight_decay: 0.01,
        }
    }

    /// Per-weight f32 slots of state: SGD 1 (0 without momentum), Adam and
    /// AdamW 2.
    pub fn slots(&self) -> usize {
        match self.kind {
            OptimizerKind::Sgd => usize::from(self.momentum != 0.0),
            OptimizerKind::Adam | OptimizerKind::AdamW => 2,
        }
    }
}

/// The optimizer a model trains with: SGD or Adam over its parameters.
pub enum Optimizer {
    /// SGD with momentum and weight decay.
    Sgd(Sgd),
    /// Adam.
    Adam(Adam),
}

impl Optimizer {
    /// `cfg`'s optimizer over `params` at learning rate `lr`.
    pub fn new(cfg: &OptimizerConfig, params: Vec<Param>, lr: f64) -> Result<Self> {
        cfg.validate()?;
        Ok(match cfg.kind {
            OptimizerKind::Sgd => {
                Optimizer::Sgd(Sgd::new(params, lr, cfg.momentum, cfg.weight_decay)?)
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                let mut a = Adam::new(params, lr)?;
                a.weight_decay = cfg.weight_decay;
                a.decoupled = cfg.kind == OptimizerKind::AdamW;
                Optimizer::Adam(a)
            }
        })
    }

    /// What both keep: parameters, step count, the fused updates' scalars.
    fn common(&self) -> &fused::Common {
        match self {
            Optimizer::Sgd(o) => &o.common,
            Optimizer::Adam(o) => &o.common,
        }
    }

    /// [`Optimizer::common`], to change.
    fn common_mut(&mut self) -> &mut fused::Common {
        match self {
            Optimizer::Sgd(o) => &mut o.common,
            Optimizer::Adam(o) => &mut o.common,
        }
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[Param] {
        &self.common().params
    }

    /// Updates applied so far (Adam's t).
    pub fn steps(&self) -> u64 {
        self.common().step
    }

    /// Continue from `steps` updates (a checkpoint's; the state tensors are
    /// restored through [`Optimizer::state`]).
    pub fn set_steps(&mut self, steps: u64) {
        self.common_mut().step = steps;
    }

    /// Shard the optimizer's state over `ranks` data-parallel replicas,
    /// this rank being `rank` of them (ZeRO stage 1): each parameter's rows
    /// (along dimension 0) are split over the replicas as
    /// [`crate::comm::chunk_range`] splits them, and this rank holds the
    /// state (moments, momentum) of its rows only and updates only them.
    /// [`sharded_step`] then reduce-scatters the gradients, steps and
    /// allgathers the parameters. A parameter with fewer rows than replicas,
    /// or sharded along another dimension, stays whole on every rank.
    /// Checkpoints hold each rank's rows as a shard of the global state, so
    /// they resume on any number of ranks. Before the first step only.
    pub fn shard_state(&mut self, ranks: usize, rank: usize) -> Result<()> {
        match self {
            Optimizer::Sgd(o) => o.shard_state(ranks, rank),
            Optimizer::Adam(o) => o.shard_state(ranks, rank),
        }
    }

    /// The rows (along dimension 0) of each parameter this rank updates,
    /// in the order of [`Optimizer::params`]: `None` for every row (the
    /// state is not sharded, or the parameter stays whole).
    pub fn shares(&self) -> &[Option<std::ops::Range<usize>>] {
        &self.common().shares
    }

    /// The optimizer's state tensors (see the table above).
    pub fn state(&self) -> Vec<StateTensor> {
        match self {
            Optimizer::Sgd(o) => o.state(),
            Optimizer::Adam(o) => o.state(),
        }
    }

    /// Set the learning rate of the next step.
    pub fn set_lr(&mut self, lr: f64) {
        match self {
            Optimizer::Sgd(o) => o.lr = lr,
            Optimizer::Adam(o) => o.lr = lr,
        }
    }

    /// Apply one update from the accumulated gradients, and consume them.
    pub fn step(&mut self) -> Result<()> {
        match self {
            Optimizer::Sgd(o) => o.step(),
            Optimizer::Adam(o) => o.step(),
        }
    }

    /// End a step without an update (a loss scaler skipped it): the fused
    /// updates of its backward stay applied, the other gradients are
    /// dropped.
    pub fn end_step(&mut self) {
        let common = self.common_mut();
        for p in &common.params {
            p.take_grad();
        }
        common.fused.disarm();
    }

    /// Fuse the update of `param` (one of this optimizer's) into backward:
    /// a kernel that supports it (the sharded head's, on the CPU kernels
    /// and on the device-generic path) then updates the weight's rows and
    /// their state in place as it produces their gradient, and accumulates
    /// none; [`Optimizer::step`] skips it. Call
    /// [`Optimizer::prepare_fused`] before each such backward. Where the
    /// kernel has no fused path (any other layer), the gradient is
    /// accumulated and stepped as usual. The kernels
    /// ([`crate::kernels::set_kernels`]) are chosen before: the state lives
    /// on the host for the CPU kernels, on the device for the generic path.
    pub fn fuse(&self, param: &Param) -> Result<()> {
        match self {
            Optimizer::Sgd(o) => o.fuse(param),
            Optimizer::Adam(o) => o.fuse(param),
        }
    }

    /// The fused updates of the coming backward use the learning rate set
    /// for this step ([`Optimizer::set_lr`]) and multiply their gradient by
    /// `unscale` (1 / the loss scale, 1 without one). The next
    /// [`Optimizer::step`] ends them.
    pub fn prepare_fused(&self, unscale: f64) {
        self.common().prepare_fused(self.lr(), unscale);
    }

    /// The learning rate of the next step.
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::Sgd(o) => o.lr,
            Optimizer::Adam(o) => o.lr,
        }
    }
}
