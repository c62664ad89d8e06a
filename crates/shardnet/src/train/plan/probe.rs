//! How much memory this machine leaves a run: `MemAvailable`, the cgroup's
//! headroom (v2 and v1, every level up to the root, inactive page cache
//! counted as free) and `SHARDNET_MEMORY_LIMIT`, the smallest of them.

use super::{bytes, MIB};
use crate::{Error, Result};
use std::fmt::Write as _;
use std::path::Path;

/// The memory a run may use on this machine, and where the figure comes
/// from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Available {
    /// The smallest of the figures below, bytes (`u64::MAX` when none is
    /// known: nothing is refused).
    pub bytes: u64,
    /// `MemAvailable` from /proc/meminfo.
    pub mem_available: Option<u64>,
    /// The tightest cgroup's limit less its usage (inactive page cache
    /// counted as free), where a limit is set.
    pub cgroup: Option<u64>,
    /// `SHARDNET_MEMORY_LIMIT`, if set.
    pub limit: Option<u64>,
}

impl Available {
    /// From the three figures: the smallest one that is known.
    pub fn new(mem_available: Option<u64>, cgroup: Option<u64>, limit: Option<u64>) -> Self {
        let bytes = [mem_available, cgroup, limit]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(u64::MAX);
        Available {
            bytes,
            mem_available,
            cgroup,
            limit,
        }
    }

    /// Where the figure comes from: `MemAvailable 21.3 GiB; cgroup: no limit`.
    pub fn sources(&self) -> String {
        let fig = |v: Option<u64>, none: &str| v.map_or(none.to_string(), |b| bytes(b as f64));
        let mut s = format!(
            "MemAvailable {}; cgroup: {}",
            fig(self.mem_available, "unknown"),
            self.cgroup.map_or("no limit".to_string(), |b| format!(
                "{} left",
                bytes(b as f64)
            ))
        );
        if let Some(l) = self.limit {
            let _ = write!(s, "; SHARDNET_MEMORY_LIMIT {}", bytes(l as f64));
        }
        s
    }
}

impl std::fmt::Display for Available {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.bytes == u64::MAX {
            return write!(f, "unknown ({}): not checked", self.sources());
        }
        write!(f, "{} ({})", bytes(self.bytes as f64), self.sources())
    }
}

/// The memory available to this process: [`available_memory_at`] the root
/// of the file system, with `SHARDNET_MEMORY_LIMIT` applied.
pub fn available_memory() -> Result<Available> {
    let limit = match std::env::var("SHARDNET_MEMORY_LIMIT") {
        Ok(v) => Some(parse_bytes(&v).ok_or_else(|| {
            Error::Usage(format!(
                "SHARDNET_MEMORY_LIMIT={v}: give bytes, or a number with K, M, G or T (binary: \
                 16G is 16 GiB)"
            ))
        })?),
        Err(_) => None,
    };
    let found = available_memory_at(Path::new("/"));
    Ok(Available::new(found.mem_available, found.cgroup, limit))
}

/// `MemAvailable` and the cgroup headroom as seen under `root` (`/`; a
/// copy of /proc and /sys for tests): `proc/meminfo`, `proc/self/cgroup`,
/// and the limits in `sys/fs/cgroup` (v2: `memory.max`, `memory.current`;
/// v1: `memory/…/memory.limit_in_bytes`, `memory.usage_in_bytes`), at the
/// process's cgroup and every level above it.
pub fn available_memory_at(root: &Path) -> Available {
    let meminfo = std::fs::read_to_string(root.join("proc/meminfo")).ok();
    let mem_available = meminfo.as_deref().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    Available::new(mem_available, cgroup_headroom(root), None)
}

/// The smallest limit − usage over the process's memory cgroups (v2 and
/// v1), each level up to the hierarchy's root.
fn cgroup_headroom(root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let sys = root.join("sys/fs/cgroup");
    let mut best: Option<u64> = None;
    let mut take = |v: Option<u64>| {
        if let Some(v) = v {
            best = Some(best.map_or(v, |b| b.min(v)));
        }
    };
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            for mount in [sys.clone(), sys.join("unified")] {
                for dir in levels(&mount, path) {
                    take(v2_headroom(&dir));
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            for dir in levels(&sys.join("memory"), path) {
                take(v1_headroom(&dir));
            }
        }
    }
    best
}

/// `mount/path` and each directory above it, up to `mount`.
fn levels(mount: &Path, path: &str) -> Vec<std::path::PathBuf> {
    let mut dir = mount.join(path);
    let mut out = Vec::new();
    loop {
        out.push(dir.clone());
        if dir == mount || !dir.pop() || !dir.starts_with(mount) {
            break;
        }
    }
    out
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key`'s value in a cgroup's memory.stat.
fn stat(dir: &Path, key: &str) -> u64 {
    std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
            })
        })
        .unwrap_or(0)
}

fn v2_headroom(dir: &Path) -> Option<u64> {
    let max = read_u64(&dir.join("memory.max"))?; // "max": no limit
    let current = read_u64(&dir.join("memory.current")).unwrap_or(0);
    let used = current.saturating_sub(stat(dir, "inactive_file"));
    Some(max.saturating_sub(used))
}

fn v1_headroom(dir: &Path) -> Option<u64> {
    let limit = read_u64(&dir.join("memory.limit_in_bytes"))?;
    if limit >= 1 << 60 {
        return None; // no limit (the kernel writes ~2⁶³)
    }
    let usage = read_u64(&dir.join("memory.usage_in_bytes")).unwrap_or(0);
    let used = usage.saturating_sub(stat(dir, "total_inactive_file"));
    Some(limit.saturating_sub(used))
}

/// `16G`, `512MiB`, `1.5t`, `1e9`, `1073741824`: bytes (K, M, G, T binary).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let unit_at = lower
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e')
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(unit_at);
    let scale: f64 = match unit.trim() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => 1024.0 * MIB,
        "t" | "tb" | "tib" => 1024.0 * 1024.0 * MIB,
        _ => return None,
    };
    let v = num.trim().parse::<f64>().ok()? * scale;
    (v.is_finite() && v >= 0.0 && v < u64::MAX as f64).then_some(v as u64)
}

/// Whether [`check`](super::check) runs: `SHARDNET_MEMORY_CHECK` unset or
/// `on`/`1`/`true`/`yes`, or `off`/`0`/`false`/`no` (any case); any other
/// value is an error.
pub fn memory_check_setting() -> Result<bool> {
    let Ok(v) = std::env::var("SHARDNET_MEMORY_CHECK") else {
        return Ok(true);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" | "yes" => Ok(true),
        "off" | "0" | "false" | "no" => Ok(false),
        _ => Err(Error::Usage(format!(
            "SHARDNET_MEMORY_CHECK={v:?}: give off (or 0, false, no) to skip the memory \
             check, on (or 1, true, yes) to keep it"
        ))),
    }
}

/// Whether [`check`](super::check) runs ([`memory_check_setting`]; a bad
/// value, refused at start-up by the command, counts as on here).
pub fn check_enabled() -> bool {
    memory_check_setting().unwrap_or(true)
}
