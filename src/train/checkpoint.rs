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
pub const FORMAT: &str = "shardnet-checkpoint/1";

/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// Largest safetensors header a reader accepts (bytes).
const MAX_HEADER: u64 = 256 << 20;

/// Settings that may change between a checkpoint and its resume: how long
/// to train, what to write, and where; the rest must match.
pub const RESUMABLE_CHANGES: [&str; 12] = [
    "--epochs",
    "--max-steps",
    "--metrics",
    "--no-eval",
    "--warmup-steps",
    "--checkpoint-dir",
    "--checkpoint-every",
    "--keep",
    "--resume",
    "--log-dir",
    "--save-params",
    "--stop-after",
];

/// One rank's file of a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    /// Its name in the checkpoint directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
    /// The SHA-256 of each [`BLOCK`] bytes of it, hex: a rank that reads
    /// only part of a file checks the blocks it reads.
    pub blocks: Vec<String>,
}

/// Bytes per hashed block of a checkpoint file.
pub const BLOCK: u64 = 16 << 20;

/// SHA-256 of a whole stream and of each [`BLOCK`] of it.
struct Hashes {
    file: Sha256,
    block: Sha256,
    filled: u64,
    blocks: Vec<String>,
}

impl Hashes {
    fn new() -> Self {
        Hashes {
            file: Sha256::new(),
            block: Sha256::new(),
            filled: 0,
            blocks: Vec::new(),
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        self.file.update(bytes);
        while !bytes.is_empty() {
            let take = ((BLOCK - self.filled) as usize).min(bytes.len());
            self.block.update(&bytes[..take]);
            self.filled += take as u64;
            bytes = &bytes[take..];
            if self.filled == BLOCK {
                self.blocks
                    .push(hex(&std::mem::take(&mut self.block).finalize()));
                self.filled = 0;
            }
        }
    }

    fn finish(mut self) -> (String, Vec<String>) {
        if self.filled > 0 {
            self.blocks.push(hex(&self.block.finalize()));
        }
        (hex(&self.file.finalize()), self.blocks)
    }
}

/// One piece of a global tensor: which file holds it and where it lies.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Piece {
    /// Index into [`Manifest::files`] (the writing rank).
    pub file: usize,
    /// The piece's shape.
    pub shape: Vec<usize>,
    /// Where it lies in the global tensor (`None`: it is the whole tensor).
    pub shard: Option<Shard>,
}

/// A global tensor of the checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    /// The global tensor's shape.
    pub shape: Vec<usize>,
    /// The pieces that make it, in file order.
    pub pieces: Vec<Piece>,
}

/// What a checkpoint is: `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// The model (`mnist-mlp`, `face-head`, …).
    pub model: String,
    /// The run's settings as (flag, value).
    pub settings: Vec<(String, String)>,
    /// Ranks that wrote it.
    pub ranks: usize,
    /// Steps completed over the run.
    pub step: usize,
    /// The training loop's position and figures so far.
    pub progress: serde_json::Value,
    /// Each rank's scalar state (optimizer step, loss scale, iterator).
    pub scalars: Vec<serde_json::Value>,
    /// One file per rank, rank order.
    pub files: Vec<FileEntry>,
    /// Every global tensor by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// What [`save`] writes besides the tensors.
pub struct Snapshot<'a> {
    /// The model's name.
    pub model: &'a str,
    /// The run's settings.
    pub settings: &'a [(String, String)],
    /// Steps completed.
    pub step: usize,
    /// The loop's state (rank 0's is kept).
    pub progress: serde_json::Value,
    /// This rank's scalar state.
    pub scalars: serde_json::Value,
}

/// The directory of the checkpoint after `step` steps in `dir`.
pub fn step_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:09}"))
}

