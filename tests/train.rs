//! ChainerMN's model-parallel MLP end to end on the local backend: training
//! split over 2 and 3 ranks (with and without micro-batches) ends with the
//! same parameters as the same model on one rank; wiring mistakes are
//! errors, not hangs.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::links::{MultiNodeChainList, Schedule};
use shardnet::models::mnist_mlp::Config;
use shardnet::optim::ShardState;
use shardnet::train::run;
use shardnet::train::Options;
use shardnet::Error;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod common;
use common::data_dir;

/// `steps` steps of one epoch, without evaluation or progress line.
fn short(steps: usize) -> Options {
    Options {
        max_steps: Some(steps),
        epochs: 1,
        evaluate: false,
        progress: false,
        ..Config::default().train
    }
}

fn train(ranks: usize, stages: usize, micro_batches: usize) -> BTreeMap<String, Tensor> {
    let cfg = Config {
        stages: Some(stages),
        micro_batches,
        data: Some(data_dir()),
        train: short(50),
        ..Config::default()
    };
    trained(
        ranks,
        &cfg,
        &format!("{ranks} ranks, {stages} stages, M={micro_batches}"),
    )
}

/// `cfg` trained on `ranks` thread ranks: rank 0's parameters.
fn trained(ranks: usize, cfg: &Config, what: &str) -> BTreeMap<String, Tensor> {
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, cfg))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    reports
        .into_iter()
        .flatten()
        .next()
        .expect("rank 0 reports")
        .params
}

/// max |got − want| / max |want| per parameter ≤ 1e-5.
fn assert_same(what: &str, got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, w) in want {
        let g = &got[name];
        let diff = (g - w).unwrap().abs().unwrap().max_all().unwrap();
        let scale = w.abs().unwrap().max_all().unwrap();
        let rel = diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap();
        assert!(rel <= 1e-5, "{what}: {name} relative error {rel:e}");
    }
}

#[test]
fn two_stages_over_two_ranks_equal_one_rank() {
    let one = train(1, 2, 1);
    assert_same("2 ranks", &train(2, 2, 1), &one);
}

#[test]
fn three_stages_over_two_and_three_ranks_equal_one_rank() {
    let one = train(1, 3, 1);
    for ranks in [2, 3] {
        assert_same(&format!("{ranks} ranks"), &train(ranks, 3, 1), &one);
    }
}

#[test]
fn micro_batches_give_the_unsplit_batch_gradients() {
    let one = train(1, 3, 1);
    for (ranks, m) in [(1, 4), (2, 4), (3, 3)] {
        assert_same(
            &format!("{ranks} ranks, {m} micro-batches"),
            &train(ranks, 3, m),
            &one,
        );
    }
}

/// 50 steps of 2 stages on `ranks` ranks as `groups` data-parallel
/// pipelines of `micro_batches` each, sharding `state` over the groups,
/// under `schedule` (the default where `None`).
fn train_groups(
    ranks: usize,
    groups: usize,
    micro_batches: usize,
    state: ShardState,
    schedule: Option<Schedule>,
) -> BTreeMap<String, Tensor> {
    let block = shardnet::nn::GATHER_BLOCK;
    train_blocks(ranks, groups, micro_batches, state, schedule, block)
}

/// [`train_groups`], shared-out weights gathered `block` bytes at a time.
fn train_blocks(
    ranks: usize,
    groups: usize,
    micro_batches: usize,
    state: ShardState,
    schedule: Option<Schedule>,
    block: usize,
) -> BTreeMap<String, Tensor> {
    let cfg = Config {
        gather_block: block,
        stages: Some(2),
        micro_batches,
        data_parallel: groups,
        shard_state: state,
        schedule,
        data: Some(data_dir()),
        train: short(50),
        ..Config::default()
    };
    let what = format!(
        "{ranks} ranks, {groups} groups, M={micro_batches}, {state:?}, {schedule:?}, blocks of \
         {block} bytes"
    );
    trained(ranks, &cfg, &what)
}

