//! MLPs split within their layers on the local backend: Chainer's
//! MnistMLPParallel on 2 ranks trains exactly what it trains on 1, the
//! tensor-parallel MLP on 2 and 3 ranks what it trains on 1, and Chainer's
//! model reaches the one-device model's accuracy.

mod common;
use candle_core::Tensor;
use shardnet::comm::launch_with_timeout;
use shardnet::models::mnist_parallel::{Config, Split};
use shardnet::train::run;
use shardnet::train::Options;
use std::collections::BTreeMap;
use std::time::Duration;

fn train(
    split: Split,
    ranks: usize,
    units: usize,
    steps: usize,
) -> (BTreeMap<String, Tensor>, f64) {
    let mut cfg = Config::new(split);
    cfg.units = units;
    cfg.data = Some(common::data_dir());
    cfg.train = Options {
        max_steps: Some(steps),
        evaluate: false,
        progress: false,
        ..cfg.train
    };
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
    let r = reports.into_iter().flatten().next().unwrap();
    (r.params, r.metrics.epochs[0].train_loss)
}

#[test]
fn mnist_mlp_parallel_on_two_ranks_equals_one_rank() {
    let (one, l1) = train(Split::Chainer, 1, 64, 20);
    let (two, l2) = train(Split::Chainer, 2, 64, 20);
    assert_eq!(one.len(), 24, "{:?}", one.keys());
    let e = common::worst(&two, &one).0;
    assert!(e <= 1e-6, "parameters differ by {e:e}");
    assert!((l1 - l2).abs() <= 1e-6 * l1.abs(), "{l1} vs {l2}");
}

#[test]
fn tensor_parallel_mlp_on_two_and_three_ranks_equals_one_rank() {
    let (one, _) = train(Split::Tensor, 1, 50, 20);
    for n in [2, 3] {
        let (got, _) = train(Split::Tensor, n, 50, 20);
        let e = common::worst(&got, &one).0;
        assert!(e <= 1e-4, "{n} ranks: parameters differ by {e:e}");
    }
}

/// One epoch of Chainer's defaults (U = 1000, batch 100, Adam 1e-3, LeCun
/// normal init): seeds 0–3 reach 95.57%, 96.63%, 96.40%, 97.25% (mean
/// 96.46%; the one-device 784–1000–1000–10 MLP, seed 0: 96.67%); seed 0 is
/// held to 95%, which a broken split misses by far.
#[test]
fn the_seed_model_learns_mnist_in_one_epoch() {
    let mut cfg = Config::new(Split::Chainer);
    cfg.data = Some(common::data_dir());
    cfg.train.progress = false;
    let reports = launch_with_timeout(2, Duration::from_secs(120), |c| run(&c, &cfg)).unwrap();
    let m = reports.into_iter().flatten().next().unwrap().metrics;
    let acc = m.epochs[0].test_accuracy;
    assert!(acc >= 0.95, "test accuracy {acc}");
}

#[test]
fn misplaced_flags_are_refused() {
    for (args, want) in [
        (
            &[
                "train",
                "mnist-mlp",
                "--parallel",
                "tensor",
                "--stages",
                "2",
            ][..],
            "--virtual-stages, --balance and --data-parallel belong to --parallel pipeline",
        ),
        (
            &["train", "mnist-mlp-parallel", "--ranks", "3"][..],
            "run it on 1 or 2 ranks, not 3",
        ),
    ] {
        let (out, text) = common::shardnet(args);
        assert!(!out.status.success(), "{args:?}: {text}");
        assert!(text.contains(want), "{args:?}: {text}");
    }
}