/// Rank `rank`'s file name of a checkpoint written by `ranks` ranks.
pub fn file_name(rank: usize, ranks: usize) -> String {
    format!("rank-{rank:05}-of-{ranks:05}.safetensors")
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
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

/// Write this rank's `state` and (rank 0) the manifest into
/// `dir/step-N/`, then keep the newest `keep` checkpoints. A checkpoint of
/// this step already there is replaced: its manifest goes first, so that
/// until the new one is written it counts as unfinished (a resume takes the
/// one before), never as a mix of old and new files. Collective.
pub fn save(
    comm: &Communicator,
    dir: &Path,
    keep: usize,
    state: &[StateTensor],
    snap: &Snapshot,
) -> Result<Saved> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let target = step_dir(dir, snap.step);
    let cleared = match rank {
        0 => Some(match std::fs::remove_file(target.join(MANIFEST)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&target, e)),
            _ => Ok(()),
        }),
        _ => None,
    };
    agree_ok(comm, cleared.unwrap_or(Ok(())))?;
    // Who holds what: the lowest rank holding a piece writes it.
    type Meta = Vec<(String, Vec<usize>, Option<Shard>)>;
    let mine: Meta = state
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), s.shard))
        .collect();
    let all: Vec<Meta> = comm.allgather_obj(&mine)?;
    let mut writer: BTreeMap<PieceKey, usize> = BTreeMap::new();
    for (r, meta) in all.iter().enumerate() {
        for (name, _, shard) in meta {
            writer
                .entry((name.clone(), shard.map(|s| s.offset)))
                .or_insert(r);
        }
    }
    let written = std::fs::create_dir_all(&target)
        .map_err(|e| io(&target, e))
        .and_then(|_| {
            let mine: Vec<&StateTensor> = state
                .iter()
                .filter(|s| writer[&(s.name.clone(), s.shard.map(|s| s.offset))] == rank)
                .collect();
            let name = file_name(rank, ranks);
            let path = target.join(&name);
            let mut entry = None;
            crate::output::write_atomic_with(&path, |tmp| {
                entry = Some(write_safetensors(tmp, &mine, rank, ranks, snap.step)?);
                Ok(())
            })?;
            let (bytes, sha256, blocks) = entry.ok_or_else(|| io(&path, "not written"))?;
            Ok(FileEntry {
                name,
                bytes,
                sha256,
                blocks,
            })
        });
    let written = agree_ok(comm, written)?;
    let files = comm.gather_obj(&written, 0)?;
    // As JSON text: the objects travel through bincode, which cannot carry
    // a free-form JSON value.
    let scalars = comm.gather_obj(&snap.scalars.to_string(), 0)?;
    let done = match (files, scalars) {
        (Some(files), Some(scalars)) => {
            let scalars = scalars
                .iter()
                .map(|s| serde_json::from_str(s))
                .collect::<serde_json::Result<Vec<serde_json::Value>>>()
                .map_err(|e| Error::Io(format!("checkpoint scalars: {e}")))?;
            let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
            for (r, meta) in all.iter().enumerate() {
                for (name, shape, shard) in meta {
                    if writer[&(name.clone(), shard.map(|s| s.offset))] != r {
                        continue;
                    }
                    let mut global = shape.clone();
                    if let Some(s) = shard {
                        if let Some(g) = global.get_mut(s.dim) {
                            *g = s.global;
                        }
                    }
                    let e = tensors.entry(name.clone()).or_insert(TensorEntry {
                        shape: global,
                        pieces: Vec::new(),
                    });
                    e.pieces.push(Piece {
                        file: r,
                        shape: shape.clone(),
                        shard: *shard,
                    });
                }
            }
            let manifest = Manifest {
                format: FORMAT.into(),
                model: snap.model.into(),
                settings: snap.settings.to_vec(),
                ranks,
                step: snap.step,
                progress: snap.progress.clone(),
                scalars,
                files,
                tensors,
            };
            let json = serde_json::to_vec_pretty(&manifest)
                .map_err(|e| Error::Io(format!("checkpoint manifest: {e}")))?;
            crate::output::write_atomic(&target.join(MANIFEST), &json)
                .and_then(|_| prune(dir, keep, snap.step))
        }
        _ => Ok(()),
    };
    let done: std::result::Result<(), String> = done.map_err(|e| e.to_string());
    let done: std::result::Result<(), String> = comm.bcast_obj((rank == 0).then_some(&done), 0)?;
    done.map_err(Error::Io)?;
    let bytes = comm.allreduce_obj(&written.bytes, |a, b| a + b)?;
    Ok(Saved { dir: target, bytes })
}

/// What [`save`] wrote.
#[derive(Clone, Debug)]
pub struct Saved {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Bytes of all ranks' files.
    pub bytes: u64,
}