#[test]
fn data_parallel_pipelines_train_the_one_rank_parameters() {
    // The groups' gradients add in another order than one rank's: equal to
    // rounding (the tolerance of the micro-batch test above).
    let one = train(1, 2, 1);
    for (ranks, groups, m, state) in [
        (2, 2, 1, ShardState::None),
        (4, 2, 2, ShardState::Optimizer),
        (3, 3, 1, ShardState::Parameters),
        (4, 2, 3, ShardState::Gradients),
    ] {
        let what = format!("{ranks} ranks, {groups} groups, M={m}, {state:?}");
        assert_same(&what, &train_groups(ranks, groups, m, state, None), &one);
    }
}

#[test]
fn sharded_gradients_and_weights_train_zero1s_parameters() {
    use ShardState::{Gradients, Optimizer, Parameters};
    // One micro-batch: the same sums in the same order, bit for bit.
    for (ranks, groups) in [(4, 2), (3, 3), (4, 4)] {
        let zero1 = train_groups(ranks, groups, 1, Optimizer, None);
        for state in [Gradients, Parameters] {
            let got = train_groups(ranks, groups, 1, state, None);
            for (name, w) in &zero1 {
                let d = (&got[name] - w).unwrap().abs().unwrap().max_all().unwrap();
                let d = d.to_scalar::<f32>().unwrap();
                assert_eq!(
                    d, 0.0,
                    "{ranks} ranks, {groups} groups, {state:?}: {name} off by {d}"
                );
            }
        }
    }
    // Micro-batches: each one's gradient is summed over the groups before
    // the next is added (ZeRO-1 sums the groups' totals): equal to rounding,
    // under every schedule (zero-bubble's deferred weight gradients are not
    // deferred for a sharded layer).
    for schedule in [Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubble] {
        let zero1 = train_groups(4, 2, 3, Optimizer, Some(schedule));
        for state in [Gradients, Parameters] {
            let got = train_groups(4, 2, 3, state, Some(schedule));
            assert_same(&format!("{schedule:?}, {state:?}"), &got, &zero1);
        }
    }
}

#[test]
fn weights_gathered_in_blocks_train_zero1s_parameters() {
    use ShardState::{Optimizer, Parameters};
    // layer1 (100 × 100) is shared out by rows and gathered in blocks: a
    // row a round (4 bytes), 7 rows a round (uneven over 3 replicas) or 9;
    // layer0 and layer2 are shared by columns and gathered whole. dL/dx is
    // summed block by block: ZeRO-1's parameters to rounding.
    for (ranks, groups, m, schedule, rows) in [
        (4, 2, 1, None, 0),
        (3, 3, 2, Some(Schedule::OneFOneB), 7),
        (4, 2, 3, Some(Schedule::ZeroBubble), 9),
    ] {
        let block = (rows * 100 * 4).max(4);
        let zero1 = train_groups(ranks, groups, m, Optimizer, schedule);
        let got = train_blocks(ranks, groups, m, Parameters, schedule, block);
        let what = format!("{ranks} ranks, {groups} groups, M={m}, blocks of {block} bytes");
        assert_same(&what, &got, &zero1);
    }
}

