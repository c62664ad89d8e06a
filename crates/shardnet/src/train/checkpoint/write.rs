//! Writing ([`save`]): each rank its safetensors file (hashed as written,
//! atomically), rank 0 the manifest last; listing, pruning and finding
//! checkpoints in a directory.

use super::*;

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
        .map_err(|e| Error::caused(target.display().to_string(), e))
        .and_then(|_| {
            let mine: Vec<&StateTensor> = state
                .iter()
                .filter(|s| writer[&(s.name.clone(), s.shard.map(|s| s.offset))] == rank)
                .collect();
            let name = file_name(rank, ranks);
            let path = target.join(&name);
            let mut entry = None;
            crate::output::write_atomic_with(&path, |tmp| {
                entry = Some(write_safetensors(tmp, &mine, (rank, ranks), snap)?);
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
                .map_err(|e| Error::caused("checkpoint scalars", e))?;
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
                run: snap.run.into(),
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
                .map_err(|e| Error::caused("checkpoint manifest", e))?;
            crate::output::write_atomic(&target.join(MANIFEST), &seal_manifest(&json))
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
    let entries =
        std::fs::read_dir(dir).map_err(|e| Error::caused(dir.display().to_string(), e))?;
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
/// names that directory or a checkpoint in it; a resume from an older
/// checkpoint than the directory's newest only when every later one is
/// damaged ([`verify`] fails; [`set_aside_after`] then moves them aside).
pub fn check_dir(dir: &Path, resume: Option<&Path>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let Some((step, _)) = list(dir)?.pop() else {
        return Ok(());
    };
    let same = crate::output::same_path;
    let ours = resume.is_some_and(|r| same(r, dir) || r.parent().is_some_and(|p| same(p, dir)));
    if ours {
        // Resuming from an older checkpoint of this directory would write a
        // second history beside the later checkpoints (and pruning could
        // keep theirs): refused.
        let from = resume.map(find).transpose()?;
        if let Some(from) = from.filter(|f| f.parent().is_some_and(|p| same(p, dir))) {
            let mine = read_manifest(&from)?.step;
            let later: Vec<(usize, PathBuf)> =
                list(dir)?.into_iter().filter(|(s, _)| *s > mine).collect();
            if let Some((step, _)) = later.iter().rev().find(|(_, d)| verify(d).is_ok()) {
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

/// Rename every checkpoint of `dir` after step `step` (damaged ones, as
/// [`check_dir`] found, when a run resumes from an older one)
/// `step-N.damaged` (or `.damaged-2`, …): kept, never read or pruned.
pub fn set_aside_after(dir: &Path, step: usize) -> Result<()> {
    for (_, d) in list(dir)?.into_iter().filter(|(s, _)| *s > step) {
        let name = d
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let aside = (1..)
            .map(|k| match k {
                1 => d.with_file_name(format!("{name}.damaged")),
                k => d.with_file_name(format!("{name}.damaged-{k}")),
            })
            .find(|p| !p.exists())
            .unwrap_or_else(|| d.clone());
        std::fs::rename(&d, &aside).map_err(|e| Error::caused(d.display().to_string(), e))?;
    }
    Ok(())
}

/// Remove all but the newest `keep` checkpoints of `dir`, and unfinished
/// ones (no manifest) older than step `now`. Only what a checkpoint writes
/// is removed (its manifest first, so that a crash midway leaves an
/// unfinished checkpoint, never a damaged one; then its rank files and
/// temporaries): a directory that also holds other files keeps them, and
/// stays.
pub(super) fn prune(dir: &Path, keep: usize, now: usize) -> Result<()> {
    let done = list(dir)?;
    let n = done.len();
    for (_, d) in done.into_iter().take(n.saturating_sub(keep.max(1))) {
        remove_checkpoint(&d)?;
    }
    for e in std::fs::read_dir(dir)
        .map_err(|e| Error::caused(dir.display().to_string(), e))?
        .flatten()
    {
        let p = e.path();
        let step = e
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok());
        if step.is_some_and(|s| s < now) && !p.join(MANIFEST).exists() {
            let _ = remove_checkpoint(&p);
        }
    }
    Ok(())
}

/// Whether `name` is a file a checkpoint writes: a rank's file, or the
/// temporary of one or of the manifest (left by a process killed while
/// writing).
fn ours(name: &str) -> bool {
    let rank_file = name.starts_with("rank-") && name.ends_with(".safetensors");
    rank_file || temporary(name) || name == MANIFEST
}

/// Whether `name` is a temporary of [`crate::output::write_atomic_with`]
/// (`.{file}.tmp-{pid}-{n}`).
fn temporary(name: &str) -> bool {
    name.starts_with('.') && name.contains(".tmp-")
}

/// Remove the checkpoint directory `d`: its manifest, then its rank files
/// and temporaries, then the directory if nothing else is in it.
fn remove_checkpoint(d: &Path) -> Result<()> {
    match std::fs::remove_file(d.join(MANIFEST)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(d, e)),
        _ => {}
    }
    for e in std::fs::read_dir(d)
        .map_err(|e| Error::caused(d.display().to_string(), e))?
        .flatten()
    {
        if e.file_name().to_str().is_some_and(ours) && e.path().is_file() {
            std::fs::remove_file(e.path()).map_err(|err| io(&e.path(), err))?;
        }
    }
    // Not empty: a user's own files stay, with their directory.
    let _ = std::fs::remove_dir(d);
    Ok(())
}

/// Remove the temporaries a killed run left in the checkpoints of `dir`
/// (a second signal ends a process while it writes). Called by the run
/// that holds `dir`'s lock: no other run is writing them.
pub fn remove_leftovers(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)
        .map_err(|e| Error::caused(dir.display().to_string(), e))?
        .flatten()
    {
        let is_step = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("step-"));
        if !is_step || !e.path().is_dir() {
            continue;
        }
        for f in std::fs::read_dir(e.path())
            .map_err(|err| io(&e.path(), err))?
            .flatten()
        {
            let name = f.file_name();
            let name = name.to_str().unwrap_or("");
            if temporary(name) {
                std::fs::remove_file(f.path()).map_err(|err| io(&f.path(), err))?;
            }
        }
    }
    Ok(())
}

/// The checkpoint `path` (given as `--resume`) names: a checkpoint
/// directory (with a manifest), or a `--checkpoint-dir` (its newest
/// checkpoint).
pub fn find(path: &Path) -> Result<PathBuf> {
    find_as("--resume", path)
}

/// [`find`], the path given as `flag` (named in errors).
pub fn find_as(flag: &str, path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if path.exists() && !path.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: a file, not a checkpoint's directory (a step-* directory, or the \
             --checkpoint-dir holding them)",
            path.display()
        )));
    }
    if !path.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: no such directory",
            path.display()
        )));
    }
    match list(path)?.pop() {
        Some((_, d)) => Ok(d),
        None => Err(Error::Usage(format!(
            "{flag} {}: no checkpoint there (no {MANIFEST} in it or in a step-* directory; \
             a step-* directory without one is a checkpoint that was never finished)",
            path.display()
        ))),
    }
}