/// The checkpoints in `dir` (those with a manifest), oldest first:
/// (step, directory).
pub fn list(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| io(dir, e))?;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if e.path().join(MANIFEST).is_file() {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Refuse a `--checkpoint-dir` that holds another run's checkpoints: a
/// run that starts afresh there would mix its checkpoints with them (and a
/// later `--resume` take the newest, maybe theirs). Allowed when `resume`
/// names that directory or a checkpoint in it.
pub fn check_dir(dir: &Path, resume: Option<&Path>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let Some((step, _)) = list(dir)?.pop() else {
        return Ok(());
    };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let ours = resume.is_some_and(|r| same(r, dir) || r.parent().is_some_and(|p| same(p, dir)));
    if ours {
        // Resuming from an older checkpoint of this directory would write a
        // second history beside the later checkpoints (and pruning could
        // keep theirs): refused.
        let from = resume.map(find).transpose()?;
        if let Some(from) = from.filter(|f| f.parent().is_some_and(|p| same(p, dir))) {
            let mine = read_manifest(&from)?.step;
            if mine < step {
                return Err(Error::Usage(format!(
                    "--resume {}: it holds later checkpoints (after step {step}) than the one \
                     resumed (step {mine}); write this run to another --checkpoint-dir",
                    dir.display()
                )));
            }
        }
        return Ok(());
    }
    Err(Error::Usage(format!(
        "--checkpoint-dir {}: it holds checkpoints of another run (the newest after step \
         {step}); continue that run with --resume {}, or give an empty directory",
        dir.display(),
        dir.display()
    )))
}

/// Remove all but the newest `keep` checkpoints of `dir`, and unfinished
/// ones (no manifest) older than step `now`.
fn prune(dir: &Path, keep: usize, now: usize) -> Result<()> {
    let done = list(dir)?;
    let n = done.len();
    for (_, d) in done.into_iter().take(n.saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(&d).map_err(|e| io(&d, e))?;
    }
    for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
        let p = e.path();
        let step = e
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok());
        if step.is_some_and(|s| s < now) && !p.join(MANIFEST).exists() {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
    Ok(())
}

/// The checkpoint `path` names: a checkpoint directory (with a manifest),
/// or a `--checkpoint-dir` (its newest checkpoint).
pub fn find(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(Error::Usage(format!(
            "--resume {}: no such directory",
            path.display()
        )));
    }
    match list(path)?.pop() {
        Some((_, d)) => Ok(d),
        None => Err(Error::Usage(format!(
            "--resume {}: no checkpoint there (no {MANIFEST} in it or in a step-* directory; \
             a step-* directory without one is a checkpoint that was never finished)",
            path.display()
        ))),
    }
}

/// Read and check the manifest of checkpoint directory `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
    parse_manifest(&bytes, &path)
}

/// A manifest from its bytes; `path` names it in errors.
pub fn parse_manifest(bytes: &[u8], path: &Path) -> Result<Manifest> {
    let m: Manifest = serde_json::from_slice(bytes)
        .map_err(|e| io(path, format!("not a shardnet checkpoint manifest ({e})")))?;
    if m.format != FORMAT {
        return Err(io(
            path,
            format!("format '{}', this shardnet reads '{FORMAT}'", m.format),
        ));
    }
    if m.files.len() != m.ranks || m.scalars.len() != m.ranks || m.ranks == 0 {
        return Err(io(
            path,
            format!(
                "{} ranks, but {} files and {} scalar states",
                m.ranks,
                m.files.len(),
                m.scalars.len()
            ),
        ));
    }
    if let Some(f) = m
        .files
        .iter()
        .find(|f| Path::new(&f.name).file_name() != Some(f.name.as_ref()))
    {
        return Err(io(
            path,
            format!(
                "file '{}' is not a file name in the checkpoint's directory",
                f.name
            ),
        ));
    }
    for (name, t) in &m.tensors {
        for p in &t.pieces {
            let fits = p.file < m.ranks
                && p.shape.len() == t.shape.len()
                && match p.shard {
                    None => p.shape == t.shape,
                    Some(s) => {
                        s.dim < t.shape.len()
                            && s.global == t.shape[s.dim]
                            && s.offset
                                .checked_add(p.shape[s.dim])
                                .is_some_and(|e| e <= s.global)
                            && (0..t.shape.len()).all(|d| d == s.dim || p.shape[d] == t.shape[d])
                    }
                };
            if !fits {
                return Err(io(
                    path,
                    format!(
                        "tensor {name}: a piece {p:?} does not fit its shape {:?}",
                        t.shape
                    ),
                ));
            }
        }
        if let Some((a, b)) = overlap(&t.pieces) {
            return Err(io(
                path,
                format!("tensor {name}: pieces {a:?} and {b:?} overlap"),
            ));
        }
    }
    Ok(m)
}

/// Two pieces of one tensor (each of which fits it) that share values, if
/// any: a value written twice would be counted twice where [`read_part`]
/// checks that a part is covered, and hide a hole. Pieces without values
/// share none; two with values overlap unless both are split along the
/// same dimension at disjoint offsets (each spans every other dimension).
fn overlap(pieces: &[Piece]) -> Option<(&Piece, &Piece)> {
    let mut full: Vec<&Piece> = pieces
        .iter()
        .filter(|p| p.shape.iter().all(|&n| n > 0))
        .collect();
    let [first, second, ..] = full[..] else {
        return None;
    };
    let split = |p: &Piece| p.shard.map(|s| s.dim);
    if let Some(p) = full
        .iter()
        .find(|p| p.shard.is_none() || split(p) != split(first))
    {
        let other = if std::ptr::eq(*p, first) {
            second
        } else {
            first
        };
        return Some((other, p));
    }
    let span = |p: &Piece| {
        p.shard
            .map_or((0, 0), |s| (s.offset, s.offset + p.shape[s.dim]))
    };
    full.sort_by_key(|p| span(p));
    full.windows(2)
        .find(|w| span(w[1]).0 < span(w[0]).1)
        .map(|w| (w[0], w[1]))
}

