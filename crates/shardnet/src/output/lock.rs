//! A directory that belongs to one run: `--checkpoint-dir` and `--log-dir`
//! each hold a lock file, `.lock`, taken by the run's rank 0 for as long as
//! the run lasts.
//!
//! The lock is the operating system's (`flock`), so it ends with the
//! process however the process ends: a run killed with `kill -9`, or one
//! whose machine crashed, holds nothing, and the next run takes the
//! directory over with a note naming the run it replaces. A run that still
//! holds it, on this host or another (the lock is honoured over NFS), is
//! named in the refusal. The file's content says who holds it (run id,
//! host, process id, start time) and is emptied when the run ends cleanly.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file's name in a directory.
pub const LOCK_FILE: &str = ".lock";

/// Who holds a directory: the lock file's content.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Holder {
    /// The run's id (kept across resumes).
    pub run: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// When it took the lock (seconds since 1970).
    pub since: u64,
}

impl Holder {
    /// This process, running `run`.
    pub fn this_process(run: &str) -> Self {
        Holder {
            run: run.to_string(),
            host: host_name(),
            pid: std::process::id(),
            since: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    fn describe(&self) -> String {
        format!(
            "run {} (process {} on host {}, since {})",
            self.run,
            self.pid,
            self.host,
            utc(self.since)
        )
    }
}

/// The lock of a directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    path: PathBuf,
}

/// What [`DirLock::take`] found.
#[derive(Debug)]
pub struct Taken {
    /// The lock, held.
    pub lock: DirLock,
    /// The run that held it last and ended without releasing it (killed,
    /// crashed), if any.
    pub replaced: Option<Holder>,
}

impl DirLock {
    /// Take `dir`'s lock for `me`; `flag` names the directory's flag in
    /// errors. Refused while another run (in this process or any other)
    /// holds it.
    pub fn take(flag: &str, dir: &Path, me: &Holder) -> Result<Taken> {
        let path = dir.join(LOCK_FILE);
        let io = |e: std::io::Error| Error::caused(format!("{flag} {}", path.display()), e);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        // A moment's wait: another process's check ([`DirLock::check_free`],
        // a shared lock held for microseconds) is not a run.
        let mut tries = 0;
        let locked = loop {
            match file.try_lock() {
                Err(std::fs::TryLockError::WouldBlock) if tries < 20 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => break other,
            }
        };
        match locked {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(held(flag, dir, &mut file)),
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::Io(format!(
                    "{flag} {}: cannot lock {LOCK_FILE} ({e}); the file system must support \
                     file locks (flock), as local disks and NFS do",
                    dir.display()
                )))
            }
        }
        let replaced = read_holder(&mut file);
        let text = serde_json::to_string(me).map_err(|e| Error::caused("", e))?;
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(format!("{text}\n").as_bytes()).map_err(io)?;
        file.sync_data().map_err(io)?;
        Ok(Taken {
            lock: DirLock { file, path },
            replaced,
        })
    }

    /// Refuse `dir` as [`DirLock::take`] would while another run holds it,
    /// without taking it (a check before the run starts). A shared lock,
    /// for a moment: the processes of one `mpiexec` job all check at once.
    pub fn check_free(flag: &str, dir: &Path) -> Result<()> {
        let path = dir.join(LOCK_FILE);
        let Ok(mut file) = OpenOptions::new().read(true).write(true).open(&path) else {
            return Ok(());
        };
        match file.try_lock_shared() {
            Ok(()) => {
                let _ = file.unlock();
                Ok(())
            }
            Err(std::fs::TryLockError::WouldBlock) => Err(held(flag, dir, &mut file)),
            Err(std::fs::TryLockError::Error(_)) => Ok(()),
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    /// A run that ends (well or with an error) empties the file: the
    /// directory is free, and the next run has nothing to take over.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
        let _ = self.file.unlock();
    }
}

/// The refusal of `dir`, whose lock `file` another run holds.
fn held(flag: &str, dir: &Path, file: &mut File) -> Error {
    let who = read_holder(file).map_or_else(|| "another run".to_string(), |h| h.describe());
    Error::Usage(format!(
        "{flag} {}: {who} is writing to it; two runs in one directory would overwrite each \
         other's files. Wait for that run to end, or give this one another {flag}",
        dir.display()
    ))
}

/// The holder a lock file names, if it names one.
fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

/// A new run's id: 16 hex digits from the host, the process and the
/// time, so that two runs never share one.
pub fn new_run_id() -> String {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    run_id_of(&format!(
        "{}/{}/{nanos}/{n}",
        host_name(),
        std::process::id()
    ))
}

/// A run id (16 hex digits) derived from `seed`: the same seed, the same id.
pub fn run_id_of(seed: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(seed.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `a` and `b` name the same existing file or directory, however
/// spelled (relative, through links).
pub fn same_path(a: &Path, b: &Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// This machine's host name.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Seconds since 1970 as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("shardnet-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_held_directory_is_refused_naming_its_run() {
        let d = dir("held");
        let a = Holder::this_process("run-a");
        let held = DirLock::take("--checkpoint-dir", &d, &a).unwrap();
        assert!(held.replaced.is_none());
        let err = DirLock::take("--checkpoint-dir", &d, &Holder::this_process("run-b"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run run-a") && err.contains(&format!("process {}", a.pid)),
            "{err}"
        );
        drop(held);
        // Released cleanly: free, and nothing to take over.
        let again = DirLock::take("--checkpoint-dir", &d, &Holder::this_process("run-b")).unwrap();
        assert!(again.replaced.is_none());
        drop(again);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_lock_left_by_a_dead_run_is_taken_over_with_its_name() {
        let d = dir("dead");
        // What a run killed with -9 leaves: the file names it, no lock held.
        let dead = Holder {
            run: "run-dead".into(),
            host: "h".into(),
            pid: 1234,
            since: 0,
        };
        std::fs::write(d.join(LOCK_FILE), serde_json::to_string(&dead).unwrap()).unwrap();
        let t = DirLock::take("--log-dir", &d, &Holder::this_process("run-new")).unwrap();
        assert_eq!(t.replaced, Some(dead));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn dates_are_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_795_833_015), "2026-11-28 02:30:15 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
    }
}
