//! CIFAR-10 from its binary files.
//!
//! The "CIFAR-10 binary version", `cifar-10-binary.tar.gz` from
//! <https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz> (see
//! <https://www.cs.toronto.edu/~kriz/cifar.html>), unpacks to
//! `cifar-10-batches-bin/`: five training files, `data_batch_1.bin` ..
//! `data_batch_5.bin`, and `test_batch.bin`, each 10,000 records of 3073
//! bytes: one label byte (0..=9), then 3072 pixel bytes, the 1024 red values
//! of the 32×32 image row by row, then the 1024 green, then the 1024 blue.
//!
//! [`cifar10`] reads them from `DIR/cifar-10-batches-bin/` or `DIR` itself
//! (the first that holds all six files) into rows of 3072 f32 features in the
//! same channel-major (NCHW) order: channel `c`, row `y`, column `x` is
//! feature `c * 1024 + y * 32 + x`. Each pixel byte `b` of channel `c`
//! becomes `(b / 255 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]` (computed in f32),
//! the per-channel mean and standard deviation of CIFAR-10's training
//! images that are customary for it (mean 0.4914, 0.4822, 0.4465; std 0.2470,
//! 0.2435, 0.2616).
//!
//! [`parse_cifar_batch`] parses one file's bytes; a corrupt, truncated or
//! foreign file is an error naming it, never a panic (`tests/fuzz.rs`).

use super::dataset::TensorDataset;
use crate::{Error, Result};
use candle_core::Tensor;
use std::path::{Path, PathBuf};

/// CIFAR-10's number of classes.
pub const CIFAR10_CLASSES: usize = 10;

/// CIFAR-10's image shape: (channels, height, width); a row of the
/// datasets [`cifar10`] returns holds `3 * 32 * 32 = 3072` features.
pub const CIFAR10_SHAPE: (usize, usize, usize) = (3, 32, 32);

/// The per-channel (red, green, blue) mean of CIFAR-10's training pixels,
/// scaled to [0, 1], that [`cifar10`] subtracts.
pub const CIFAR10_MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];

/// The per-channel (red, green, blue) standard deviation of CIFAR-10's
/// training pixels, scaled to [0, 1], that [`cifar10`] divides by.
pub const CIFAR10_STD: [f32; 3] = [0.2470, 0.2435, 0.2616];

/// Pixel bytes per record: 3 channels of 32×32.
const PIXELS: usize = 3 * 32 * 32;

/// Bytes per record: the label byte and the pixels.
const RECORD: usize = 1 + PIXELS;

/// The training files, in the order their records are concatenated.
const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];

/// The test file.
const TEST_FILE: &str = "test_batch.bin";

/// The directory the official tarball unpacks to.
const SUBDIR: &str = "cifar-10-batches-bin";

/// All six files, training first.
fn all_files() -> impl Iterator<Item = &'static str> {
    TRAIN_FILES
        .iter()
        .copied()
        .chain(std::iter::once(TEST_FILE))
}

/// The files of [`all_files`] that `dir` lacks.
fn missing(dir: &Path) -> Vec<&'static str> {
    all_files().filter(|f| !dir.join(f).is_file()).collect()
}

/// `dir/cifar-10-batches-bin` or `dir`, the first holding all six files;
/// else an error naming, for the candidate holding the most, what it lacks.
fn cifar_dir(dir: &Path) -> Result<PathBuf> {
    let candidates = [dir.join(SUBDIR), dir.to_path_buf()];
    if let Some(d) = candidates.iter().find(|d| missing(d).is_empty()) {
        return Ok(d.clone());
    }
    let hint = format!(
        "CIFAR-10 expects data_batch_1.bin .. data_batch_5.bin and test_batch.bin in \
         {}/{SUBDIR}/ or {}/; they are the \"CIFAR-10 binary version\", cifar-10-binary.tar.gz \
         from https://www.cs.toronto.edu/~kriz/ (https://www.cs.toronto.edu/~kriz/cifar.html), \
         which unpacks to {SUBDIR}/",
        dir.display(),
        dir.display()
    );
    // Prefer a directory over a non-directory, then the fewest files lacking,
    // then the first candidate (the tarball's layout).
    let best = candidates
        .iter()
        .min_by_key(|d| (!d.is_dir(), missing(d).len()))
        .unwrap_or(&candidates[0]);
    if !best.is_dir() {
        return Err(Error::Io(format!(
            "CIFAR-10: {} is not a directory; {hint}",
            dir.display()
        )));
    }
    let lacks = missing(best);
    let list = lacks
        .iter()
        .map(|f| best.join(f).display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(Error::Io(format!(
        "CIFAR-10: missing {list} ({} of the 6 files are in {}); {hint}",
        6 - lacks.len(),
        best.display()
    )))
}

/// For each channel, the normalised f32 of each of the 256 pixel bytes.
fn lookup() -> [[f32; 256]; 3] {
    let mut table = [[0f32; 256]; 3];
    for (c, row) in table.iter_mut().enumerate() {
        for (b, v) in row.iter_mut().enumerate() {
            *v = (b as f32 / 255.0 - CIFAR10_MEAN[c]) / CIFAR10_STD[c];
        }
    }
    table
}

/// Append the records of the batch file `path` to `x` (normalised pixels)
/// and `t` (labels).
fn read_batch(
    path: &Path,
    table: &[[f32; 256]; 3],
    x: &mut Vec<f32>,
    t: &mut Vec<u32>,
) -> Result<()> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| Error::caused(format!("CIFAR-10: {name}"), e))?;
    let (labels, pixels) = parse_cifar_batch(&bytes, &name)?;
    x.reserve(pixels.len());
    t.extend(labels.iter().map(|l| u32::from(*l)));
    for image in pixels.chunks_exact(PIXELS) {
        for (plane, row) in image.chunks_exact(PIXELS / 3).zip(table) {
            x.extend(plane.iter().map(|b| row[usize::from(*b)]));
        }
    }
    Ok(())
}