/// Flags added after checkpoints were first written, with the value (as
/// recorded: JSON) that gives what a checkpoint without them was trained
/// with: such a checkpoint resumes with those values and is refused with
/// others.
pub const ADDED_FLAGS: [(&str, &str); 4] = [
    ("--optimizer", "\"adam\""),
    ("--momentum", "0.9"),
    ("--weight-decay", "null"),
    ("--unfused-update", "false"),
];

/// The settings of `ours` that differ from the checkpoint's (flags of
/// [`RESUMABLE_CHANGES`] aside; a flag of [`ADDED_FLAGS`] the checkpoint
/// lacks counts at its value there), as one line each.
pub fn differences(theirs: &[(String, String)], ours: &[(String, String)]) -> Vec<String> {
    let map = |s: &[(String, String)]| -> BTreeMap<String, String> {
        s.iter()
            .filter(|(k, _)| !RESUMABLE_CHANGES.contains(&k.as_str()))
            .cloned()
            .collect()
    };
    let (mut a, b) = (map(theirs), map(ours));
    for (flag, then) in ADDED_FLAGS {
        if b.contains_key(flag) && !a.contains_key(flag) {
            a.insert(flag.to_string(), then.to_string());
        }
    }
    let mut out = Vec::new();
    for k in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
        let (x, y) = (a.get(k), b.get(k));
        if x != y {
            let show = |v: Option<&String>| v.map_or("(not set)".to_string(), |v| v.to_string());
            out.push(format!("{k}: checkpoint {}, this run {}", show(x), show(y)));
        }
    }
    out
}

/// Write `state` to `path` as safetensors (f32, little-endian); returns
/// (bytes, SHA-256 hex, the blocks' SHA-256).
fn write_safetensors(
    path: &Path,
    state: &[&StateTensor],
    rank: usize,
    ranks: usize,
    step: usize,
) -> Result<(u64, String, Vec<String>)> {
    let mut header = serde_json::Map::new();
    let mut shards = serde_json::Map::new();
    let mut at = 0u64;
    for s in state {
        let n = 4 * s.elem_count() as u64;
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": "F32", "shape": s.shape, "data_offsets": [at, at + n]}),
        );
        if let Some(sh) = s.shard {
            shards.insert(
                s.name.clone(),
                serde_json::json!({"dim": sh.dim, "offset": sh.offset, "global": sh.global}),
            );
        }
        at += n;
    }
    let meta = serde_json::json!({
        "format": FORMAT,
        "rank": rank.to_string(),
        "ranks": ranks.to_string(),
        "step": step.to_string(),
        "shards": serde_json::Value::Object(shards).to_string(),
    });
    header.insert("__metadata__".into(), meta);
    let h = header_bytes(header);
    let f = File::create(path).map_err(|e| io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    let mut sha = Hashes::new();
    let mut put = |bytes: &[u8]| -> Result<()> {
        sha.update(bytes);
        w.write_all(bytes).map_err(|e| io(path, e))
    };
    put(&(h.len() as u64).to_le_bytes())?;
    put(&h)?;
    for s in state {
        s.with_values(|v| {
            // 64 MiB pieces: the hash and the write stay in cache-sized steps.
            for chunk in v.chunks(16 << 20) {
                put(&le_bytes(chunk))?;
            }
            Ok(())
        })?;
    }
    w.flush().map_err(|e| io(path, e))?;
    let (file, blocks) = sha.finish();
    Ok((8 + h.len() as u64 + at, file, blocks))
}

/// A safetensors header's bytes, padded with spaces so that the data
/// starts 8-aligned.
fn header_bytes(header: serde_json::Map<String, serde_json::Value>) -> Vec<u8> {
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    h
}

/// f32 values as little-endian bytes (no copy on a little-endian machine).
fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and any byte is a valid u8; the slice
        // covers exactly the values' memory.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        })
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One tensor of a safetensors file: its shape and where its data starts
/// (bytes from the file's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileTensor {
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte offset of its first value in the file.
    pub start: u64,
}