/// Write `state` to `path` as safetensors (f32, little-endian), as rank
/// `rank` of `ranks` for the checkpoint `snap`; returns (bytes, SHA-256
/// hex, the blocks' SHA-256).
pub(super) fn write_safetensors(
    path: &Path,
    state: &[&StateTensor],
    (rank, ranks): (usize, usize),
    snap: &Snapshot,
) -> Result<(u64, String, Vec<String>)> {
    let step = snap.step;
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
        "run": snap.run,
        "rank": rank.to_string(),
        "ranks": ranks.to_string(),
        "step": step.to_string(),
        "shards": serde_json::Value::Object(shards).to_string(),
    });
    header.insert("__metadata__".into(), meta);
    let h = header_bytes(header);
    let f = File::create(path).map_err(|e| Error::caused(path.display().to_string(), e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    let mut sha = Hashes::new();
    let mut put = |bytes: &[u8]| -> Result<()> {
        sha.update(bytes);
        w.write_all(bytes)
            .map_err(|e| Error::caused(path.display().to_string(), e))
    };
    put(&(h.len() as u64).to_le_bytes())?;
    put(&h)?;
    for s in state {
        s.with_values(|v| {
            // 64 MiB pieces: the hash and the write stay in cache-sized steps.
            for (k, chunk) in v.chunks(16 << 20).enumerate() {
                // Nothing non-finite is kept: the file is not written (nor,
                // on any rank, the manifest), and no checkpoint is pruned.
                if let Some(i) = chunk.iter().position(|x| !x.is_finite()) {
                    return Err(Error::Usage(format!(
                        "checkpoint of step {step}: {} holds {} at element {}, so it was not \
                         written and training stopped: the run diverged; the earlier \
                         checkpoints are kept; lower --lr (or --weight-decay)",
                        s.name,
                        chunk[i],
                        k * (16 << 20) + i
                    )));
                }
                put(&le_bytes(chunk))?;
            }
            Ok(())
        })?;
    }
    w.flush()
        .map_err(|e| Error::caused(path.display().to_string(), e))?;
    let (file, blocks) = sha.finish();
    Ok((8 + h.len() as u64 + at, file, blocks))
}

/// A safetensors header's bytes, padded with spaces so that the data
/// starts 8-aligned.
pub(super) fn header_bytes(header: serde_json::Map<String, serde_json::Value>) -> Vec<u8> {
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    h
}

/// f32 values as little-endian bytes (no copy on a little-endian machine).
pub(super) fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
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
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a whole stream and of each [`BLOCK`] of it.
pub(super) struct Hashes {
    file: Sha256,
    block: Sha256,
    filled: u64,
    blocks: Vec<String>,
}
impl Hashes {
    pub(super) fn new() -> Self {
        Hashes {
            file: Sha256::new(),
            block: Sha256::new(),
            filled: 0,
            blocks: Vec::new(),
        }
    }

    pub(super) fn update(&mut self, mut bytes: &[u8]) {
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

    pub(super) fn finish(mut self) -> (String, Vec<String>) {
        if self.filled > 0 {
            self.blocks.push(hex(&self.block.finalize()));
        }
        (hex(&self.file.finalize()), self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state tensor holding an infinity or a NaN is never written: the
    /// write fails naming it, the step and the element, and leaves no file.
    #[test]
    fn a_non_finite_value_is_never_written() {
        let dir = std::env::temp_dir().join(format!("shardnet-nonfinite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for bad in [f32::INFINITY, f32::NAN] {
            let mut v = vec![0.5f32; 10];
            v[7] = bad;
            let t = candle_core::Tensor::from_vec(v, 10, &crate::comm::HOST).unwrap();
            let var = candle_core::Var::from_tensor(&t).unwrap();
            let s = StateTensor::var("param/w", &var, None);
            let path = dir.join("rank.safetensors");
            let err = crate::output::write_atomic_with(&path, |tmp| {
                let snap = Snapshot {
                    run: "r",
                    model: "m",
                    settings: &[],
                    step: 12,
                    progress: serde_json::Value::Null,
                    scalars: serde_json::Value::Null,
                };
                write_safetensors(tmp, &[&s], (0, 1), &snap).map(|_| ())
            })
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("checkpoint of step 12: param/w holds"),
                "{err}"
            );
            assert!(err.contains("at element 7"), "{err}");
            assert_eq!(
                std::fs::read_dir(&dir).unwrap().count(),
                0,
                "a file was left"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