/// Parse the contents of a CIFAR-10 binary batch file (see the module
/// doc): its labels, one per record, each in 0..=9, and its pixel bytes,
/// 3072 per record in the file's channel-major order (the red plane, the
/// green, the blue; each 32 rows of 32).
///
/// Errors ([`Error::Io`], starting `CIFAR-10: name:`): an empty file; a
/// length that is not a whole number of 3073-byte records; a label above
/// 9; a gzip-compressed file (they are read uncompressed, as the tarball
/// unpacks them). Any number of records is accepted, not only the real
/// files' 10,000.
pub fn parse_cifar_batch(bytes: &[u8], name: &str) -> Result<(Vec<u8>, Vec<u8>)> {
    let bad = |what: String| Error::Io(format!("CIFAR-10: {name}: {what}"));
    if bytes.is_empty() {
        return Err(bad(format!(
            "the file is empty; a CIFAR-10 batch file holds records of {RECORD} bytes \
             (1 label byte, {PIXELS} pixel bytes), 10000 of them in the real files"
        )));
    }
    // 0x1f is label 31, so no batch file starts this way.
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return Err(bad(
            "gzip-compressed (it starts 1f 8b); the batch files are read uncompressed, as \
             cifar-10-binary.tar.gz unpacks them"
                .into(),
        ));
    }
    if !bytes.len().is_multiple_of(RECORD) {
        return Err(bad(format!(
            "{} bytes is not a whole number of {RECORD}-byte records ({} records and {} bytes \
             over; the real files have 10000 records, {} bytes): truncated or corrupt",
            bytes.len(),
            bytes.len() / RECORD,
            bytes.len() % RECORD,
            10_000 * RECORD
        )));
    }
    let n = bytes.len() / RECORD;
    let mut labels = Vec::with_capacity(n);
    let mut pixels = Vec::with_capacity(n * PIXELS);
    for (i, record) in bytes.chunks_exact(RECORD).enumerate() {
        let label = record[0];
        if usize::from(label) >= CIFAR10_CLASSES {
            return Err(bad(format!(
                "record {i} (of {n}, counting from 0) has label {label}; CIFAR-10's labels are \
                 0..=9 (corrupt, or not CIFAR-10 binary: CIFAR-100's records are 3074 bytes)"
            )));
        }
        labels.push(label);
        pixels.extend_from_slice(&record[1..]);
    }
    Ok((labels, pixels))
}

/// The batch files `names` in `dir`, concatenated, as a dataset.
fn load(dir: &Path, names: &[&str], table: &[[f32; 256]; 3]) -> Result<TensorDataset> {
    let _data = crate::heap::counting_as(crate::heap::Part::Data);
    let mut x = Vec::new();
    let mut t = Vec::new();
    for name in names {
        read_batch(&dir.join(name), table, &mut x, &mut t)?;
    }
    let n = t.len();
    let x = Tensor::from_vec(x, (n, PIXELS), &crate::comm::HOST)?;
    let t = Tensor::from_vec(t, n, &crate::comm::HOST)?;
    TensorDataset::new(x, t)
}

/// CIFAR-10's (train, test) sets from its binary files in
/// `dir/cifar-10-batches-bin/` or `dir` (see the module doc): the training
/// set is `data_batch_1.bin` .. `data_batch_5.bin` in order (50,000
/// examples in the real files), the test set `test_batch.bin` (10,000).
/// Features: examples × 3072 f32 in channel-major (NCHW) order, normalised
/// per channel with [`CIFAR10_MEAN`] and [`CIFAR10_STD`]; labels u32 in
/// 0..=9.
///
/// Errors, each naming the file: a file missing (with where the files are
/// expected and where to get them), a file that is empty or not a whole
/// number of 3073-byte records, a label above 9. A file need not hold
/// exactly 10,000 records.
pub fn cifar10(dir: &Path) -> Result<(TensorDataset, TensorDataset)> {
    let dir = cifar_dir(dir)?;
    let table = lookup();
    let train = load(&dir, &TRAIN_FILES, &table)?;
    let test = load(&dir, &[TEST_FILE], &table)?;
    Ok((train, test))
}
