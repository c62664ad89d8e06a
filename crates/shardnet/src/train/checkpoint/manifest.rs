//! The manifest (`manifest.json`): what a checkpoint holds and where, each
//! file's size and SHA-256 (whole and per block), and its own SHA-256 as its
//! last field (`manifest_sha256`); its parser, which refuses a manifest
//! whose checksum does not match (edited or damaged), and pieces that
//! overlap, leave their tensor or name a file outside.

use super::*;

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
    /// [`FORMAT`] (or [`FORMAT_1`]: no run id, no checksum).
    pub format: String,
    /// The run's id: the same in every checkpoint of a run and its
    /// resumes, and in each rank file's `__metadata__`.
    #[serde(default)]
    pub run: String,
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
    /// The run's id.
    pub run: &'a str,
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

/// Read and check the manifest of checkpoint directory `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = std::fs::read(&path).map_err(|e| Error::caused(path.display().to_string(), e))?;
    parse_manifest(&bytes, &path)
}

/// A manifest from its bytes; `path` names it in errors.
pub fn parse_manifest(bytes: &[u8], path: &Path) -> Result<Manifest> {
    let m: Manifest = serde_json::from_slice(bytes)
        .map_err(|e| io(path, format!("not a shardnet checkpoint manifest ({e})")))?;
    if m.format != FORMAT && m.format != FORMAT_1 {
        return Err(io(
            path,
            format!("format '{}', this shardnet reads '{FORMAT}'", m.format),
        ));
    }
    if m.format == FORMAT {
        let why = match unseal(bytes) {
            Some((head, sum)) if hex(&Sha256::digest(head)) == sum => None,
            Some(_) => Some("its SHA-256 (manifest_sha256) does not match its content"),
            None => Some("it has no SHA-256 of itself (manifest_sha256, its last field)"),
        };
        if let Some(why) = why {
            return Err(io(
                path,
                format!(
                    "{why}: the manifest was edited or damaged and is not trusted; resume \
                     from an older checkpoint"
                ),
            ));
        }
        if m.run.is_empty() {
            return Err(io(path, "no run id ('run')"));
        }
    } else if !m.run.is_empty() {
        // Format 1 had no run id, and every later manifest has one: a
        // manifest whose format was edited to 1 must not skip the check.
        return Err(io(
            path,
            format!(
                "it says format '{FORMAT_1}', which had no run id, yet it has one: the manifest \
                 was edited or damaged and is not trusted; resume from an older checkpoint"
            ),
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
pub(super) fn overlap(pieces: &[Piece]) -> Option<(&Piece, &Piece)> {
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

/// What comes before a manifest's own SHA-256, which ends it.
const SEAL: &[u8] = b",\n  \"manifest_sha256\": \"";
/// What follows the SHA-256, exactly: a byte changed there (even to other
/// white space) is refused like any other.
const SEAL_END: &[u8] = b"\"\n}\n";

/// `json`, a manifest (one JSON object), with its own SHA-256 as its last
/// field, `manifest_sha256`: the SHA-256 of every byte before that field.
pub fn seal_manifest(json: &[u8]) -> Vec<u8> {
    let end = json.iter().rposition(|&b| b == b'}').unwrap_or(json.len());
    let head = json[..end].trim_ascii_end();
    let mut out = head.to_vec();
    out.extend_from_slice(SEAL);
    out.extend_from_slice(hex(&Sha256::digest(head)).as_bytes());
    out.extend_from_slice(SEAL_END);
    out
}

/// A sealed manifest's bytes before its SHA-256, and the SHA-256 it states.
fn unseal(bytes: &[u8]) -> Option<(&[u8], String)> {
    let at = bytes.windows(SEAL.len()).rposition(|w| w == SEAL)?;
    let rest = &bytes[at + SEAL.len()..];
    let (sum, tail) = (rest.get(..64)?, rest.get(64..)?);
    (tail == SEAL_END && sum.iter().all(u8::is_ascii_hexdigit))
        .then(|| (&bytes[..at], String::from_utf8_lossy(sum).into_owned()))
}
