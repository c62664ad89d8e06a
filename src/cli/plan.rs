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
pub(crate) fn plan(model: &TrainCommand) -> Result<()> {
    let p = model.configure(Plan)?.ok_or_else(|| {
        Error::Usage(format!(
            "shardnet plan has no memory model of {} yet",
            model.name()
        ))
    })?;
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

/// The memory plan of a checked configuration on the launch's placement.
struct Plan;

impl WithConfig for Plan {
    type Out = Option<MemoryPlan>;
    fn with<C: ModelConfig>(self, cfg: C, t: &TrainArgs) -> Result<Option<MemoryPlan>> {
        let placement = Placement::launch(&t.ranks.comm, t.ranks.ranks);
        cfg.validate(placement.ranks)?;
        if t.ranks.setup()?.device != shardnet::comm::DeviceKind::Cpu {
            // Said, not ignored: the plan below is of host memory.
            eprintln!(
                "shardnet: note: the memory plan is of host memory; a GPU's memory is not planned yet"
            );
        }
        Ok(cfg.memory_plan(placement))
    }
}
