//! Sharded checkpoints: every rank writes its own shard, nobody holds the
//! whole model, a crash at any moment leaves the previous checkpoint whole,
//! and a checkpoint resumes on any number of ranks.
//!
//! **On disk**, `--checkpoint-dir D` holds one directory per checkpoint:
//!
//! ```text
//! D/step-000001200/
//!     rank-00000-of-00002.safetensors   rank 0's tensors
//!     rank-00001-of-00002.safetensors   rank 1's tensors
//!     manifest.json                     written last: the checkpoint exists once it does
//! ```
//!
//! | file | holds |
//! |---|---|
//! | `rank-…safetensors` | the rank's training state ([`StateTensor`]s: `param/…`, `adam.m/…`, `adam.v/…`, `buffer/…`) under their global names; `__metadata__` gives each tensor's place in its global tensor (`shards`), the rank and the step |
//! | `manifest.json` | model, settings, rank count, step; every global tensor with its shape and the pieces that make it (file, offset along the split dimension); the loop's position and every rank's scalar state (optimizer step, loss scale, iterator position); each file's size and SHA-256 |
//!
//! A tensor held by several ranks (a replicated backbone, a shard repeated
//! in every data-parallel group) is written once, by the lowest rank holding
//! it.
//!
//! **Writing** ([`save`], collective): each rank writes its file as a
//! temporary, fsyncs and renames it (hashing as it writes); rank 0 gathers
//! the sizes and digests and writes the manifest the same way, last; then it
//! removes all but the newest `keep` checkpoints. A crash before the
//! manifest leaves a directory without one, which [`find`] ignores.
//!
//! **Reading** ([`restore`], collective): rank 0 reads the manifest and
//! broadcasts it; the model and settings must match (else an error naming
//! every difference); each rank then reads, for each of its state tensors,
//! exactly the byte ranges of the pieces that overlap its part: the same
//! rank count reads its own file back, another rank count re-splits every
//! sharded tensor. Every file a rank reads from is checked against the
//! manifest's size and SHA-256 first. Any failure on any rank fails every
//! rank with the same message.
//!
//! **What a model saves.** `TrainModel::state` (every `StateTensor`, with
//! its `Shard` placement) and `scalars` (`ModelScalars`: the optimizer's
//! step, the batch iterator's position, the loss scaler), both read from the
//! model's `Parts` by default methods. Dropout masks, Partial FC's samples
//! and the synthetic data are drawn from (seed, step), so the step is their
//! whole state. The loop's own state (`LoopState`: step, epoch, the epoch's
//! sums, finished epochs, f64s as bits) goes into the manifest. The saved
//! state is always "after step N", before that epoch's evaluation, so a
//! resume evaluates a finished epoch again rather than storing it half
//! done. `--resume` restores the tensors (on any rank count unless
//! `TrainModel::resume_from_ranks` says the model would change), the
//! scalars (`restore_scalars`) and the loop, then makes the same calls as
//! the run that was never stopped: the same bits.
//!
//! The files: `manifest` (the manifest and its parser, fuzzed; the manifest
//! seals itself, `seal_manifest`); `write` (`save`: files hashed whole and
//! per 16 MiB block as written; `find`, `check_dir`, `set_aside_after`,
//! `remove_leftovers`; pruning removes only a checkpoint's own files);
//! `read` (the safetensors header parser, fuzzed; the resharding reader,
//! each block checked and each file's `__metadata__` (run, step, rank, each
//! piece's place) checked against the manifest; `verify`, `newest_intact`);
//! `restore` (a damaged checkpoint's error names the newest intact one);
//! `consolidate`; `settings` (compared by field, shown by the caller's names:
//! the command's flags).

mod consolidate;
mod header;
mod manifest;
mod read;
mod reshard;
mod restore;
mod settings;
mod write;

pub use consolidate::consolidate;
pub use header::{parse_safetensors_header, FileTensor};
pub use manifest::{
    parse_manifest, read_manifest, seal_manifest, FileEntry, Manifest, Piece, Snapshot, TensorEntry,
};
pub use read::{newest_intact, verify};
pub use restore::{restore, Restored};
pub use settings::{differences, field, ADDED_SETTINGS, RESUMABLE_CHANGES};
pub use write::{check_dir, find, find_as, list, remove_leftovers, save, set_aside_after, Saved};

// Shared between the files of this module.
use read::Files;
use reshard::{plan_part, read_part, summary};
use write::{header_bytes, hex, le_bytes};

use crate::comm::Communicator;
use crate::nn::{Shard, StateTensor};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The manifest's format tag.
pub const FORMAT: &str = "shardnet-checkpoint/2";
/// The format before checkpoints carried a run id and the manifest its own
/// SHA-256: still read.
pub const FORMAT_1: &str = "shardnet-checkpoint/1";
/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = crate::output::CHECKPOINT_MANIFEST;
/// Largest safetensors header a reader accepts (bytes).
const MAX_HEADER: u64 = 256 << 20;

/// Bytes per hashed block of a checkpoint file.
pub const BLOCK: u64 = 16 << 20;
/// The directory of the checkpoint after `step` steps in `dir`.
pub fn step_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:09}"))
}

/// Rank `rank`'s file name of a checkpoint written by `ranks` ranks.
pub fn file_name(rank: usize, ranks: usize) -> String {
    format!("rank-{rank:05}-of-{ranks:05}.safetensors")
}
/// A malformed checkpoint file: `path` and what is wrong with it.
pub(super) fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {e}", path.display()))
}

/// Every rank fails with the lowest failing rank's message if any rank's
/// `mine` is an error. Collective.
pub(crate) fn agree_ok<T>(comm: &Communicator, mine: Result<T>) -> Result<T> {
    let msg = mine.as_ref().err().map(|e| e.to_string());
    let all: Vec<Option<String>> = comm.allgather_obj(&msg)?;
    match (
        mine,
        all.into_iter()
            .enumerate()
            .find_map(|(r, m)| m.map(|m| (r, m))),
    ) {
        (Err(e), _) => Err(e),
        (Ok(_), Some((r, m))) => Err(Error::Io(format!("rank {r}: {m}"))),
        (Ok(v), None) => Ok(v),
    }
}

/// The key of a tensor piece: who writes it (the lowest rank holding it).
type PieceKey = (String, Option<usize>);
