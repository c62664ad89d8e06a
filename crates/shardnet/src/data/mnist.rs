//! MNIST and Fashion-MNIST from idx files (gzipped or raw).
//!
//! Where the files come from, first match wins:
//! 1. the directory passed in (`--data DIR`): `DIR/mnist` or `DIR` itself;
//! 2. `$SHARDNET_DATA/mnist`;
//! 3. the cache, `$XDG_CACHE_HOME/shardnet/mnist` (or `~/.cache/...`),
//!    downloaded there when missing (with `curl`), each file checked against
//!    its SHA-256 before use.
//!
//! Fashion-MNIST comes from Debian's `dataset-fashion-mnist` package
//! (`/usr/share/datasets/fashion-mnist`) or the directory passed in.
//!
//! Images become f32 rows of 784 values in [0, 1]; labels u32. Corrupt,
//! truncated or foreign files are errors naming the file ([`parse_idx`],
//! [`mnist_from_idx`]), never a panic; `tests/fuzz.rs` checks that.

use super::dataset::TensorDataset;
use crate::{Error, Result};
use candle_core::Tensor;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The four files: (name, SHA-256 of the canonical gzipped file).
const FILES: [(&str, &str); 4] = [
    (
        "train-images-idx3-ubyte",
        "b09d8b89df4ad239afc76a323dbe9559169cd8cca365467dfe8aa1f7ca54109b",
    ),
    (
        "train-labels-idx1-ubyte",
        "c51906e7929bbf7c824fbd16019b56297269ca82cba449c5b5d59c0a02147fed",
    ),
    (
        "t10k-images-idx3-ubyte",
        "f72c2dff3457595ec2fe452d25d97b7f974a74ad5b006687704212bedd1486d8",
    ),
    (
        "t10k-labels-idx1-ubyte",
        "4baf84ddd60ae342cfdd282ec3fba3249a201a4459782165496a7cbebbe49a2e",
    ),
];

/// Mirrors holding the canonical gzipped files.
const MIRRORS: [&str; 2] = [
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
];

const FASHION_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The most data bytes an idx file may declare: 4 GiB, about 90 times
/// MNIST's largest file (47 MB). Its u32 dimensions (up to 255 of them)
/// could otherwise declare more bytes than a u64 counts, and a few
/// megabytes of gzip can inflate to gigabytes; with this cap, such a file
/// is refused by its header before its data is read or allocated.
const MAX_DATA: u64 = 1 << 32;

/// The longest idx header: the magic number and 255 dimensions.
const MAX_HEADER: usize = 4 + 4 * 255;

/// The first two bytes of every gzip file.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Read an idx file (gzipped or raw): its dimensions and its bytes, by
/// [`parse_idx`], with the path in every error. A raw file longer than an
/// idx file may be (the 4 GiB of data of [`parse_idx`] and a header) is
/// refused before it is read.
pub fn read_idx(path: &Path) -> Result<(Vec<usize>, Vec<u8>)> {
    let name = path.display().to_string();
    let bad = |what: String| Error::Io(format!("{name}: {what}"));
    let len = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len > MAX_DATA + MAX_HEADER as u64 {
        return Err(bad(format!(
            "{len} bytes is more than an idx file may hold here (4 GiB of data and a header)"
        )));
    }
    let raw = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    parse_idx(&raw, &name)
}

