//! Reading checkpoint files: each rank file opened once, its size, its
//! metadata and every block it reads checked against the manifest; a whole
//! checkpoint verified; the newest intact one found.

use super::*;

/// A safetensors file opened for reading by ranges.
pub(super) struct Reader {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) tensors: BTreeMap<String, FileTensor>,
    /// The blocks' digests (from the manifest) and which were checked.
    pub(super) blocks: Vec<String>,
    pub(super) checked: std::cell::RefCell<Vec<bool>>,
    /// Bytes read so far (checks included).
    pub(super) read: std::cell::Cell<u64>,
    /// The file's size (checked against the manifest when opened).
    pub(super) len: u64,
    /// What the file says of itself (`__metadata__`).
    pub(super) meta: FileMeta,
}

/// A rank file's `__metadata__`: who wrote it, for which checkpoint, and
/// where each of its tensors lies in its global tensor. Checked against
/// the manifest, so that an edited or mixed-up manifest cannot place a
/// file's values where they do not belong.
#[derive(Debug, Default)]
pub(super) struct FileMeta {
    pub(super) format: Option<String>,
    pub(super) run: Option<String>,
    pub(super) rank: Option<String>,
    pub(super) ranks: Option<String>,
    pub(super) step: Option<String>,
    pub(super) shards: BTreeMap<String, Shard>,
}

impl FileMeta {
    /// The `__metadata__` of a safetensors header `text` (JSON).
    fn parse(text: &[u8], name: &Path) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_slice(text).unwrap_or_default();
        let meta = &v["__metadata__"];
        let field = |k: &str| meta.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let shards = match field("shards") {
            Some(s) => serde_json::from_str(&s)
                .map_err(|e| io(name, format!("its metadata's shards cannot be read ({e})")))?,
            None => BTreeMap::new(),
        };
        Ok(FileMeta {
            format: field("format"),
            run: field("run"),
            rank: field("rank"),
            ranks: field("ranks"),
            step: field("step"),
            shards,
        })
    }

    /// Refuse a file that is not the one the manifest (`m`) lists as its
    /// `index`th.
    fn check(&self, m: &Manifest, index: usize, path: &Path) -> Result<()> {
        let want = [
            ("format", m.format.clone()),
            ("rank", index.to_string()),
            ("ranks", m.ranks.to_string()),
            ("step", m.step.to_string()),
            ("run", m.run.clone()),
        ];
        let got = [&self.format, &self.rank, &self.ranks, &self.step, &self.run];
        for ((what, expected), got) in want.iter().zip(got) {
            // A file of the first format has no run id.
            if *what == "run" && m.format == FORMAT_1 {
                continue;
            }
            if got.as_deref() != Some(expected.as_str()) {
                return Err(io(
                    path,
                    format!(
                        "its metadata says {what} {}, the manifest {expected}: the file belongs \
                         to another checkpoint, or the manifest was edited",
                        got.as_deref().unwrap_or("(none)")
                    ),
                ));
            }
        }
        Ok(())
    }
}
impl Reader {
    /// Open `path`, checking its size and header against `expect`; the
    /// blocks are checked as they are read.
    pub(super) fn open(path: &Path, expect: &FileEntry) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::caused(path.display().to_string(), e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::caused(path.display().to_string(), e))?
            .len();
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
        let meta = FileMeta::parse(&head[8..], path)?;
        let r = Reader {
            file,
            path: path.to_path_buf(),
            tensors,
            checked: std::cell::RefCell::new(vec![false; expect.blocks.len()]),
            blocks: expect.blocks.clone(),
            read: std::cell::Cell::new(head.len() as u64),
            len,
            meta,
        };
        r.check(0, head.len() as u64)?;
        Ok(r)
    }

    /// Check the SHA-256 of every block that bytes `at .. at + len` touch
    /// (once per block).
    pub(super) fn check(&self, at: u64, len: u64) -> Result<()> {
        self.check_with(at, len, None)
    }

    /// [`Reader::check`], hashing the blocks that lie wholly inside `read`
    /// (bytes already read at `at`) from memory rather than from the file.
    pub(super) fn check_with(&self, at: u64, len: u64, read: Option<&[u8]>) -> Result<()> {
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
    pub(super) fn read_into(&self, at: u64, dst: &mut [f32]) -> Result<()> {
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

/// Checkpoint files opened so far, by index, checked once each.
pub(super) struct Files<'a> {
    pub(super) dir: &'a Path,
    pub(super) manifest: &'a Manifest,
    pub(super) open: BTreeMap<usize, Reader>,
}
impl Files<'_> {
    pub(super) fn get(&mut self, i: usize) -> Result<&Reader> {
        if !self.open.contains_key(&i) {
            let entry = &self.manifest.files[i];
            let path = self.dir.join(&entry.name);
            let r = Reader::open(&path, entry)?;
            r.meta.check(self.manifest, i, &path)?;
            // Every tensor of the file has its place in the manifest: a
            // manifest that leaves one out was edited (a consolidated
            // model would silently lack it).
            let listed = |name: &String| {
                self.manifest
                    .tensors
                    .get(name)
                    .is_some_and(|t| t.pieces.iter().any(|p| p.file == i))
            };
            if let Some(name) = r.tensors.keys().find(|n| !listed(n)) {
                return Err(io(
                    &path,
                    format!(
                        "holds tensor {name}, which the manifest does not place in it: the \
                         manifest was edited or belongs to other files"
                    ),
                ));
            }
            self.open.insert(i, r);
        }
        self.open
            .get(&i)
            .ok_or_else(|| Error::Io("checkpoint file table".into()))
    }
}

/// Check the checkpoint in `dir` whole: its manifest, and every byte of
/// every file against the manifest's SHA-256 and the file's own metadata.
/// Reads it all.
pub fn verify(dir: &Path) -> Result<()> {
    let manifest = read_manifest(dir)?;
    let mut files = Files {
        dir,
        manifest: &manifest,
        open: BTreeMap::new(),
    };
    for i in 0..manifest.files.len() {
        let r = files.get(i)?;
        r.check(0, r.len)?;
    }
    Ok(())
}

/// The newest checkpoint of `dir` before step `before` that
/// [`verify`] passes, if any.
pub fn newest_intact(dir: &Path, before: usize) -> Option<PathBuf> {
    let all = list(dir).ok()?;
    all.into_iter()
        .rev()
        .filter(|(s, _)| *s < before)
        .map(|(_, d)| d)
        .find(|d| verify(d).is_ok())
}
