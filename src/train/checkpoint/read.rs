//! Reading and resharding: the safetensors header parser (fuzzed) and the
//! reader that copies, for each state tensor, the byte ranges of the pieces
//! that overlap this rank's part, checking every block it reads.

use super::*;

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

/// The box `[lo, hi)` per dimension that a piece (or a request) covers in
/// the global tensor.
pub(super) fn extent(shape: &[usize], shard: Option<Shard>) -> Vec<(usize, usize)> {
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
pub(super) struct Part<'a> {
    pub(super) name: &'a str,
    pub(super) shape: &'a [usize],
    pub(super) want: Vec<(usize, usize)>,
    pub(super) count: usize,
    pub(super) boxes: Vec<PieceBox>,
}
impl Part<'_> {
    /// Read the part into `out` (row-major, [`Part::count`] values).
    pub(super) fn read(&self, files: &mut Files, out: &mut [f32]) -> Result<()> {
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
pub(super) fn read_part(
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
pub(super) fn plan_part<'a>(
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
        // Where the file says the piece lies must be where the manifest
        // puts it: else its values would land elsewhere in the tensor.
        let placed = reader.meta.shards.get(name).copied();
        if placed != piece.shard {
            let show = |s: Option<Shard>| {
                s.map_or("the whole tensor".to_string(), |s| {
                    format!(
                        "offset {} along dimension {} of {}",
                        s.offset, s.dim, s.global
                    )
                })
            };
            return Err(io(
                &reader.path,
                format!(
                    "tensor {name}: the file holds {}, the manifest says {}: the manifest was \
                     edited or belongs to other files",
                    show(placed),
                    show(piece.shard)
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
pub(super) fn summary<'a>(names: impl Iterator<Item = &'a String>) -> String {
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
pub(super) fn copy_box(
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