/// Parse the contents of an idx file, raw or gzipped (by its first two
/// bytes, 1f 8b): its dimensions and its data bytes, in the file's
/// (row-major) order. Only unsigned-byte data (type 0x08), as in MNIST.
///
/// Every error is [`Error::Io`] starting with `name` (the file's path, for
/// [`read_idx`]) and saying what is wrong: a bad magic number, another data
/// type, no dimensions, a header or data shorter or longer than the
/// dimensions say, dimensions whose product (the data's length) exceeds
/// 4 GiB, or gzip that does not inflate.
///
/// A gzipped file is inflated only as far as its header says: the header
/// first, then the data it declares and one byte more, to tell a longer
/// file apart. So a small gzip that inflates to gigabytes (a "gzip bomb")
/// costs at most what its header declares, itself at most 4 GiB, and a
/// header that declares more is refused after inflating at most 1 KiB.
/// Concatenated gzip members are read as one file (as `gunzip` does); bytes
/// after the last member that are not gzip are an error.
pub fn parse_idx(bytes: &[u8], name: &str) -> Result<(Vec<usize>, Vec<u8>)> {
    let bad = |what: String| Error::Io(format!("{name}: {what}"));
    if !bytes.starts_with(&GZIP_MAGIC) {
        let idx = IdxHeader::parse(bytes, "the file").map_err(bad)?;
        let data = idx.data(bytes, "the file", true).map_err(bad)?;
        return Ok((idx.dims, data.to_vec()));
    }
    let gz_err = |e: std::io::Error| bad(format!("not a valid gzip file ({e})"));
    let mut gz = flate2::bufread::MultiGzDecoder::new(bytes);
    let mut inflated = Vec::new();
    (&mut gz)
        .take(MAX_HEADER as u64)
        .read_to_end(&mut inflated)
        .map_err(gz_err)?;
    let idx = IdxHeader::parse(&inflated, "the inflated file").map_err(bad)?;
    // The declared data and one byte more, which, if it comes, is an error.
    let room =
        (idx.header.saturating_add(idx.len).saturating_add(1)).saturating_sub(inflated.len());
    gz.take(room as u64)
        .read_to_end(&mut inflated)
        .map_err(gz_err)?;
    idx.data(&inflated, "the inflated file", false)
        .map_err(bad)?;
    inflated.drain(..idx.header);
    Ok((idx.dims, inflated))
}

/// What an idx header says.
struct IdxHeader {
    /// The dimensions.
    dims: Vec<usize>,
    /// The header's length in bytes.
    header: usize,
    /// The data's length in bytes, the product of `dims` (at most
    /// [`MAX_DATA`]).
    len: usize,
}

impl IdxHeader {
    /// The header at the start of `bytes` (`file` says what `bytes` is, in
    /// errors); `bytes` may hold more, or less, than the header.
    fn parse(bytes: &[u8], file: &str) -> std::result::Result<Self, String> {
        let magic = &bytes[..bytes.len().min(4)];
        if magic.is_empty() {
            return Err(format!(
                "{file} is empty; an idx file of unsigned bytes starts [00, 00, 08, number of \
                 dimensions]"
            ));
        }
        if magic.len() < 2 || magic[..2] != [0, 0] {
            return Err(format!(
                "not an idx file (bad magic number: it starts {magic:02x?}, an idx file of \
                 unsigned bytes starts [00, 00, 08, number of dimensions])"
            ));
        }
        if magic.len() < 4 {
            return Err(format!(
                "truncated idx header: {file} has {} bytes, the magic number alone is 4",
                bytes.len()
            ));
        }
        if magic[2] != 0x08 {
            return Err(format!(
                "idx data type 0x{:02x}; only unsigned bytes (0x08) are supported",
                magic[2]
            ));
        }
        let ndim = usize::from(magic[3]);
        if ndim == 0 {
            return Err("idx header with 0 dimensions; an idx file has at least one".into());
        }
        let header = 4 + 4 * ndim;
        if bytes.len() < header {
            return Err(format!(
                "truncated idx header: {ndim} dimensions need {header} header bytes, {file} \
                 has {}",
                bytes.len()
            ));
        }
        let dims: Vec<usize> = bytes[4..header]
            .chunks_exact(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .collect();
        let len = dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d as u64))
            .filter(|n| *n <= MAX_DATA)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                format!(
                    "dimensions {dims:?} declare more data than an idx file may hold here \
                     (4 GiB): corrupt, or not an idx file"
                )
            })?;
        Ok(IdxHeader { dims, header, len })
    }

    /// The data of `bytes`, the file this header starts: exactly
    /// [`IdxHeader::len`] bytes after the header, else an error. `whole`:
    /// `bytes` is the whole file (else it was cut one byte past the
    /// declared end, so a longer file's length is unknown).
    fn data<'a>(
        &self,
        bytes: &'a [u8],
        file: &str,
        whole: bool,
    ) -> std::result::Result<&'a [u8], String> {
        let data = &bytes[self.header..];
        let (dims, len) = (&self.dims, self.len);
        match data.len() {
            n if n == len => Ok(data),
            n if n < len || whole => Err(format!(
                "dimensions {dims:?} need {len} bytes of data, {file} has {n}"
            )),
            _ => Err(format!(
                "dimensions {dims:?} need {len} bytes of data, {file} has more"
            )),
        }
    }
}

/// `name.gz` or `name` in `dir`, whichever exists.
fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    [format!("{name}.gz"), name.to_string()]
        .into_iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
}