/// The f32 tensors of a safetensors file from its first bytes (`head`: at
/// least the 8-byte length and the header) and its length; `name` names
/// the file in errors. Any other dtype, an offset outside the file, a size
/// that does not match the shape, overlapping tensors, or a header that is
/// not JSON is an error, never a panic.
pub fn parse_safetensors_header(
    head: &[u8],
    file_len: u64,
    name: &str,
) -> Result<BTreeMap<String, FileTensor>> {
    let bad = |why: String| Error::Io(format!("{name}: {why}"));
    let Some(len) = head.get(..8) else {
        return Err(bad(format!(
            "{} bytes: too short for a safetensors file",
            head.len()
        )));
    };
    let n = u64::from_le_bytes([
        len[0], len[1], len[2], len[3], len[4], len[5], len[6], len[7],
    ]);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(bad(format!(
            "header of {n} bytes in a file of {file_len}: not a safetensors file, or truncated"
        )));
    }
    let Some(text) = head.get(8..8 + n as usize) else {
        return Err(bad("truncated header".into()));
    };
    let v: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| bad(format!("the safetensors header is not JSON ({e})")))?;
    let serde_json::Value::Object(map) = v else {
        return Err(bad("the safetensors header is not a JSON object".into()));
    };
    let data = 8 + n;
    let mut out = BTreeMap::new();
    let mut spans = Vec::new();
    for (key, e) in map {
        if key == "__metadata__" {
            continue;
        }
        let dtype = e.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        if dtype != "F32" {
            return Err(bad(format!(
                "tensor {key} is '{dtype}', checkpoints hold F32"
            )));
        }
        let shape: Option<Vec<usize>> = e.get("shape").and_then(|s| s.as_array()).and_then(|a| {
            a.iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect()
        });
        let offsets: Option<Vec<u64>> = e
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
        let (Some(shape), Some(offsets)) = (shape, offsets) else {
            return Err(bad(format!("tensor {key}: no valid shape or data_offsets")));
        };
        let [a, b] = offsets[..] else {
            return Err(bad(format!("tensor {key}: data_offsets needs 2 values")));
        };
        let want = shape
            .iter()
            .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64));
        if b < a || Some(b - a) != want || data.checked_add(b).is_none_or(|end| end > file_len) {
            return Err(bad(format!(
                "tensor {key}: bytes {a}..{b} for shape {shape:?} in a file of {file_len} bytes \
                 (truncated or corrupt)"
            )));
        }
        spans.push((a, b, key.clone()));
        out.insert(
            key,
            FileTensor {
                shape,
                start: data + a,
            },
        );
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(format!("tensors {} and {} overlap", w[0].2, w[1].2)));
        }
    }
    Ok(out)
}

/// A safetensors file opened for reading by ranges.
struct Reader {
    file: File,
    path: PathBuf,
    tensors: BTreeMap<String, FileTensor>,
    /// The blocks' digests (from the manifest) and which were checked.
    blocks: Vec<String>,
    checked: std::cell::RefCell<Vec<bool>>,
    /// Bytes read so far (checks included).
    read: std::cell::Cell<u64>,
    /// The file's size (checked against the manifest when opened).
    len: u64,
}

impl Reader {
    /// Open `path`, checking its size and header against `expect`; the
    /// blocks are checked as they are read.
    fn open(path: &Path, expect: &FileEntry) -> Result<Self> {
        let file = File::open(path).map_err(|e| io(path, e))?;
        let len = file.metadata().map_err(|e| io(path, e))?.len();
        if expect.bytes != len || expect.blocks.len() as u64 != len.div_ceil(BLOCK) {
            return Err(io(
                path,
                format!(
                    "{len} bytes, the manifest says {} in {} blocks: truncated or replaced",
                    expect.bytes,
                    expect.blocks.len()
                ),
            ));
        }
        let mut first = [0u8; 8];
        file.read_exact_at(&mut first, 0)
            .map_err(|e| io(path, format!("cannot read the header ({e})")))?;
        let n = u64::from_le_bytes(first)
            .min(MAX_HEADER)
            .min(len.saturating_sub(8));
        let mut head = vec![0u8; 8 + n as usize];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| io(path, format!("cannot read the header ({e})")))?;
        let tensors = parse_safetensors_header(&head, len, &path.display().to_string())?;
        let r = Reader {
            file,
            path: path.to_path_buf(),
            tensors,
            checked: std::cell::RefCell::new(vec![false; expect.blocks.len()]),
            blocks: expect.blocks.clone(),
            read: std::cell::Cell::new(head.len() as u64),
            len,
        };
        r.check(0, head.len() as u64)?;
        Ok(r)
    }

    /// Check the SHA-256 of every block that bytes `at .. at + len` touch
    /// (once per block).
    fn check(&self, at: u64, len: u64) -> Result<()> {
        self.check_with(at, len, None)
    }

    /// [`Reader::check`], hashing the blocks that lie wholly inside `read`
    /// (bytes already read at `at`) from memory rather than from the file.
    fn check_with(&self, at: u64, len: u64, read: Option<&[u8]>) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let file_len = self.len;
        let mut checked = self.checked.borrow_mut();
        let mut buf = Vec::new();
        for b in at / BLOCK..=(at + len - 1) / BLOCK {
            let b = b as usize;
            if checked.get(b).copied().unwrap_or(true) {
                continue;
            }
            let start = b as u64 * BLOCK;
            let n = BLOCK.min(file_len.saturating_sub(start));
            let inside = start >= at && start + n <= at + len;
            let bytes: &[u8] = match read {
                Some(r) if inside => &r[(start - at) as usize..(start - at + n) as usize],
                _ => {
                    buf.resize(n as usize, 0u8);
                    self.file
                        .read_exact_at(&mut buf, start)
                        .map_err(|e| io(&self.path, format!("reading block {b}: {e}")))?;
                    self.read.set(self.read.get() + n);
                    &buf
                }
            };
            if hex(&Sha256::digest(bytes)) != self.blocks[b] {
                return Err(io(
                    &self.path,
                    format!(
                        "bytes {start}..{} differ from the manifest's SHA-256: the file is \
                         corrupt or replaced",
                        start + n
                    ),
                ));
            }
            checked[b] = true;
        }
        Ok(())
    }

    /// Read `count` f32 values at byte `at` into `dst`.
    fn read_into(&self, at: u64, dst: &mut [f32]) -> Result<()> {
        // SAFETY: any bit pattern is a valid f32; the slice covers exactly
        // dst's memory.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        };
        self.read.set(self.read.get() + bytes.len() as u64);
        self.file.read_exact_at(bytes, at).map_err(|e| {
            io(
                &self.path,
                format!("reading {} bytes at {at}: {e}", bytes.len()),
            )
        })?;
        // Blocks wholly read are hashed from what was read; the partly
        // read ones at the ends are read whole (once each).
        self.check_with(at, bytes.len() as u64, Some(bytes))?;
        if cfg!(target_endian = "big") {
            for v in dst.iter_mut() {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        Ok(())
    }
}

/// The box `[lo, hi)` per dimension that a piece (or a request) covers in
/// the global tensor.
fn extent(shape: &[usize], shard: Option<Shard>) -> Vec<(usize, usize)> {
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| match shard {
            Some(s) if s.dim == d => (s.offset, s.offset + n),
            _ => (0, n),
        })
        .collect()
}

