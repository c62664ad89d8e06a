//! [`restore`] (collective): the manifest from rank 0, the model and
//! settings checked, every rank's state tensors filled in place, the
//! scalars and the loop's position handed back.

use super::*;

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
    /// The run that wrote it (empty for a checkpoint of the first format).
    pub run: String,
    /// Bytes all ranks read.
    pub bytes: u64,
}

/// Read the checkpoint at (or newest under) `path` into `state`, after
/// checking that it is `model`'s with `settings`. Collective: every rank
/// fails with the same message if any cannot.
///
/// A damaged checkpoint's error names the newest intact one before it, and
/// the `--resume` that continues from it.
pub fn restore(
    comm: &Communicator,
    path: &Path,
    model: &str,
    settings: &[(String, String)],
    state: &[StateTensor],
    ranks_ok: &dyn Fn(usize) -> Result<()>,
) -> Result<Restored> {
    match restore_from(comm, path, model, settings, state, ranks_ok) {
        Ok(r) => Ok(r),
        Err(e) => {
            // Every rank fails (the errors are agreed, whatever their
            // kind); rank 0 looks for the way on.
            let hint = (comm.rank() == 0).then(|| intact_before(path));
            let hint: Option<String> = comm.bcast_obj(hint.as_ref(), 0)?;
            let h = hint.unwrap_or_default();
            Err(e.with_hint(&h))
        }
    }
}

/// Where to resume from when the checkpoint `path` names is damaged (it
/// fails [`verify`]): the newest intact checkpoint before it, as a
/// sentence; `None` when it is intact (the error has another cause) or
/// none is.
fn intact_before(path: &Path) -> Option<String> {
    let chosen = find(path).ok()?;
    if verify(&chosen).is_ok() {
        return None;
    }
    let step = read_manifest(&chosen).map_or(usize::MAX, |m| m.step);
    let step = chosen
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse().ok())
        .unwrap_or(step);
    let parent = match chosen.parent()? {
        p if p.as_os_str().is_empty() => Path::new("."),
        p => p,
    };
    let intact = newest_intact(parent, step)?;
    Some(format!(
        "\nThe newest intact checkpoint before it is {}: continue from it with --resume {} \
         (the damaged later ones are then set aside as step-N.damaged)",
        intact.display(),
        intact.display()
    ))
}

fn restore_from(
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
                let bytes =
                    std::fs::read(&p).map_err(|e| Error::caused(p.display().to_string(), e))?;
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
        run: manifest.run.clone(),
        bytes,
        dir,
    })
}
