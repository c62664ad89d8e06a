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
//! Images become f32 rows of 784 values in [0, 1]; labels u32.

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

/// Read an idx file (gzipped or raw): its dimensions and its bytes.
/// Only unsigned-byte data (type 0x08), as in MNIST.
pub fn read_idx(path: &Path) -> Result<(Vec<usize>, Vec<u8>)> {
    let bad = |what: String| Error::Io(format!("{}: {what}", path.display()));
    let raw = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("not a valid gzip file ({e})")))?;
        out
    } else {
        raw
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad("not an idx file (bad magic number)".into()));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "idx data type 0x{:02x}; only unsigned bytes (0x08) are supported",
            bytes[2]
        )));
    }
    let ndim = bytes[3] as usize;
    let header = 4 + 4 * ndim;
    if ndim == 0 || bytes.len() < header {
        return Err(bad("truncated idx header".into()));
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| {
            let b = &bytes[4 + 4 * i..8 + 4 * i];
            u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
        })
        .collect();
    let n: usize = dims.iter().product();
    if bytes.len() != header + n {
        return Err(bad(format!(
            "dimensions {dims:?} need {n} bytes of data, the file has {}",
            bytes.len() - header
        )));
    }
    Ok((dims, bytes[header..].to_vec()))
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
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
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
    std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
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
        std::fs::rename(&part, &dest).map_err(|e| Error::Io(format!("{}: {e}", dest.display())))?;
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
    let path = |kind: &str, idx: u8| {
        let name = format!("{prefix}-{kind}-idx{idx}-ubyte");
        find(dir, &name)
            .ok_or_else(|| Error::Io(format!("{}: {name}(.gz) is missing", dir.display())))
    };
    let (idims, images) = read_idx(&path("images", 3)?)?;
    let (ldims, labels) = read_idx(&path("labels", 1)?)?;
    if idims.len() != 3 || ldims.len() != 1 || idims[0] != ldims[0] {
        return Err(Error::Io(format!(
            "{}: images {idims:?} and labels {ldims:?} do not pair up",
            dir.display()
        )));
    }
    if let Some(bad) = labels.iter().find(|l| **l > 9) {
        return Err(Error::Io(format!(
            "{}: label {bad} is not a digit class",
            dir.display()
        )));
    }
    let n = idims[0];
    let features = idims[1] * idims[2];
    let x = Tensor::from_vec(images, (n, features), &crate::comm::HOST)?
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
