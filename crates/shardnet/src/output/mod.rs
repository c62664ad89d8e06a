//! Output files written so that no run loses work: every path checked
//! before the first step, every file written atomically.
//!
//! - [`check_outputs`]: before training, each output (flag, path) must name
//!   a file (not a directory) in an existing, writable directory, be
//!   writable if it exists, and no two outputs may name the same file.
//! - [`check_outside_checkpoints`]: no output lies inside a checkpoint (a
//!   directory holding a `manifest.json`): writing there could destroy the
//!   work it holds.
//! - [`write_atomic`] / [`write_atomic_with`]: the content goes to a
//!   temporary file in the same directory, is flushed to disk (`fsync`),
//!   takes the mode of the file it replaces, and is renamed over it; the
//!   directory is then synced. A full disk or a crash leaves the previous
//!   file whole, never a truncated one.
//! - [`DirLock`]: a directory written by a run (`--checkpoint-dir`,
//!   `--log-dir`) belongs to that run while it lasts; [`new_run_id`] and
//!   [`host_name`] name the run that holds it.
//! - [`make_dir`]: an output directory created if need be, an error naming
//!   its flag; [`CHECKPOINT_MANIFEST`]: the file that marks a checkpoint.

mod lock;

pub use lock::{host_name, new_run_id, run_id_of, same_path, DirLock, Holder, Taken, LOCK_FILE};

use crate::{Error, Result};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The directory `path` will be written in ("." for a bare file name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A file name in `dir` for a temporary file next to `path`.
fn temporary(dir: &Path, path: &Path, what: &str) -> PathBuf {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.join(format!(".{name}.{what}-{}-{n}", std::process::id()))
}

/// Check that `path` can be written as the output of `flag`, before any
/// work: its directory exists and takes new files, it is not a directory,
/// and if it exists it is writable. Nothing is left behind.
pub fn check_writable(flag: &str, path: &Path) -> Result<()> {
    let bad = |why: String| Error::Usage(format!("{flag} {}: {why}", path.display()));
    if path.as_os_str().is_empty() || path.file_name().is_none() {
        return Err(bad("not a file name".into()));
    }
    if path.is_dir() {
        return Err(bad("is a directory; give a file name inside it".into()));
    }
    let dir = parent_of(path);
    if let Some(file) = dir.ancestors().find(|a| a.is_file()) {
        return Err(bad(format!(
            "{} is a file, not a directory",
            file.display()
        )));
    }
    if !dir.is_dir() {
        return Err(bad(format!(
            "the directory {} does not exist; create it first",
            dir.display()
        )));
    }
    if let Ok(meta) = fs::metadata(path) {
        if meta.permissions().readonly() {
            return Err(bad("the file exists and is read-only".into()));
        }
    }
    // The real test: create (and remove) a file in the directory.
    let probe = temporary(&dir, path, "check");
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(bad(format!(
            "cannot create files in {}: {e}",
            dir.display()
        ))),
    }
}

/// The checkpoint manifest's file name (the one home of it;
/// `train::checkpoint::MANIFEST`): a directory holding one is a checkpoint.
pub const CHECKPOINT_MANIFEST: &str = "manifest.json";

/// `path` made absolute with its symbolic links resolved, as far as it
/// exists (the rest appended as given).
fn resolved(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = path.to_path_buf();
    loop {
        if let Ok(real) = fs::canonicalize(&at) {
            return rest.into_iter().rev().fold(real, |p, part| p.join(part));
        }
        match (at.file_name().map(|n| n.to_os_string()), at.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                at = if parent.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    parent.to_path_buf()
                };
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Refuse `path`, the output of `flag` (a file, or a directory the run
/// writes into), where writing it could destroy a checkpoint: inside a
/// checkpoint, a directory that (or one above it that) holds a
/// `manifest.json` — a kept checkpoint of `--checkpoint-dir`, the one
/// `--resume` or `consolidate` reads. Checked before anything is written;
/// the message names the checkpoint. A `--checkpoint-dir` itself may hold
/// other files: only its checkpoints' directories are its own.
pub fn check_outside_checkpoints(flag: &str, path: &Path) -> Result<()> {
    let target = resolved(path);
    // The output itself, or any directory above it, a checkpoint.
    match target
        .ancestors()
        .find(|at| at.join(CHECKPOINT_MANIFEST).is_file())
    {
        Some(at) => Err(Error::Usage(format!(
            "{flag} {}: lies inside the checkpoint {}, whose files writing it could replace; \
             give a path outside it",
            path.display(),
            at.display()
        ))),
        None => Ok(()),
    }
}

/// Create the directory `dir` of `flag` (and those above it) if need be;
/// an error says what is in the way in words (a file where a directory
/// should be, a directory that may not be written).
pub fn make_dir(flag: &str, dir: &Path) -> Result<()> {
    let bad = |why: String| Error::Usage(format!("{flag} {}: {why}", dir.display()));
    if let Some(file) = dir.ancestors().find(|a| a.is_file()) {
        return Err(bad(format!(
            "{} is a file, not a directory; give a directory",
            file.display()
        )));
    }
    fs::create_dir_all(dir).map_err(|e| {
        bad(match e.kind() {
            std::io::ErrorKind::PermissionDenied => {
                "permission denied: cannot create or write it here".into()
            }
            std::io::ErrorKind::ReadOnlyFilesystem => "on a read-only file system".into(),
            std::io::ErrorKind::StorageFull => "the disk is full".into(),
            _ => format!("cannot create it ({e})"),
        })
    })
}

/// [`check_writable`] for every (flag, path), and no two naming one file.
pub fn check_outputs(outputs: &[(&str, &Path)]) -> Result<()> {
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for (flag, path) in outputs {
        check_writable(flag, path)?;
        // The same file, however spelled: the canonical directory + name.
        let dir = fs::canonicalize(parent_of(path)).unwrap_or_else(|_| parent_of(path));
        let key = dir.join(path.file_name().unwrap_or_default());
        if let Some((other, _)) = seen.iter().find(|(_, k)| *k == key) {
            return Err(Error::Usage(format!(
                "{other} and {flag} both name {}: give each output its own file",
                key.display()
            )));
        }
        seen.push((flag, key));
    }
    Ok(())
}

/// Write `bytes` to `path` atomically (see the module doc).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f = File::create(tmp).map_err(|e| io_error(tmp, e))?;
        f.write_all(bytes).map_err(|e| io_error(tmp, e))
    })
}

/// Write `path` atomically with `write`, which creates and fills the file
/// it is given (a temporary next to `path`); see the module doc.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = parent_of(path);
    let tmp = temporary(&dir, path, "tmp");
    let done = (|| {
        write(&tmp)?;
        let f = File::open(&tmp).map_err(|e| io_error(&tmp, e))?;
        // Keep the mode of the file being replaced (a new file keeps the
        // umask's, as any newly created file).
        if let Ok(meta) = fs::metadata(path) {
            fs::set_permissions(&tmp, meta.permissions()).map_err(|e| io_error(&tmp, e))?;
        }
        f.sync_all().map_err(|e| io_error(&tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| io_error(path, e))?;
        // The rename itself reaches the disk with the directory.
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if done.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    done
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::caused(path.display().to_string(), e)
}
