//! What the environment sets for every backend: the wait limit
//! (`SHARDNET_TIMEOUT`) and the rank counts a launcher (`mpiexec`) gives.

use crate::{Error, Result};
use std::time::Duration;

/// The wait limit when `SHARDNET_TIMEOUT` is not set, in seconds.
pub const DEFAULT_TIMEOUT_S: f64 = 300.0;
/// The longest `SHARDNET_TIMEOUT` (about 317 years: in effect, none).
pub const MAX_TIMEOUT_S: f64 = 1e10;

/// The wait limit for the local backend and for MPI progress: `SHARDNET_TIMEOUT`
/// seconds (a finite number > 0), [`DEFAULT_TIMEOUT_S`] when unset. Any
/// other value is an error that says so, never silently the default.
pub fn timeout() -> Result<Duration> {
    let Some(raw) = std::env::var_os("SHARDNET_TIMEOUT") else {
        return Ok(Duration::from_secs_f64(DEFAULT_TIMEOUT_S));
    };
    let text = raw.to_string_lossy();
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= MAX_TIMEOUT_S)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            Error::Usage(format!(
                "SHARDNET_TIMEOUT={text:?} is not a wait limit: give a number of seconds > 0 \
                 and at most {MAX_TIMEOUT_S:e} (e.g. SHARDNET_TIMEOUT=600), or unset it for the \
                 default {DEFAULT_TIMEOUT_S} s"
            ))
        })
}

/// The number of processes the launcher (mpiexec, srun) asked for, when this
/// process was started by one.
pub fn launcher_size() -> Option<usize> {
    env_count(&["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
}

/// The number of processes the launcher started on this node.
pub fn launcher_local_size() -> Option<usize> {
    env_count(&["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"]).or_else(launcher_size)
}

fn env_count(keys: &[&str]) -> Option<usize> {
    keys.iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
}
