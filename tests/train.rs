//! Seed 001 end to end on the local backend: training split over 2 and 3
//! ranks (with and without micro-batches) ends with the same parameters as
//! the same model on one rank; wiring mistakes are errors, not hangs.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::links::MultiNodeChainList;
use shardnet::train::mnist_mlp::{run, Config};
use shardnet::Error;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn data_dir() -> PathBuf {
    std::env::var_os("SHARDNET_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/data"))
}

fn train(ranks: usize, stages: usize, micro_batches: usize) -> BTreeMap<String, Tensor> {
    let cfg = Config {
        stages: Some(stages),
        micro_batches,
        max_steps: Some(50),
        epochs: 1,
        evaluate: false,
        progress: false,
        data: Some(data_dir()),
        ..Config::default()
    };
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg))
        .unwrap_or_else(|e| panic!("{ranks} ranks, {stages} stages, M={micro_batches}: {e}"));
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
fn seed_split_over_two_ranks_equals_one_rank() {
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

#[test]
fn training_changes_the_parameters() {
    // The comparisons above would pass trivially if nothing trained.
    let trained = train(1, 2, 1);
    let cfg = Config {
        stages: Some(2),
        max_steps: Some(1),
        epochs: 1,
        evaluate: false,
        progress: false,
        data: Some(data_dir()),
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
    // Seed 001: n_units 100, Adam, batch 100, 2 ranks.
    let cfg = Config {
        progress: false,
        data: Some(data_dir()),
        ..Config::default()
    };
    let reports = launch_with_timeout(2, Duration::from_secs(120), |c| run(&c, &cfg)).unwrap();
    let m = &reports[0].as_ref().unwrap().metrics;
    assert_eq!(m.epochs.len(), 5);
    let acc = m.epochs[4].test_accuracy;
    assert!(acc >= 0.97, "test accuracy after 5 epochs: {acc}");
    assert!(m.epochs[4].train_loss < m.epochs[0].train_loss);
}