#[test]
fn training_changes_the_parameters() {
    // The comparisons above would pass trivially if nothing trained.
    let trained = train(1, 2, 1);
    let cfg = Config {
        stages: Some(2),
        data: Some(data_dir()),
        train: short(1),
        ..Config::default()
    };
    let once = launch_with_timeout(1, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
    let once = &once[0].as_ref().unwrap().params;
    let d = (&trained["layer0.weight"] - &once["layer0.weight"]).unwrap();
    let moved = d
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(moved > 1e-3, "parameters barely moved: {moved}");
}

fn identity(xs: &[Tensor]) -> shardnet::Result<Tensor> {
    Ok(xs[0].clone())
}

#[test]
fn a_rank_in_without_a_matching_send_is_an_error_on_every_rank() {
    let t = Instant::now();
    let r = launch_with_timeout(2, Duration::from_secs(20), |c| {
        let mut m = MultiNodeChainList::new(&shardnet::functions::Context::new(&c));
        if c.rank() == 0 {
            m.add_link(identity, &[], &[])?;
        } else {
            // Waits for rank 0, which never sends.
            m.add_link(identity, &[0], &[0])?;
        }
        let x = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
        match m.forward(Some(&[x]), 1) {
            Err(Error::Mismatch { details, .. }) => {
                assert!(
                    details.contains("rank 1: component 0 waits to receive from rank 0"),
                    "{details}"
                );
                Ok(())
            }
            other => panic!("rank {}: {:?}", c.rank(), other.map(|_| ())),
        }
    });
    r.unwrap();
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_cycle_of_receives_is_an_error_not_a_hang() {
    let r = launch_with_timeout(2, Duration::from_secs(20), |c| {
        let mut m = MultiNodeChainList::new(&shardnet::functions::Context::new(&c));
        let peer = 1 - c.rank();
        // Both ranks receive first: each waits for the other forever.
        m.add_link(identity, &[peer], &[peer])?;
        match m.forward(None, 1) {
            Err(Error::Mismatch { details, .. }) => {
                assert!(details.contains("waits to receive"), "{details}");
                Ok(())
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    });
    r.unwrap();
}

#[test]
fn items_left_in_the_local_queue_are_an_error() {
    let r = launch_with_timeout(1, Duration::from_secs(20), |c| {
        let mut m = MultiNodeChainList::new(&shardnet::functions::Context::new(&c));
        m.add_link(identity, &[], &[0])?;
        let x = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
        match m.forward(Some(&[x]), 1) {
            Err(Error::Usage(msg)) if msg.contains("never read") => Ok(()),
            other => panic!("{:?}", other.map(|_| ())),
        }
    });
    r.unwrap();
}

#[test]
fn seed_configuration_reaches_97_percent_in_5_epochs() {
    // ChainerMN's example: n_units 100, Adam, batch 100, 2 ranks.
    let mut cfg = Config {
        data: Some(data_dir()),
        ..Config::default()
    };
    cfg.train.progress = false;
    let reports = launch_with_timeout(2, Duration::from_secs(120), |c| run(&c, &cfg)).unwrap();
    let m = &reports[0].as_ref().unwrap().metrics;
    assert_eq!(m.epochs.len(), 5);
    let acc = m.epochs[4].test_accuracy;
    assert!(acc >= 0.97, "test accuracy after 5 epochs: {acc}");
    assert!(m.epochs[4].train_loss < m.epochs[0].train_loss);
}

/// `shardnet <args>`: (success, stdout and stderr).
fn shardnet(args: &[&str]) -> (bool, String) {
    let (out, text) = common::shardnet(args);
    (out.status.success(), text)
}

#[test]
fn a_flag_of_another_model_is_an_error() {
    for (model, flag, value) in [
        ("face-head", "--units", "5"),
        ("mnist-arcface", "--classes", "7"),
        ("mnist-mlp", "--classes", "3"),
        ("face-head", "--data", "/tmp"),
        ("mnist-arcface", "--naive-head", ""),
        ("mnist-mlp", "--margin", "cosface"),
    ] {
        let args: Vec<&str> = ["train", model, flag, value, "--ranks", "1"]
            .into_iter()
            .filter(|a| !a.is_empty())
            .collect();
        let (ok, text) = shardnet(&args);
        assert!(!ok, "train {model} {flag} succeeded: {text}");
        assert!(
            text.contains(&format!("unexpected argument '{flag}'")),
            "train {model} {flag}: {text}"
        );
    }
}

#[test]
fn each_model_keeps_its_flags_and_defaults() {
    // What users' scripts rely on (bench/*.sh, README.md).
    let defaults: [(&str, &[(&str, &str)]); 3] = [
        (
            "mnist-mlp",
            &[
                ("--ranks", "2"),
                ("--comm", "auto"),
                ("--epochs", "5"),
                ("--batch-size", "100"),
                ("--lr", "1e-3"),
                ("--seed", "0"),
                ("--warmup-steps", "0"),
                ("--units", "100"),
                ("--micro-batches", "1"),
                ("--dataset", "mnist"),
            ],
        ),
        (
            "face-head",
            &[
                ("--epochs", "1"),
                ("--batch-size", "256"),
                ("--lr", "1e-2"),
                ("--dim", "512"),
                ("--classes", "10000"),
                ("--steps-per-epoch", "100"),
                ("--margin", "arcface"),
                ("--precision", "f32"),
                ("--sample-rate", "1"),
            ],
        ),
        (
            "mnist-arcface",
            &[
                ("--epochs", "5"),
                ("--batch-size", "128"),
                ("--lr", "1e-3"),
                ("--dim", "64"),
                ("--scale", "30"),
                ("--margin", "arcface"),
            ],
        ),
    ];
    for (model, flags) in defaults {
        let (ok, help) = shardnet(&["train", model, "--help"]);
        assert!(ok, "{help}");
        for (flag, value) in flags {
            // The flag's entry runs to the next flag's.
            let at = help
                .find(&format!("{flag} <"))
                .unwrap_or_else(|| panic!("{model}: no {flag}: {help}"));
            let entry = &help[at..];
            let entry = &entry[..entry[2..].find("\n      --").map_or(entry.len(), |e| e + 2)];
            assert!(
                entry.contains(&format!("[default: {value}]")),
                "{model} {flag}: {entry}"
            );
        }
    }
    for (model, flags) in [
        (
            "mnist-mlp",
            "--max-steps --metrics --no-eval --data --stages --save-params",
        ),
        (
            "face-head",
            "--max-steps --metrics --no-eval --scale --naive-head",
        ),
        (
            "mnist-arcface",
            "--max-steps --metrics --no-eval --data --precision",
        ),
    ] {
        let (_, help) = shardnet(&["train", model, "--help"]);
        for flag in flags.split(' ') {
            let listed = [' ', '\n']
                .iter()
                .any(|c| help.contains(&format!("{flag}{c}")));
            assert!(listed, "{model}: no {flag}: {help}");
        }
    }
}

#[test]
fn the_benchmark_invocations_still_run() {
    let dir = std::env::temp_dir().join(format!("shardnet-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.json");
    let m = metrics.to_str().unwrap();
    // bench/face_head.sh's row (small), then bench/mlp.sh's.
    let runs: [&[&str]; 2] = [
        &[
            "face-head",
            "--classes",
            "20",
            "--dim",
            "8",
            "--batch-size",
            "8",
            "--max-steps",
            "3",
            "--warmup-steps",
            "1",
            "--steps-per-epoch",
            "3",
            "--epochs",
            "1",
            "--no-eval",
            "--metrics",
            m,
            "--margin",
            "none",
            "--naive-head",
            "--comm",
            "local",
            "--ranks",
            "2",
        ],
        &[
            "mnist-mlp",
            "--units",
            "16",
            "--stages",
            "2",
            "--batch-size",
            "20",
            "--micro-batches",
            "2",
            "--max-steps",
            "3",
            "--warmup-steps",
            "1",
            "--epochs",
            "1",
            "--no-eval",
            "--metrics",
            m,
            "--comm",
            "local",
            "--ranks",
            "2",
        ],
    ];
    for args in runs {
        let _ = std::fs::remove_file(&metrics);
        let mut all = vec!["train"];
        all.extend_from_slice(args);
        let (ok, text) = shardnet(&all);
        assert!(ok, "{all:?}: {text}");
        let json = std::fs::read_to_string(&metrics).unwrap();
        for field in [
            "\"samples_per_s\"",
            "\"peak_memory_bytes\"",
            "\"bytes_received_per_step\"",
            "\"peak_heap_bytes\"",
        ] {
            assert!(json.contains(field), "{all:?}: {json}");
        }
        // The live heap's peak is part of the process's resident peak.
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        for (heap, rss) in v["peak_heap_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .zip(v["peak_memory_bytes"].as_array().unwrap())
        {
            let (heap, rss) = (heap.as_u64().unwrap(), rss.as_u64().unwrap());
            assert!(
                heap > 0 && heap < rss,
                "{all:?}: heap {heap}, resident {rss}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