fn has_all(dir: &Path) -> bool {
    missing(dir).is_empty()
}

/// The idx files (of [`FILES`]) that `dir` lacks.
fn missing(dir: &Path) -> Vec<&'static str> {
    FILES
        .iter()
        .filter(|(name, _)| find(dir, name).is_none())
        .map(|(name, _)| *name)
        .collect()
}

/// Of the directories `candidates` (the first preferred), the one that
/// holds all four idx files; else an error naming, for the candidate that
/// holds the most, the files it lacks.
fn dir_with_all(candidates: &[PathBuf], what: &str, hint: &str) -> Result<PathBuf> {
    if let Some(d) = candidates.iter().find(|d| has_all(d)) {
        return Ok(d.clone());
    }
    let best = candidates
        .iter()
        .min_by_key(|d| (!d.is_dir(), missing(d).len()))
        .ok_or_else(|| Error::Io(format!("{what}: no directory to look in")))?;
    let lacks = missing(best);
    let list = lacks
        .iter()
        .map(|n| format!("{n}(.gz)"))
        .collect::<Vec<_>>()
        .join(", ");
    let has = FILES.len() - lacks.len();
    Err(Error::Io(if best.is_dir() {
        format!(
            "{what}: {} lacks {list} ({has} of its 4 idx files are there); {hint}",
            best.display()
        )
    } else {
        format!("{what}: {} is not a directory; {hint}", best.display())
    }))
}

fn sha256(path: &Path) -> Result<String> {
    use sha2::Digest;
    let bytes = std::fs::read(path).map_err(|e| Error::caused(path.display().to_string(), e))?;
    Ok(sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn cache_dir() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .ok_or_else(|| {
            Error::Io("no cache directory: set XDG_CACHE_HOME or HOME, or pass --data DIR".into())
        })?;
    Ok(base.join("shardnet").join("mnist"))
}

/// Download the missing files into `dir`, verifying each.
fn download(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::caused(dir.display().to_string(), e))?;
    for (name, sum) in FILES {
        let dest = dir.join(format!("{name}.gz"));
        if dest.is_file() && sha256(&dest)? == sum {
            continue;
        }
        let part = dir.join(format!("{name}.gz.part"));
        let fetched = MIRRORS.iter().any(|m| {
            std::process::Command::new("curl")
                .args(["-fsSL", "--retry", "2", "-o"])
                .arg(&part)
                .arg(format!("{m}{name}.gz"))
                .status()
                .is_ok_and(|s| s.success())
        });
        if !fetched {
            return Err(Error::Io(format!(
                "could not download MNIST's {name}.gz (offline, or curl missing?). Put the four \
                 files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, \
                 t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in {} or in a directory \
                 passed with --data DIR (or SHARDNET_DATA=DIR, with the files in DIR/mnist)",
                dir.display()
            )));
        }
        let got = sha256(&part)?;
        if got != sum {
            let _ = std::fs::remove_file(&part);
            return Err(Error::Io(format!(
                "downloaded {name}.gz has SHA-256 {got}, expected {sum}; not used"
            )));
        }
        std::fs::rename(&part, &dest).map_err(|e| Error::caused(dest.display().to_string(), e))?;
    }
    Ok(())
}

/// The directory holding MNIST's four files, by the order in the module doc;
/// downloads into the cache when no other place has them.
pub fn mnist_dir(data: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = data {
        return dir_with_all(
            &[d.join("mnist"), d.to_path_buf()],
            "MNIST (--data)",
            "put the four files in DIR/mnist/ or DIR",
        );
    }
    if let Some(d) = std::env::var_os("SHARDNET_DATA") {
        return dir_with_all(
            &[PathBuf::from(d).join("mnist")],
            "MNIST (SHARDNET_DATA)",
            "put the four files in $SHARDNET_DATA/mnist/, or unset SHARDNET_DATA to download them",
        );
    }
    let cache = cache_dir()?;
    let verified = FILES.iter().all(|(name, sum)| {
        let p = cache.join(format!("{name}.gz"));
        p.is_file() && sha256(&p).is_ok_and(|s| s == *sum)
    });
    if !verified {
        download(&cache)?;
    }
    Ok(cache)
}

