//! VGG16 with channel-parallel convolutions on the local backend: with an
//! exact split (output or input channels), 2 and 3 ranks, and a 2 × 2 grid
//! (channel parallel inside a group, data parallel with multi-node batch
//! normalisation across), train the parameters 1 rank trains; bad settings
//! are refused before anything is built.

mod common;
use candle_core::Tensor;
use shardnet::comm::launch_with_timeout;
use shardnet::links::ChannelSplit;
use shardnet::train::vgg16::{run, Config, ImageSet, Vgg16Training};
use shardnet::train::Options;
use std::collections::BTreeMap;
use std::time::Duration;

/// 20 steps of a narrow VGG16 (4 to 32 channels) on synthetic images, batch
/// 8, dropout and batch normalisation on.
fn train(split: ChannelSplit, ranks: usize, groups: usize) -> (BTreeMap<String, Tensor>, f64) {
    let cfg = config(split, groups, 20);
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
    let r = reports.into_iter().flatten().next().unwrap();
    (r.params, r.metrics.epochs[0].train_loss)
}

fn config(split: ChannelSplit, groups: usize, steps: usize) -> Config {
    let mut cfg = Config::new(split);
    cfg.width = 1.0 / 16.0;
    cfg.batch_size = 8;
    cfg.data_parallel = groups;
    cfg.dataset = ImageSet::Synthetic;
    cfg.synthetic_examples = 160;
    cfg.train = Options {
        max_steps: Some(steps),
        evaluate: false,
        progress: false,
        ..cfg.train
    };
    cfg
}

fn worst(got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) -> (f64, String) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    got.iter()
        .map(|(k, g)| {
            assert_eq!(g.dims(), want[k].dims(), "{k}");
            (
                shardnet::conformance::max_rel(g, &want[k]).unwrap(),
                k.clone(),
            )
        })
        .fold((0.0, String::new()), |a, b| if b.0 > a.0 { b } else { a })
}

/// The gradients of the first step, whole.
fn first_gradients(split: ChannelSplit, ranks: usize, groups: usize) -> BTreeMap<String, Tensor> {
    let cfg = config(split, groups, 1);
    let grads = launch_with_timeout(ranks, Duration::from_secs(60), |c| {
        Vgg16Training::new(&c, &cfg)?.gradients(0)
    })
    .unwrap();
    grads.into_iter().flatten().next().unwrap()
}

#[test]
fn exact_channel_parallelism_gives_one_ranks_gradients() {
    let one = first_gradients(ChannelSplit::None, 1, 1);
    for (split, ranks, groups) in GRIDS {
        let (e, at) = worst(&first_gradients(split, ranks, groups), &one);
        assert!(
            e <= 1e-5,
            "{split} on {ranks} ranks in {groups} group(s): d{at} differs by {e:e}"
        );
    }
}

/// (split, ranks, data-parallel groups)
const GRIDS: [(ChannelSplit, usize, usize); 5] = [
    (ChannelSplit::Output, 2, 1),
    (ChannelSplit::Input, 3, 1),
    (ChannelSplit::Output, 4, 2),
    (ChannelSplit::Input, 4, 2),
    (ChannelSplit::None, 2, 2),
];

/// After 20 Adam steps: Adam divides each gradient by its running RMS, so
/// f32 rounding in near-zero gradients (sums in another order on another
/// split) grows to ~1e-4 of a parameter's scale; the gradients themselves
/// agree to 1e-5 (above).
#[test]
fn exact_channel_parallelism_on_two_and_three_ranks_and_a_grid_equals_one_rank() {
    let (one, l1) = train(ChannelSplit::None, 1, 1);
    // 13 convolution weights (no biases beside batch norm), 13 batch norms, 2 linear layers.
    assert_eq!(one.len(), 13 + 13 * 2 + 4, "{:?}", one.keys());
    for (split, ranks, groups) in GRIDS {
        let (got, loss) = train(split, ranks, groups);
        let (e, at) = worst(&got, &one);
        assert!(
            e <= 1e-3,
            "{split} on {ranks} ranks in {groups} group(s): {at} differs by {e:e}"
        );
        assert!(
            (loss - l1).abs() <= 1e-4 * l1,
            "{split} {ranks}/{groups}: loss {loss} vs {l1}"
        );
    }
}

#[test]
fn grouped_split_trains_and_bad_settings_are_refused() {
    let (_, loss) = train(ChannelSplit::Grouped, 2, 1);
    assert!(loss.is_finite());
    for (args, want) in [
        (&["--width", "0"][..], "--width 0"),
        (&["--width", "nan"][..], "--width NaN"),
        (&["--parallel-conv", "rows"][..], "invalid value 'rows'"),
        (&["--data-parallel", "3"][..], "does not divide"),
        (&["--dropout", "1"][..], "--dropout 1"),
        (&["--dataset", "cifar10"][..], "needs --data DIR"),
        (
            &["--batch-size", "1", "--data-parallel", "2"][..],
            "smaller than --data-parallel",
        ),
    ] {
        let mut all = vec!["train", "vgg16", "--ranks", "2", "--max-steps", "1"];
        all.extend_from_slice(args);
        let (out, text) = common::shardnet(&all);
        assert!(!out.status.success(), "{args:?}: {text}");
        assert!(text.contains(want), "{args:?}: {text}");
    }
}