/// Checkpoint files opened so far, by index, checked once each.
struct Files<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    open: BTreeMap<usize, Reader>,
}

impl Files<'_> {
    fn get(&mut self, i: usize) -> Result<&Reader> {
        if !self.open.contains_key(&i) {
            let entry = &self.manifest.files[i];
            let path = self.dir.join(&entry.name);
            let r = Reader::open(&path, entry)?;
            self.open.insert(i, r);
        }
        self.open
            .get(&i)
            .ok_or_else(|| Error::Io("checkpoint file table".into()))
    }
}

/// One piece's share of a part: (file, byte start of the piece, its shape,
/// the box it covers, the box it gives the part), in global coordinates.
type PieceBox = (
    usize,
    u64,
    Vec<usize>,
    Vec<(usize, usize)>,
    Vec<(usize, usize)>,
);

/// Where the part `shape`/`shard` of a global tensor comes from: each
/// overlapping piece's (file, byte start, shape, box, overlap), checked
/// against its file; and the part's size.
struct Part<'a> {
    name: &'a str,
    shape: &'a [usize],
    want: Vec<(usize, usize)>,
    count: usize,
    boxes: Vec<PieceBox>,
}

impl Part<'_> {
    /// Read the part into `out` (row-major, [`Part::count`] values).
    fn read(&self, files: &mut Files, out: &mut [f32]) -> Result<()> {
        if out.len() != self.count {
            return Err(Error::Usage(format!(
                "tensor {}: {} values held for shape {:?}",
                self.name,
                out.len(),
                self.shape
            )));
        }
        for (file, start, piece_shape, have, both) in &self.boxes {
            let reader = files.get(*file)?;
            copy_box(
                reader,
                *start,
                piece_shape,
                have,
                &self.want,
                self.shape,
                both,
                out,
            )?;
        }
        Ok(())
    }
}

/// Read the part `shape`/`shard` of global tensor `name` from the
/// checkpoint's pieces into `out` (row-major f32 values).
fn read_part(
    files: &mut Files,
    name: &str,
    shape: &[usize],
    shard: Option<Shard>,
    out: &mut [f32],
) -> Result<()> {
    plan_part(files, name, shape, shard)?.read(files, out)
}