fn load(dir: &Path, prefix: &str) -> Result<TensorDataset> {
    let _data = crate::heap::counting_as(crate::heap::Part::Data);
    let path = |kind: &str, idx: u8| {
        let name = format!("{prefix}-{kind}-idx{idx}-ubyte");
        find(dir, &name)
            .ok_or_else(|| Error::Io(format!("{}: {name}(.gz) is missing", dir.display())))
    };
    let (images, labels) = (path("images", 3)?, path("labels", 1)?);
    mnist_set(
        read_idx(&images)?,
        &images.display().to_string(),
        read_idx(&labels)?,
        &labels.display().to_string(),
    )
}

/// An MNIST-shaped dataset from the contents of an images idx file and a
/// labels idx file (raw or gzipped, see [`parse_idx`]), as [`mnist`] and
/// [`fashion_mnist`] build each of their sets: features `n × 784` f32 in
/// [0, 1] (a pixel byte over 255), labels `n` u32.
///
/// Errors ([`Error::Io`]), each naming the file at fault by the name given:
/// what [`parse_idx`] refuses; images that are not `n × 28 × 28`; labels
/// that are not a list; different numbers of images and labels; no images;
/// a label above 9.
pub fn mnist_from_idx(
    images: &[u8],
    images_name: &str,
    labels: &[u8],
    labels_name: &str,
) -> Result<TensorDataset> {
    let _data = crate::heap::counting_as(crate::heap::Part::Data);
    mnist_set(
        parse_idx(images, images_name)?,
        images_name,
        parse_idx(labels, labels_name)?,
        labels_name,
    )
}

/// MNIST's image side, in pixels.
const SIDE: usize = 28;

/// The dataset of [`mnist_from_idx`] from parsed idx files.
fn mnist_set(
    (idims, images): (Vec<usize>, Vec<u8>),
    images_name: &str,
    (ldims, labels): (Vec<usize>, Vec<u8>),
    labels_name: &str,
) -> Result<TensorDataset> {
    let n = match idims[..] {
        [n, SIDE, SIDE] => n,
        _ => {
            return Err(Error::Io(format!(
                "{images_name}: images of dimensions {idims:?}; MNIST's are n × {SIDE} × {SIDE}"
            )))
        }
    };
    if ldims.len() != 1 {
        return Err(Error::Io(format!(
            "{labels_name}: labels of dimensions {ldims:?}; MNIST's are a list (one dimension)"
        )));
    }
    if ldims[0] != n {
        return Err(Error::Io(format!(
            "{images_name} holds {n} images but {labels_name} holds {} labels",
            ldims[0]
        )));
    }
    if n == 0 {
        return Err(Error::Io(format!(
            "{images_name}: no images (dimensions {idims:?})"
        )));
    }
    if let Some((i, bad)) = labels.iter().enumerate().find(|(_, l)| **l > 9) {
        return Err(Error::Io(format!(
            "{labels_name}: label {bad} (example {i}, counting from 0) is not a class 0..=9"
        )));
    }
    let x = Tensor::from_vec(images, (n, SIDE * SIDE), &crate::comm::HOST)?
        .to_dtype(candle_core::DType::F32)?
        .affine(1.0 / 255.0, 0.0)?;
    let t = Tensor::from_vec(labels, n, &crate::comm::HOST)?.to_dtype(candle_core::DType::U32)?;
    TensorDataset::new(x, t)
}

/// MNIST's (train, test) sets: 60,000 and 10,000 examples.
pub fn mnist(data: Option<&Path>) -> Result<(TensorDataset, TensorDataset)> {
    let dir = mnist_dir(data)?;
    Ok((load(&dir, "train")?, load(&dir, "t10k")?))
}

/// Fashion-MNIST's (train, test) sets, from `data` or Debian's
/// `dataset-fashion-mnist` package.
pub fn fashion_mnist(data: Option<&Path>) -> Result<(TensorDataset, TensorDataset)> {
    let dir = match data {
        Some(d) => dir_with_all(
            &[d.join("fashion-mnist"), d.to_path_buf()],
            "Fashion-MNIST (--data)",
            "put its four idx files in DIR/fashion-mnist/ or DIR",
        )?,
        None => dir_with_all(
            &[PathBuf::from(FASHION_DIR)],
            "Fashion-MNIST",
            "install Debian's package (apt-get install dataset-fashion-mnist) or pass --data DIR \
             with its four idx files",
        )?,
    };
    Ok((load(&dir, "train")?, load(&dir, "t10k")?))
}
