//! Hybrid training with the memory-balanced sharded classifier: the
//! data-parallel backbone behind the sharded head gets the one-device
//! gradient (and averaging would not), half precision stays within its
//! tolerance of f32 and halves the feature traffic, communication does not
//! grow with C, shards checkpoint, and `mnist-arcface` reaches 98% on MNIST.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::{chunk_sizes, launch};
use shardnet::functions::Margin;
use shardnet::links::ShardedClassifier;
use shardnet::models::sharded_head::{Config, Model};
use shardnet::optim::allreduce_grads;
use shardnet::train::run;
use shardnet::{Communicator, ReduceOp, Result};

const B: usize = 10;
const IN: usize = 16;

fn config(classes: usize, precision: DType) -> Config {
    let mut c = Config::face_head(classes, IN);
    c.hidden = vec![12];
    c.batch_size = B;
    c.precision = precision;
    c
}

/// One step's loss, backbone gradients (after `reduce`) and the whole head
/// gradient (gathered for the comparison), and the bytes this rank received.
struct Step {
    loss: f64,
    grads: Vec<Tensor>,
    bytes: u64,
}

fn step(comm: &Communicator, cfg: &Config, reduce: ReduceOp, loss_scale: f64) -> Result<Step> {
    let ctx = shardnet::functions::Context::new(comm);
    let model = Model::new(&ctx, cfg)?;
    let x: Vec<f32> = (0..B * IN)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (B, IN), &Device::Cpu)?;
    let labels: Vec<u32> = (0..B).map(|i| ((i * 7 + 2) % cfg.classes) as u32).collect();
    let rows = chunk_sizes(B, comm.size());
    let start: usize = rows[..comm.rank()].iter().sum();
    let mine = x.narrow(0, start, rows[comm.rank()])?;
    let before = comm.bytes_received();
    let (loss, _) = model.forward_backward(&ctx, &mine, &labels, cfg.precision, loss_scale)?;
    let bytes = comm.bytes_received() - before;
    let backbone = model.backbone_params();
    allreduce_grads(comm, &backbone, reduce)?;
    let mut grads = Vec::new();
    for p in backbone.iter().chain(std::iter::once(&model.head.weight)) {
        let g = (p.take_grad().expect("every parameter has a gradient") / loss_scale)?;
        grads.push(g);
    }
    // The head's gradient is sharded: gather it (for the test only).
    let last = grads.len() - 1;
    grads[last] = comm.allgather(&grads[last])?;
    Ok(Step { loss, grads, bytes })
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    shardnet_conformance::max_rel(a, b).unwrap()
}

fn one_device(cfg: &Config) -> Step {
    launch(1, |c| step(&c, cfg, ReduceOp::Sum, 1.0))
        .unwrap()
        .remove(0)
}

/// Worst relative error of the loss and every gradient against `want`.
fn worst(got: &Step, want: &Step) -> f64 {
    let loss = (got.loss - want.loss).abs() / want.loss.abs();
    got.grads
        .iter()
        .zip(&want.grads)
        .map(|(g, w)| rel_err(g, w))
        .fold(loss, f64::max)
}

#[test]
fn backbone_and_head_gradients_equal_one_device_on_two_to_four_ranks() {
    let cfg = config(13, DType::F32);
    let want = one_device(&cfg);
    for n in 2..=4 {
        for got in launch(n, |c| step(&c, &cfg, ReduceOp::Sum, 1.0)).unwrap() {
            let e = worst(&got, &want);
            assert!(e <= 1e-5, "{n} ranks: relative error {e:.2e} over 1e-5");
        }
    }
}

#[test]
fn fewer_classes_than_ranks_leaves_a_shard_empty_and_still_matches() {
    let cfg = config(3, DType::F32);
    let want = one_device(&cfg);
    for got in launch(4, |c| step(&c, &cfg, ReduceOp::Sum, 1.0)).unwrap() {
        let e = worst(&got, &want);
        assert!(e <= 1e-5, "relative error {e:.2e} over 1e-5");
    }
}

#[test]
fn averaging_the_backbone_gradients_divides_them_by_the_ranks() {
    // The 1/world_size mistake: with Mean, the backbone gradient is 1/n of
    // the one-device gradient, and the comparison above catches it.
    let cfg = config(13, DType::F32);
    let want = one_device(&cfg);
    let n = 3;
    for got in launch(n, |c| step(&c, &cfg, ReduceOp::Mean, 1.0)).unwrap() {
        let backbone = got.grads.len() - 1;
        for (g, w) in got.grads[..backbone].iter().zip(&want.grads) {
            assert!(
                rel_err(g, w) > 0.5,
                "averaged gradients matched: the test could not fail"
            );
            assert!(rel_err(&(g * n as f64).unwrap(), w) <= 1e-5);
        }
    }
}