/// The [`Part`] `shape`/`shard` of global tensor `name`: every piece it
/// needs is checked against its file before any memory is taken for it.
fn plan_part<'a>(
    files: &mut Files,
    name: &'a str,
    shape: &'a [usize],
    shard: Option<Shard>,
) -> Result<Part<'a>> {
    let manifest = files.manifest;
    let entry = manifest.tensors.get(name).ok_or_else(|| {
        Error::Usage(format!(
            "the checkpoint has no tensor {name}: it was written by a different model \
             (its tensors: {})",
            summary(manifest.tensors.keys())
        ))
    })?;
    let mut global = shape.to_vec();
    if let Some(s) = shard {
        if let Some(g) = global.get_mut(s.dim) {
            *g = s.global;
        }
    }
    if global != entry.shape {
        return Err(Error::Usage(format!(
            "tensor {name} is {:?} in the checkpoint and {global:?} in this model",
            entry.shape
        )));
    }
    let want = extent(shape, shard);
    let too_large = || {
        io(
            &files.dir.join(MANIFEST),
            format!("tensor {name}: {global:?} is too large"),
        )
    };
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(too_large)?;
    // Every piece is checked against its file before the part's memory is
    // taken: the files, not the manifest, bound how much that is.
    let mut boxes = Vec::new();
    let mut covered = 0usize;
    for piece in &entry.pieces {
        let have = extent(&piece.shape, piece.shard);
        let both: Vec<(usize, usize)> = want
            .iter()
            .zip(&have)
            .map(|(w, h)| (w.0.max(h.0), w.1.min(h.1)))
            .collect();
        if both.iter().any(|(a, b)| a >= b) {
            continue;
        }
        // The pieces fit the tensor and do not overlap (parse_manifest),
        // so this stays at most `count`.
        let n: usize = both.iter().map(|(a, b)| b - a).product();
        covered = covered.saturating_add(n);
        let reader = files.get(piece.file)?;
        let ft = reader.tensors.get(name).ok_or_else(|| {
            io(
                &reader.path,
                format!("no tensor {name}, which the manifest places there"),
            )
        })?;
        if ft.shape != piece.shape {
            return Err(io(
                &reader.path,
                format!(
                    "tensor {name} is {:?}, the manifest says {:?}",
                    ft.shape, piece.shape
                ),
            ));
        }
        boxes.push((piece.file, ft.start, piece.shape.clone(), have, both));
    }
    if covered != count {
        return Err(io(
            &files.dir.join(MANIFEST),
            format!(
                "tensor {name}: the checkpoint's pieces cover {covered} of the {count} values \
                 this rank needs"
            ),
        ));
    }
    Ok(Part {
        name,
        shape,
        want,
        count,
        boxes,
    })
}

/// At most a few names of `names`, for messages.
fn summary<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&String> = names.collect();
    let shown: Vec<&str> = v.iter().take(6).map(|s| s.as_str()).collect();
    if v.len() > shown.len() {
        format!("{}, … ({} in all)", shown.join(", "), v.len())
    } else {
        shown.join(", ")
    }
}

