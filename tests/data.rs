//! Datasets, loaders and iterators.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::data::{
    cifar10, create_empty_dataset, mnist, pad_images, read_idx, scatter_dataset,
    synchronized_iterator, synthetic_images, Dataset, MultiNodeIterator, SerialIterator,
    TensorDataset, CIFAR10_MEAN, CIFAR10_STD,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;
use common::data_dir;

fn toy(n: usize) -> TensorDataset {
    let x = Tensor::arange(0f32, (n * 2) as f32, &Device::Cpu)
        .unwrap()
        .reshape((n, 2))
        .unwrap();
    let t = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    TensorDataset::new(x, t).unwrap()
}

#[test]
fn mnist_loads_with_the_canonical_sizes() {
    let (train, test) = mnist(Some(&data_dir())).unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(train.x.dims(), &[60_000, 784]);
    let max = train.x.max_all().unwrap().to_scalar::<f32>().unwrap();
    let min = train.x.min_all().unwrap().to_scalar::<f32>().unwrap();
    assert!((0.0..=1.0).contains(&min) && max == 1.0, "{min} {max}");
    assert_eq!(train.t.max_all().unwrap().to_scalar::<u32>().unwrap(), 9);
}

#[test]
fn bad_idx_files_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("shardnet-idx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("garbage", b"hello world".to_vec(), "bad magic"),
        (
            "truncated",
            vec![0, 0, 8, 1, 0, 0, 0, 10, 1, 2, 3],
            "need 10 bytes",
        ),
        (
            "wrong-type",
            vec![0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0],
            "only unsigned bytes",
        ),
        (
            "bad-gzip",
            vec![0x1f, 0x8b, 1, 2, 3],
            "not a valid gzip file",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = read_idx(&p).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains(name), "{name}: {e}");
    }
    let missing = mnist(Some(&dir)).unwrap_err().to_string();
    assert!(
        missing.contains("train-images-idx3-ubyte(.gz)"),
        "{missing}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One missing or unreadable MNIST file is named, not "the four files".
#[test]
fn a_single_missing_or_bad_mnist_file_is_named() {
    let real = data_dir().join("mnist");
    let dir = std::env::temp_dir().join(format!("shardnet-mnist3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
    ] {
        let src = [format!("{name}.gz"), name.to_string()]
            .into_iter()
            .map(|f| real.join(f))
            .find(|p| p.is_file())
            .expect("real MNIST under SHARDNET_DATA");
        let dst = dir.join(src.file_name().unwrap());
        let _ = std::fs::remove_file(&dst);
        std::os::unix::fs::symlink(&src, &dst).unwrap();
    }
    let e = mnist(Some(&dir)).unwrap_err().to_string();
    assert!(
        e.contains("t10k-labels-idx1-ubyte(.gz)") && e.contains("3 of its 4"),
        "{e}"
    );
    assert!(!e.contains("train-images"), "{e}");
    // Present but not an idx file: that file is named.
    let bad = dir.join("t10k-labels-idx1-ubyte.gz");
    std::fs::write(&bad, b"not gzip").unwrap();
    let e = mnist(Some(&dir)).unwrap_err().to_string();
    assert!(e.contains(&bad.display().to_string()), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_empty_dataset_keeps_the_length_and_no_data() {
    let e = create_empty_dataset(&toy(7));
    assert_eq!(e.len(), 7);
    let b = e.batch(&[0, 1, 2]).unwrap();
    assert!(b.x.is_none() && b.t.is_none() && b.len == 3);
}

#[test]
fn the_serial_iterator_covers_each_epoch_once_and_reshuffles() {
    let mut it = SerialIterator::new(10, 4, Some(3)).unwrap();
    assert_eq!(it.batches_per_epoch(), 3);
    let mut epochs = Vec::new();
    for _ in 0..2 {
        let mut seen: Vec<usize> = (0..3).flat_map(|_| it.next_indices()).collect();
        let order = seen.clone();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        epochs.push(order);
    }
    assert_eq!(it.epoch(), 2);
    assert_ne!(epochs[0], epochs[1]);
}

#[test]
fn scatter_dataset_shards_and_pads() {
    for equal in [false, true] {
        let shards = launch_with_timeout(3, Duration::from_secs(20), |c| {
            let ds = toy(10);
            let mine = scatter_dataset(&c, (c.rank() == 0).then_some(&ds), 0, Some(1), equal)?;
            Ok(mine.t.to_vec1::<u32>()?)
        })
        .unwrap();
        let lens: Vec<usize> = shards.iter().map(|s| s.len()).collect();
        assert_eq!(lens, if equal { vec![4, 4, 4] } else { vec![4, 3, 3] });
        let mut all: Vec<u32> = shards.iter().flat_map(|s| s.iter().copied()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>(), "equal={equal}");
    }
}

#[test]
fn synchronized_and_multi_node_iterators_agree_across_ranks() {
    let got = launch_with_timeout(3, Duration::from_secs(20), |c| {
        // Each rank passes a different seed; rank 0's wins.
        let mut it = synchronized_iterator(&c, 10, 3, 40 + c.rank() as u64)?;
        let same: Vec<Vec<usize>> = (0..4).map(|_| it.next_indices()).collect();
        let ds = toy(10);
        let inner = (c.rank() == 1)
            .then(|| SerialIterator::new(10, 3, Some(5)))
            .transpose()?;
        let mut multi = MultiNodeIterator::new(&c, 1, inner)?;
        let b = multi.next_batch((c.rank() == 1).then_some(&ds as &dyn Dataset))?;
        Ok((same, b.t.unwrap().to_dtype(DType::U32)?.to_vec1::<u32>()?))
    })
    .unwrap();
    assert!(got.iter().all(|g| g == &got[0]), "{got:?}");
    assert_eq!(got[0].1.len(), 3);
}

#[test]
fn offline_without_files_says_what_to_do() {
    // A fresh cache, no SHARDNET_DATA, no curl on PATH: the command must say
    // which files to put where (in a child process: tests share the environment).
    let cache = std::env::temp_dir().join(format!("shardnet-cache-{}", std::process::id()));
    let out = std::process::Command::new(common::bin())
        .args(["train", "mnist-mlp", "--ranks", "1", "--max-steps", "1"])
        .env("XDG_CACHE_HOME", &cache)
        .env_remove("SHARDNET_DATA")
        .env("PATH", "")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("could not download") && e.contains("--data DIR"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&cache);
}

// ---- CIFAR-10 (binary files written here), synthetic images, padding ----

/// A fresh, empty temporary directory for one test.
fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardnet-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// CIFAR-10's six files: five training, then the test file.
const CIFAR_FILES: [&str; 6] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
    "test_batch.bin",
];

/// The label of record `r` of file `f` (of [`CIFAR_FILES`]) that
/// [`write_cifar`] writes.
fn cifar_label(f: usize, r: usize) -> u8 {
    ((3 * f + r) % 10) as u8
}

/// Pixel byte `p` (0..3072, channel-major) of record `r` of file `f`.
fn cifar_byte(f: usize, r: usize, p: usize) -> u8 {
    ((31 * f + 17 * r + 7 * p + p / 1024) % 256) as u8
}

/// Write CIFAR-10 binary files into `dir`, `records[f]` records in file `f`.
fn write_cifar(dir: &Path, records: [usize; 6]) {
    std::fs::create_dir_all(dir).unwrap();
    for (f, name) in CIFAR_FILES.iter().enumerate() {
        let mut bytes = Vec::new();
        for r in 0..records[f] {
            bytes.push(cifar_label(f, r));
            bytes.extend((0..3072).map(|p| cifar_byte(f, r, p)));
        }
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// The documented normalisation of pixel byte `b` of channel `c`.
fn cifar_value(b: u8, c: usize) -> f32 {
    (b as f32 / 255.0 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]
}

#[test]
fn cifar10_reads_values_and_labels_back_exactly() {
    assert_eq!(CIFAR10_MEAN, [0.4914, 0.4822, 0.4465]);
    assert_eq!(CIFAR10_STD, [0.2470, 0.2435, 0.2616]);
    let records = [2, 1, 3, 1, 2, 2];
    let root = fresh_dir("cifar-values");
    // Both layouts: the tarball's subdirectory in DIR, and the files in DIR.
    for (files, dir) in [
        (root.join("a").join("cifar-10-batches-bin"), root.join("a")),
        (root.join("b"), root.join("b")),
    ] {
        write_cifar(&files, records);
        let (train, test) = cifar10(&dir).unwrap();
        assert_eq!((train.len(), test.len()), (9, 2));
        assert_eq!(train.x.dims(), &[9, 3072]);
        assert_eq!(test.x.dims(), &[2, 3072]);
        for (ds, files) in [(&train, 0..5), (&test, 5..6)] {
            let want: Vec<(usize, usize)> = files
                .flat_map(|f| (0..records[f]).map(move |r| (f, r)))
                .collect();
            let x = ds.x.to_vec2::<f32>().unwrap();
            let t = ds.t.to_vec1::<u32>().unwrap();
            for (row, (f, r)) in want.iter().enumerate() {
                assert_eq!(t[row], cifar_label(*f, *r) as u32, "{dir:?} row {row}");
                for (p, v) in x[row].iter().enumerate() {
                    let b = cifar_byte(*f, *r, p);
                    assert_eq!(
                        *v,
                        cifar_value(b, p / 1024),
                        "{dir:?} row {row} feature {p}"
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn cifar10_pixel_c_y_x_is_feature_c_1024_plus_y_32_plus_x() {
    let dir = fresh_dir("cifar-layout");
    write_cifar(&dir, [1, 1, 1, 1, 1, 1]);
    // The test file: one record, label 7, all pixels 0 but (c 2, y 5, x 7)
    // at 255 and (c 0, y 31, x 0) at 51.
    let mut rec = vec![0u8; 3073];
    rec[0] = 7;
    rec[1 + 2 * 1024 + 5 * 32 + 7] = 255;
    rec[1 + 31 * 32] = 51;
    std::fs::write(dir.join("test_batch.bin"), &rec).unwrap();
    let (_, test) = cifar10(&dir).unwrap();
    assert_eq!(test.t.to_vec1::<u32>().unwrap(), vec![7]);
    let x = test.x.to_vec2::<f32>().unwrap().remove(0);
    for (p, v) in x.iter().enumerate() {
        let want = match p {
            p if p == 2 * 1024 + 5 * 32 + 7 => (1.0 - 0.4465) / 0.2616,
            p if p == 31 * 32 => (0.2 - 0.4914) / 0.2470,
            p => (0.0 - CIFAR10_MEAN[p / 1024]) / CIFAR10_STD[p / 1024],
        };
        assert!((v - want).abs() < 1e-5, "feature {p}: {v} vs {want}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_cifar10_files_are_errors_naming_the_file() {
    type Spoil = fn(&Path);
    let cases: [(&str, &str, Spoil, &[&str]); 4] = [
        (
            "truncated",
            "data_batch_3.bin",
            |p| {
                let b = std::fs::read(p).unwrap();
                std::fs::write(p, &b[..b.len() - 5]).unwrap();
            },
            &["6141 bytes", "1 records and 3068 bytes over", "truncated"],
        ),
        (
            "label10",
            "test_batch.bin",
            |p| {
                let mut b = std::fs::read(p).unwrap();
                b[3073] = 10;
                std::fs::write(p, b).unwrap();
            },
            &["record 1", "label 10"],
        ),
        (
            "empty",
            "data_batch_2.bin",
            |p| std::fs::write(p, b"").unwrap(),
            &["empty"],
        ),
        (
            "missing",
            "data_batch_4.bin",
            |p| std::fs::remove_file(p).unwrap(),
            &["missing", "cifar-10-binary.tar.gz", "cs.toronto.edu/~kriz"],
        ),
    ];
    for (case, file, spoil, wants) in cases {
        let dir = fresh_dir(&format!("cifar-bad-{case}"));
        let files = dir.join("cifar-10-batches-bin");
        write_cifar(&files, [2, 2, 2, 2, 2, 2]);
        cifar10(&dir).unwrap();
        spoil(&files.join(file));
        let e = cifar10(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&files.join(file).display().to_string()),
            "{case}: {e}"
        );
        for want in wants {
            assert!(e.contains(want), "{case}: wanted {want:?} in: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // No files at all: every expected file is named, and where.
    let dir = fresh_dir("cifar-none");
    let e = cifar10(&dir).unwrap_err().to_string();
    for f in CIFAR_FILES {
        assert!(e.contains(f), "{e}");
    }
    assert!(e.contains("cifar-10-batches-bin/"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn synthetic_images_are_seeded_shaped_and_labelled() {
    let a = synthetic_images(50, 3, 8, 5, 1).unwrap();
    assert_eq!(a.x.dims(), &[50, 3 * 8 * 8]);
    assert_eq!(a.t.dims(), &[50]);
    assert_eq!(a.x.dtype(), DType::F32);
    let labels = a.t.to_vec1::<u32>().unwrap();
    assert!(labels.iter().all(|l| *l < 5), "{labels:?}");
    let mut seen = labels.clone();
    seen.sort();
    seen.dedup();
    assert_eq!(seen, vec![0, 1, 2, 3, 4]);
    let xs = |d: &TensorDataset| d.x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let again = synthetic_images(50, 3, 8, 5, 1).unwrap();
    assert_eq!(xs(&a), xs(&again));
    assert_eq!(labels, again.t.to_vec1::<u32>().unwrap());
    let other = synthetic_images(50, 3, 8, 5, 2).unwrap();
    assert_ne!(labels, other.t.to_vec1::<u32>().unwrap());
    let (xa, xo) = (xs(&a), xs(&other));
    let same = xa.iter().zip(&xo).filter(|(p, q)| p == q).count();
    assert!(same < xa.len() / 100, "{same} equal values");
    assert!(xa.iter().all(|v| v.is_finite() && v.abs() <= 2.5));
    // Odd sizes (a remainder of the noise draws) and one class.
    let odd = synthetic_images(3, 1, 3, 1, 9).unwrap();
    assert_eq!(odd.x.dims(), &[3, 9]);
    assert_eq!(odd.t.to_vec1::<u32>().unwrap(), vec![0, 0, 0]);
    // The same on every machine: these labels are pinned.
    let pinned = synthetic_images(12, 1, 2, 3, 7).unwrap();
    assert_eq!(pinned.t.to_vec1::<u32>().unwrap(), PINNED_LABELS);
    assert_eq!(pinned.x.to_vec2::<f32>().unwrap()[0], PINNED_FIRST_ROW);
}

/// The labels of `synthetic_images(12, 1, 2, 3, 7)` (splitmix64 and basic
/// f32 arithmetic: the same on every machine).
const PINNED_LABELS: [u32; 12] = [0, 2, 1, 1, 0, 0, 0, 2, 1, 2, 1, 0];

/// Its first image's four pixels.
const PINNED_FIRST_ROW: [f32; 4] = [-1.9832982, -0.7352822, 1.022651, 0.40868673];

#[test]
fn synthetic_images_are_learnable_by_class_means() {
    let (classes, n) = (4, 800);
    let ds = synthetic_images(n, 3, 8, classes, 11).unwrap();
    let x = ds.x.to_vec2::<f32>().unwrap();
    let t = ds.t.to_vec1::<u32>().unwrap();
    let f = x[0].len();
    let half = n / 2;
    let mut means = vec![vec![0f32; f]; classes];
    let mut counts = vec![0f32; classes];
    for i in 0..half {
        counts[t[i] as usize] += 1.0;
        for (m, v) in means[t[i] as usize].iter_mut().zip(&x[i]) {
            *m += v;
        }
    }
    for (m, c) in means.iter_mut().zip(&counts) {
        m.iter_mut().for_each(|v| *v /= c.max(1.0));
    }
    let nearest = |row: &[f32]| {
        (0..classes)
            .min_by(|a, b| {
                let d = |k: usize| -> f32 {
                    row.iter()
                        .zip(&means[k])
                        .map(|(p, q)| (p - q) * (p - q))
                        .sum()
                };
                d(*a).total_cmp(&d(*b))
            })
            .unwrap() as u32
    };
    let right = (half..n).filter(|i| nearest(&x[*i]) == t[*i]).count();
    assert!(
        right as f32 > 0.9 * (n - half) as f32,
        "{right} of {}",
        n - half
    );
}

#[test]
fn synthetic_images_refuse_zero_sizes() {
    for (c, s, k) in [(0, 8, 4), (3, 0, 4), (3, 8, 0)] {
        let e = synthetic_images(10, c, s, k, 0).unwrap_err();
        assert!(
            matches!(e, shardnet::Error::Usage(_)) && e.to_string().contains("synthetic_images"),
            "{e}"
        );
    }
    assert!(synthetic_images(usize::MAX / 2, 3, 32, 10, 0).is_err());
}

#[test]
fn pad_images_adds_zero_borders() {
    let x = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6., 7., 8.], (2, 4), &Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![3u32, 8], 2, &Device::Cpu).unwrap();
    let ds = TensorDataset::new(x, t).unwrap();
    let p = pad_images(&ds, 2, 1).unwrap();
    #[rustfmt::skip]
    let want = vec![
        vec![0f32, 0., 0., 0.,  0., 1., 2., 0.,  0., 3., 4., 0.,  0., 0., 0., 0.],
        vec![0f32, 0., 0., 0.,  0., 5., 6., 0.,  0., 7., 8., 0.,  0., 0., 0., 0.],
    ];
    assert_eq!(p.x.to_vec2::<f32>().unwrap(), want);
    assert_eq!(p.t.to_vec1::<u32>().unwrap(), vec![3, 8]);
    // pad 0: unchanged.
    let same = pad_images(&ds, 2, 0).unwrap();
    assert_eq!(
        same.x.to_vec2::<f32>().unwrap(),
        ds.x.to_vec2::<f32>().unwrap()
    );
    // MNIST's size: 28×28 to 32×32, the image in the middle, a zero border.
    let pixels: Vec<f32> = (0..3 * 784)
        .map(|i| 0.5 + (i % 784) as f32 / 2000.0)
        .collect();
    let mnist_like = TensorDataset::new(
        Tensor::from_vec(pixels, (3, 784), &Device::Cpu).unwrap(),
        Tensor::from_vec(vec![0u32, 1, 2], 3, &Device::Cpu).unwrap(),
    )
    .unwrap();
    let padded = pad_images(&mnist_like, 28, 2).unwrap();
    assert_eq!(padded.x.dims(), &[3, 1024]);
    for row in padded.x.to_vec2::<f32>().unwrap() {
        for y in 0..32 {
            for x in 0..32 {
                let v = row[y * 32 + x];
                if (2..30).contains(&y) && (2..30).contains(&x) {
                    let want = 0.5 + ((y - 2) * 28 + (x - 2)) as f32 / 2000.0;
                    assert_eq!(v, want, "({y}, {x})");
                } else {
                    assert_eq!(v, 0.0, "border ({y}, {x})");
                }
            }
        }
    }
}

#[test]
fn pad_images_refuses_rows_of_the_wrong_width() {
    for (ds, side) in [(toy(5), 28), (toy(5), 2), (toy(5), 0)] {
        let e = pad_images(&ds, side, 2).unwrap_err();
        assert!(
            matches!(e, shardnet::Error::Usage(_)) && e.to_string().contains("pad_images"),
            "{e}"
        );
    }
    let one_d = TensorDataset::new(
        Tensor::from_vec(vec![1f32; 4], 4, &Device::Cpu).unwrap(),
        Tensor::from_vec(vec![0u32; 4], 4, &Device::Cpu).unwrap(),
    )
    .unwrap();
    assert!(pad_images(&one_d, 2, 1).is_err());
}

/// Thread ranks that ask for the same text and tokenizer share one copy of
/// its tokens; another text gets its own; once no rank holds them they are
/// freed, and a later call encodes again.
#[test]
fn thread_ranks_share_one_copy_of_the_corpus_tokens() {
    use shardnet::data::{Text, Tokenizer};
    use std::sync::Arc;
    let text = |s: &str| Text::from_texts(&[s.as_bytes().to_vec()], PathBuf::from("test"));
    let held = launch_with_timeout(3, Duration::from_secs(60), |_| {
        let c = text("the same words on every rank").shared_tokens(&Tokenizer::Bytes)?;
        Ok((c.train.clone(), c.validation.clone()))
    })
    .unwrap();
    assert!(held
        .iter()
        .all(|(t, v)| Arc::ptr_eq(t, &held[0].0) && Arc::ptr_eq(v, &held[0].1)));
    let same = text("the same words on every rank")
        .tokens(&Tokenizer::Bytes)
        .unwrap();
    assert_eq!(*held[0].0, *same.train);
    let other = text("other words")
        .shared_tokens(&Tokenizer::Bytes)
        .unwrap();
    assert!(!Arc::ptr_eq(&other.train, &held[0].0));
    let again = text("the same words on every rank")
        .shared_tokens(&Tokenizer::Bytes)
        .unwrap();
    assert!(Arc::ptr_eq(&again.train, &held[0].0));
    let weak = Arc::downgrade(&again.train);
    drop((held, again));
    assert_eq!(
        weak.strong_count(),
        0,
        "the tokens outlive every rank's copy"
    );
}
