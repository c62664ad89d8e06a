//! The one runner behind `shardnet train <model>`: launch the ranks, agree
//! on the settings, validate, check the memory plan, build the model, train,
//! gather what rank 0 reports. Every model goes through it; a model only
//! says how it is validated, planned and built ([`ModelConfig`]).
//!
//! Before the first step nothing is left to fail late: every value is
//! checked (`Options::validate`, each model's `validate`: a message naming
//! the flag), every output path (`output::check_outputs`, by the command),
//! and every rank agrees on the parsed arguments (`Communicator::agree`;
//! under MPI each process parses its own command line).

use super::model::TrainModel;
use super::options::Options;
use super::plan::{self, MemoryPlan, Placement};
use super::trainer::train;
use super::Metrics;
use crate::comm::{self, Communicator};
use crate::Result;
use candle_core::Tensor;
use std::collections::BTreeMap;

/// A model's configuration, as the runner takes it.
pub trait ModelConfig: Clone + Send + Sync {
    /// The model on one rank, with its data and optimizer.
    type Training: TrainModel;

    /// The loop's settings.
    fn options(&self) -> &Options;

    /// [`ModelConfig::options`], to change.
    fn options_mut(&mut self) -> &mut Options;

    /// Refuse, before anything is built, a configuration that cannot run on
    /// `ranks` ranks (every message names its flag).
    fn validate(&self, ranks: usize) -> Result<()>;

    /// The memory plan on `placement`, where the model has a memory model.
    fn memory_plan(&self, placement: Placement) -> Option<MemoryPlan>;

    /// This rank's part of the model, its data and optimizer. Collective.
    fn build(&self, comm: &Communicator) -> Result<Self::Training>;

    /// The size `shardnet plan --max-size` searches (`--dim`, `--units`,
    /// `--classes`, `--width`), where the model has one.
    fn size(&self) -> Option<Size> {
        None
    }

    /// This configuration with its [size](ModelConfig::size) set to
    /// `value` (a multiple of its step).
    fn with_size(&self, _value: f64) -> Self {
        self.clone()
    }

    /// The ways this model splits over `ranks` ranks, each as the flags
    /// that choose it and its configuration (the others as they are). Only
    /// the splits that validate on `ranks` are kept by the search.
    fn splits(&self, _ranks: usize) -> Vec<(String, Self)> {
        Vec::new()
    }
}

/// A model's size, as `shardnet plan --max-size` searches it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Size {
    /// Its flag (`--dim`).
    pub flag: &'static str,
    /// This configuration's value.
    pub value: f64,
    /// The step between sizes tried (a GPT's width: a multiple of its
    /// heads; VGG16's: 1/64, one channel of its first layer).
    pub step: f64,
}

impl Size {
    /// A count searched one by one (`--units`, `--classes`): `value` now.
    pub fn count(flag: &'static str, value: usize) -> Self {
        Size {
            flag,
            value: value as f64,
            step: 1.0,
        }
    }
}

/// What a run returns on rank 0.
pub struct Report {
    /// Per-epoch figures and memory.
    pub metrics: Metrics,
    /// Every parameter after training, whole, by name (what
    /// [`TrainModel::gather_params`] gathers; empty for a model that keeps
    /// none).
    pub params: BTreeMap<String, Tensor>,
}

/// Train `cfg` on every rank of `comm` with the [shared loop](train); rank
/// 0 gets the report, the others `None`. First the
/// [memory plan](super::plan): a run that does not fit in memory is refused
/// before anything is allocated.
pub fn run<C: ModelConfig>(comm: &Communicator, cfg: &C) -> Result<Option<Report>> {
    cfg.options().validate()?;
    cfg.validate(comm.size())?;
    if let Some(p) = cfg.memory_plan(Placement::of(comm)) {
        plan::check(comm, &p)?;
    }
    super::progress::baseline_memory_bytes();
    let mut model = {
        let _params = crate::heap::counting_as(crate::heap::Part::Parameters);
        cfg.build(comm)?
    };
    let metrics = train(comm, &mut model, cfg.options())?;
    let params = model.gather_params()?;
    Ok(metrics.map(|metrics| Report {
        metrics,
        params: params.unwrap_or_default(),
    }))
}

/// [`run`] on `ranks` ranks of the `backend` communicator (`local`, `mpi`,
/// `auto`; under MPI the launcher's ranks), after every rank agrees on the
/// run's settings ([`Options::settings`]). Thread ranks are validated
/// before any starts. Rank 0's report.
pub fn launch<C: ModelConfig>(backend: &str, ranks: usize, cfg: &C) -> Result<Option<Report>> {
    launch_on(backend, ranks, &comm::Setup::default(), cfg)
}

/// [`launch`] with each rank on the device and communicator of `setup`
/// (`--device`, `--communicator`), applied after the ranks agree on the
/// settings and before the model is built.
pub fn launch_on<C: ModelConfig>(
    backend: &str,
    ranks: usize,
    setup: &comm::Setup,
    cfg: &C,
) -> Result<Option<Report>> {
    if Placement::launch(backend, ranks).threads {
        cfg.options().validate()?;
        cfg.validate(ranks)?;
    }
    let reports = comm::run(backend, ranks, |c| {
        c.agree("arguments", &cfg.options().settings)?;
        let c = setup.apply(c)?;
        run(&c, cfg)
    })?;
    Ok(reports.into_iter().flatten().next())
}