/// Copy the box `both` (global coordinates) from a piece stored at byte
/// `start` (shape `src_shape`, covering `src`) into `out` (shape
/// `dst_shape`, covering `dst`): contiguous runs, one read each.
#[allow(clippy::too_many_arguments)]
fn copy_box(
    reader: &Reader,
    start: u64,
    src_shape: &[usize],
    src: &[(usize, usize)],
    dst: &[(usize, usize)],
    dst_shape: &[usize],
    both: &[(usize, usize)],
    out: &mut [f32],
) -> Result<()> {
    let nd = both.len();
    if nd == 0 {
        return reader.read_into(start, &mut out[..1]);
    }
    // The run: trailing dimensions the box spans fully in both layouts,
    // plus the next one (partly).
    let mut k = nd; // dims k.. are full in both
    while k > 0 {
        let d = k - 1;
        let len = both[d].1 - both[d].0;
        if len == src_shape[d] && len == dst_shape[d] {
            k -= 1;
        } else {
            break;
        }
    }
    let inner: usize = (k..nd).map(|d| both[d].1 - both[d].0).product();
    let (run_dim, run) = if k == 0 {
        (None, inner)
    } else {
        (Some(k - 1), inner * (both[k - 1].1 - both[k - 1].0))
    };
    let strides = |shape: &[usize]| -> Vec<usize> {
        let mut s = vec![1usize; nd];
        for d in (0..nd.saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    // Iterate over the box's indices in dims 0..run_dim (exclusive).
    let outer_dims = run_dim.unwrap_or(0);
    let mut idx: Vec<usize> = (0..outer_dims).map(|d| both[d].0).collect();
    loop {
        let mut so = 0usize;
        let mut dof = 0usize;
        for d in 0..nd {
            let g = if d < outer_dims { idx[d] } else { both[d].0 };
            so += (g - src[d].0) * ss[d];
            dof += (g - dst[d].0) * ds[d];
        }
        reader.read_into(start + 4 * so as u64, &mut out[dof..dof + run])?;
        // Next index (odometer).
        let mut d = outer_dims;
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < both[d].1 {
                break;
            }
            idx[d] = both[d].0;
        }
    }
}

/// What [`restore`] hands back to the loop.
pub struct Restored {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its step.
    pub step: usize,
    /// The loop's state.
    pub progress: serde_json::Value,
    /// This rank's scalar state: its own when the rank count is the
    /// checkpoint's, rank 0's otherwise.
    pub scalars: serde_json::Value,
    /// The ranks that wrote it.
    pub ranks: usize,
    /// Bytes all ranks read.
    pub bytes: u64,
}

/// Read the checkpoint at (or newest under) `path` into `state`, after
/// checking that it is `model`'s with `settings`. Collective: every rank
/// fails with the same message if any cannot.
pub fn restore(
    comm: &Communicator,
    path: &Path,
    model: &str,
    settings: &[(String, String)],
    state: &[StateTensor],
    ranks_ok: &dyn Fn(usize) -> Result<()>,
) -> Result<Restored> {
    let rank = comm.rank();
    // Rank 0 finds and reads the manifest; every rank gets it or its error.
    let found = (rank == 0).then(|| {
        find(path)
            .and_then(|d| {
                let p = d.join(MANIFEST);
                let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
                parse_manifest(&bytes, &p)?;
                Ok((d, String::from_utf8_lossy(&bytes).into_owned()))
            })
            .map_err(|e| e.to_string())
    });
    let found: std::result::Result<(PathBuf, String), String> =
        comm.bcast_obj(found.as_ref(), 0)?;
    let (dir, text) = found.map_err(Error::Usage)?;
    let manifest = parse_manifest(text.as_bytes(), &dir.join(MANIFEST))?;
    if manifest.model != model {
        return Err(Error::Usage(format!(
            "--resume {}: a checkpoint of {}, not {model}",
            dir.display(),
            manifest.model
        )));
    }
    if manifest.ranks != comm.size() {
        ranks_ok(manifest.ranks).map_err(|e| {
            Error::Usage(format!(
                "--resume {}: written by {} ranks, this run has {}: {e}",
                dir.display(),
                manifest.ranks,
                comm.size()
            ))
        })?;
    }
    let diff = differences(&manifest.settings, settings);
    if !diff.is_empty() {
        return Err(Error::Usage(format!(
            "--resume {}: the checkpoint was written with other settings; run with the \
             checkpoint's, or start afresh:\n  {}",
            dir.display(),
            diff.join("\n  ")
        )));
    }
    let read = (|| {
        let mut files = Files {
            dir: &dir,
            manifest: &manifest,
            open: BTreeMap::new(),
        };
        for s in state {
            // Straight into the tensor's own memory: no second copy.
            s.fill(|out| read_part(&mut files, &s.name, &s.shape, s.shard, out))?;
        }
        Ok(files.open.values().map(|r| r.read.get()).sum::<u64>())
    })();
    let read = agree_ok(comm, read)?;
    let bytes = comm.allreduce_obj(&read, |a, b| a + b)?;
    // Every tensor of the checkpoint must have been taken by some rank: one
    // left over belongs to a model this one is not.
    let mine: Vec<String> = state.iter().map(|s| s.name.clone()).collect();
    let taken: std::collections::BTreeSet<String> =
        comm.allgather_obj(&mine)?.into_iter().flatten().collect();
    let left: Vec<&String> = manifest
        .tensors
        .keys()
        .filter(|k| !taken.contains(*k))
        .collect();
    if !left.is_empty() {
        return Err(Error::Usage(format!(
            "--resume {}: the checkpoint holds tensors this model has not: {} — it was written \
             by a different model",
            dir.display(),
            summary(left.into_iter())
        )));
    }
    let same = manifest.ranks == comm.size();
    Ok(Restored {
        step: manifest.step,
        progress: manifest.progress.clone(),
        scalars: manifest.scalars[if same { rank } else { 0 }].clone(),
        ranks: manifest.ranks,
        bytes,
        dir,
    })
}

/// Write the parameters (`param/…`) of the checkpoint at (or newest under)
/// `path` as one single-device safetensors file `out`, under their own
/// names, one tensor in memory at a time. Returns (tensors, bytes).
pub fn consolidate(path: &Path, out: &Path) -> Result<(usize, u64)> {
    let dir = find(path)?;
    let manifest = read_manifest(&dir)?;
    let params: Vec<(&String, &TensorEntry)> = manifest
        .tensors
        .iter()
        .filter(|(k, _)| k.starts_with("param/"))
        .collect();
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, t) in &params {
        let end = t
            .shape
            .iter()
            .try_fold(4u64, |n, &d| n.checked_mul(d as u64))
            .and_then(|n| at.checked_add(n))
            .ok_or_else(|| {
                io(
                    &dir.join(MANIFEST),
                    format!("tensor {name}: {:?} is too large", t.shape),
                )
            })?;
        let plain = name.trim_start_matches("param/");
        header.insert(
            plain.to_string(),
            serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "model": manifest.model,
            "step": manifest.step.to_string(),
            "from": dir.display().to_string(),
        }),
    );
    let h = header_bytes(header);
    let mut files = Files {
        dir: &dir,
        manifest: &manifest,
        open: BTreeMap::new(),
    };
    crate::output::write_atomic_with(out, |tmp| {
        let f = File::create(tmp).map_err(|e| io(tmp, e))?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
        let mut put = |b: &[u8]| w.write_all(b).map_err(|e| io(out, e));
        put(&(h.len() as u64).to_le_bytes())?;
        put(&h)?;
        for (name, t) in &params {
            // Checked against the files before its memory is taken.
            let part = plan_part(&mut files, name, &t.shape, None)?;
            let mut values = vec![0f32; part.count];
            part.read(&mut files, &mut values)?;
            put(&le_bytes(&values))?;
        }
        w.flush().map_err(|e| io(out, e))
    })?;
    Ok((params.len(), 8 + h.len() as u64 + at))
}
