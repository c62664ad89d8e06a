//! Datasets, loaders and iterators.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::data::{
    create_empty_dataset, mnist, read_idx, scatter_dataset, synchronized_iterator, Dataset,
    MultiNodeIterator, SerialIterator, TensorDataset,
};
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
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardnet"))
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
