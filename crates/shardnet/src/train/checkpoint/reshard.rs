//! Resharding on read: for each state tensor, the byte ranges of the
//! pieces that overlap this rank's part, copied box by box.

use super::read::Reader;
use super::*;

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