#[test]
fn half_precision_is_within_tolerance_of_f32_and_halves_feature_traffic() {
    let want = one_device(&config(13, DType::F32));
    let f32_two = launch(2, |c| step(&c, &config(13, DType::F32), ReduceOp::Sum, 1.0)).unwrap();
    // Stated tolerances, relative to the f32 loss and gradients.
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        let cfg = config(13, dtype);
        let got = launch(2, |c| step(&c, &cfg, ReduceOp::Sum, 1024.0)).unwrap();
        for (g, f) in got.iter().zip(&f32_two) {
            let e = worst(g, &want);
            assert!(e <= tol, "{dtype:?}: relative error {e:.2e} over {tol:e}");
            // Features: 5 of 10 rows each way at 16 values; stats: 5B f32.
            let features = |bytes_per_value: u64| 2 * 5 * 16 * bytes_per_value;
            let stats = (4 * B as u64 * 4) + (B as u64 * 4);
            assert_eq!(f.bytes, features(4) + stats);
            assert_eq!(
                g.bytes,
                features(2) + stats,
                "{dtype:?} feature traffic is not half"
            );
        }
    }
}

#[test]
fn communication_per_step_does_not_depend_on_the_classes() {
    let small = launch(2, |c| step(&c, &config(13, DType::F32), ReduceOp::Sum, 1.0)).unwrap();
    let large = launch(2, |c| {
        step(&c, &config(5003, DType::F32), ReduceOp::Sum, 1.0)
    })
    .unwrap();
    for (s, l) in small.iter().zip(&large) {
        assert_eq!(s.bytes, l.bytes);
    }
}

#[test]
fn each_shard_checkpoints_alone_and_loads_back() {
    let dir = std::env::temp_dir().join(format!("shardnet-head-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("head");
    launch(3, |c| {
        let head = ShardedClassifier::new(&c, 11, 4, Margin::CosFace { m: 0.35 }, 5)?;
        let path = head.save(&prefix)?;
        assert!(path.ends_with(format!("head.rank{}-of-3.safetensors", c.rank())));
        let back = ShardedClassifier::load(&c, &prefix, Margin::CosFace { m: 0.35 }, 5)?;
        let same = back
            .weight
            .value()
            .eq(head.weight.value())?
            .min_all()?
            .to_scalar::<u8>()?;
        assert_eq!(same, 1);
        assert_eq!(
            (back.offset(), back.local_classes()),
            (head.offset(), head.local_classes())
        );
        Ok(())
    })
    .unwrap();
    // Two ranks cannot load three ranks' shards: a clear error.
    let err = launch(2, |c| {
        ShardedClassifier::load(&c, &prefix, Margin::None, 5).map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank0-of-2"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The backbone shared out over 2 and 3 ranks (`--shard-state
/// gradients`, ZeRO stage 2; `parameters`, stage 3) trains the parameters
/// the whole backbone trains on as many ranks, bit for bit: a weight's
/// gradient is reduce-scattered in the allreduce's order and Adam steps
/// each share elementwise. Fails when a share's gradient is averaged,
/// dropped or another rank's.
#[test]
fn a_backbone_shared_out_trains_the_whole_backbones_parameters() {
    use shardnet::optim::ShardState;
    let trained = |n: usize, state: ShardState| {
        let mut cfg = config(13, DType::F32);
        cfg.hidden = vec![24, 20];
        cfg.shard_state = state;
        cfg.source = shardnet::models::sharded_head::Source::Synthetic { steps_per_epoch: 6 };
        cfg.train.epochs = 1;
        cfg.train.evaluate = false;
        cfg.train.progress = false;
        let mut reports = launch(n, |c| run(&c, &cfg)).unwrap();
        reports.remove(0).unwrap().params
    };
    for n in [2, 3] {
        let whole = trained(n, ShardState::None);
        for state in [ShardState::Gradients, ShardState::Parameters] {
            let got = trained(n, state);
            assert_eq!(got.len(), whole.len(), "{n} ranks, {state:?}");
            for (name, w) in &whole {
                let d = (&got[name] - w).unwrap().abs().unwrap().max_all().unwrap();
                let d = d.to_scalar::<f32>().unwrap();
                assert_eq!(d, 0.0, "{n} ranks, {state:?}: {name} off by {d}");
            }
        }
    }
}

#[test]
fn face_head_learns_synthetic_identities() {
    let mut cfg = Config::face_head(50, 32);
    cfg.batch_size = 64;
    cfg.train.epochs = 3;
    cfg.train.progress = false;
    cfg.source = shardnet::models::sharded_head::Source::Synthetic {
        steps_per_epoch: 30,
    };
    cfg.margin = Margin::CosFace { m: 0.35 };
    let reports = launch(2, |c| run(&c, &cfg)).unwrap();
    let m = &reports[0].as_ref().unwrap().metrics;
    let last = m.epochs.last().unwrap();
    assert!(
        last.test_accuracy >= 0.9,
        "test accuracy {}",
        last.test_accuracy
    );
    assert!(last.train_loss < m.epochs[0].train_loss);
}

#[test]
fn mnist_arcface_reaches_98_percent() {
    // 4 epochs (the command's default is 5: 98.5%), to keep the test short.
    let mut cfg = Config::mnist_arcface(None);
    cfg.train.epochs = 4;
    cfg.train.progress = false;
    let reports = launch(2, |c| run(&c, &cfg)).unwrap();
    let acc = reports[0]
        .as_ref()
        .unwrap()
        .metrics
        .epochs
        .last()
        .unwrap()
        .test_accuracy;
    assert!(acc >= 0.98, "test accuracy {acc}");
}
