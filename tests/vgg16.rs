//! VGG16 with channel-parallel convolutions on the local backend: with an
//! exact split (output or input channels), 2 and 3 ranks, and a 2 × 2 grid
//! (channel parallel inside a group, data parallel with multi-node batch
//! normalisation across), train the parameters 1 rank trains; bad settings
//! are refused before anything is built.

mod common;
use candle_core::Tensor;
use shardnet::comm::launch_with_timeout;
use shardnet::links::ChannelSplit;
use shardnet::train::run;
use std::collections::BTreeMap;
use std::time::Duration;

/// Steps of the training comparison: 5 on either path. The splits sum in
/// other orders than one rank, and Adam's g/√v turns the f32 rounding of
/// near-zero gradients (batch norm biases near 0) into ±lr steps: the
/// parameters agree to 1e-4 after 5 steps, but bn12.bias drifts 0.12 of
/// its (tiny) scale by step 20 — a drift, not a wrong gradient (those
/// agree to 1e-5 at every step; `full_batch_steps_equal_the_f64_definition`
/// holds every split to the f64 definition).
fn steps() -> usize {
    5
}

/// `steps()` steps of a narrow VGG16 (4 to 32 channels) on synthetic
/// images, batch 8, dropout and batch normalisation on, then the test
/// set's 32 images evaluated in the eval mode (running statistics, each
/// group its share, hits summed over the groups): (parameters, train
/// loss, test accuracy).
fn train(split: ChannelSplit, ranks: usize, groups: usize) -> (BTreeMap<String, Tensor>, f64, f64) {
    let mut cfg = common::vgg16_config(split, groups, steps());
    cfg.train.evaluate = true;
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
    let r = reports.into_iter().flatten().next().unwrap();
    let e = &r.metrics.epochs[0];
    (r.params, e.train_loss, e.test_accuracy)
}

#[test]
fn exact_channel_parallelism_gives_one_ranks_gradients() {
    let one = common::vgg16_first_gradients(ChannelSplit::None, 1, 1);
    for (split, ranks, groups) in GRIDS {
        let (e, at) = common::worst(&common::vgg16_first_gradients(split, ranks, groups), &one);
        assert!(
            e <= 1e-5,
            "{split} on {ranks} ranks in {groups} group(s): d{at} differs by {e:e}"
        );
    }
}

/// (split, ranks, data-parallel groups). On 4 ranks the input split leaves
/// rank 3 without any of the images' 3 channels (an empty first-layer
/// shard).
const GRIDS: [(ChannelSplit, usize, usize); 7] = [
    (ChannelSplit::Output, 2, 1),
    (ChannelSplit::Output, 3, 1),
    (ChannelSplit::Input, 3, 1),
    (ChannelSplit::Input, 4, 1),
    (ChannelSplit::Output, 4, 2),
    (ChannelSplit::Input, 4, 2),
    (ChannelSplit::None, 2, 2),
];

/// After 20 Adam steps (5 on the generic path: see `steps`): Adam divides each gradient by its running RMS, so
/// f32 rounding in near-zero gradients (sums in another order on another
/// split) grows to ~1e-4 of a parameter's scale; the gradients themselves
/// agree to 1e-5 (above).
#[test]
fn exact_channel_parallelism_on_two_and_three_ranks_and_a_grid_equals_one_rank() {
    let (one, l1, a1) = train(ChannelSplit::None, 1, 1);
    // 13 convolution weights (no biases beside batch norm), 13 batch norms
    // (γ, β and the running mean and variance), 2 linear layers.
    assert_eq!(one.len(), 13 + 13 * 4 + 4, "{:?}", one.keys());
    for (split, ranks, groups) in GRIDS {
        let (got, loss, acc) = train(split, ranks, groups);
        // One of the 32 test images may flip on a near-tie.
        assert!(
            (acc - a1).abs() <= 1.0 / 32.0 + 1e-9,
            "{split} {ranks}/{groups}: test accuracy {acc} vs {a1}"
        );
        let (e, at) = common::worst(&got, &one);
        let tol = 1e-4;
        assert!(
            e <= tol,
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
    let (_, loss, _) = train(ChannelSplit::Grouped, 2, 1);
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
        (
            &["--local-batch-norm"][..],
            "with --data-parallel 1 there is one",
        ),
        (
            &[
                "--local-batch-norm",
                "--data-parallel",
                "2",
                "--no-batch-norm",
            ][..],
            "--local-batch-norm with --no-batch-norm",
        ),
        (
            &["--parallel-conv", "grouped", "--shard-state", "parameters"][..],
            "--shard-state parameters with --parallel-conv grouped",
        ),
        (&["--shard-state", "weights"][..], "invalid value 'weights'"),
        (
            &["--parallel-conv", "grouped", "--shard-state", "gradients"][..],
            "--shard-state gradients with --parallel-conv grouped",
        ),
    ] {
        let mut all = vec!["train", "vgg16", "--ranks", "2", "--max-steps", "1"];
        all.extend_from_slice(args);
        let (out, text) = common::shardnet(&all);
        assert!(!out.status.success(), "{args:?}: {text}");
        assert!(text.contains(want), "{args:?}: {text}");
    }
}

/// CIFAR-10's binary format, written here (no real files can be had):
/// `shardnet train vgg16 --dataset cifar10 --data DIR` trains on them on 2
/// ranks, and a truncated file stops the run before the first step with a
/// message naming it.
#[test]
fn cifar10_files_train_and_a_truncated_one_is_named() {
    let dir = std::env::temp_dir().join(format!("shardnet-vgg-cifar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, records: usize| {
        let mut bytes = Vec::with_capacity(records * 3073);
        for i in 0..records {
            bytes.push((i % 10) as u8);
            bytes.extend((0..3072).map(|k| ((k * 7 + i * 13) % 256) as u8));
        }
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    for k in 1..=5 {
        write(&format!("data_batch_{k}.bin"), 16);
    }
    write("test_batch.bin", 16);
    let d = dir.display().to_string();
    let args = [
        "train",
        "vgg16",
        "--ranks",
        "2",
        "--dataset",
        "cifar10",
        "--data",
        &d,
        "--width",
        "0.0625",
        "--batch-size",
        "8",
        "--max-steps",
        "3",
    ];
    let (out, text) = common::shardnet(&args);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("test accuracy"), "{text}");
    // data_batch_3.bin loses its last byte.
    let p = dir.join("data_batch_3.bin");
    let mut b = std::fs::read(&p).unwrap();
    b.pop();
    std::fs::write(&p, b).unwrap();
    let (out, text) = common::shardnet(&args);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("data_batch_3.bin"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each step's whole gradients and, on ranks holding whole batch norms, the
/// running statistics after the last, of [`common::vgg16_config`] with batch
/// norm over `slices` slices of each batch (`None`: the whole batch), 17
/// images: batches of 8, 8 and 1 (the last leaves every replica but the
/// first without an image).
type LocalRun = (Vec<BTreeMap<String, Tensor>>, BTreeMap<String, Vec<f32>>);

fn short_last_batch(
    split: ChannelSplit,
    ranks: usize,
    groups: usize,
    slices: Option<usize>,
) -> LocalRun {
    use shardnet::train::TrainModel;
    let mut cfg = common::vgg16_config(split, groups, 3);
    cfg.synthetic_examples = 17;
    cfg.batch_norm_slices = slices;
    let runs = launch_with_timeout(ranks, Duration::from_secs(60), |c| {
        let mut t = shardnet::models::vgg16::Vgg16Training::new(&c, &cfg)?;
        let mut grads = Vec::new();
        for step in 0..3 {
            grads.extend(t.gradients(step)?);
        }
        let mut stats = BTreeMap::new();
        if split == ChannelSplit::None {
            for s in t.extra_state() {
                stats.insert(s.name.clone(), s.with_values(|v| Ok(v.to_vec()))?);
            }
        }
        Ok((grads, stats))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// The three steps' gradients of [`short_last_batch`] on a grid against
/// one rank's. The input split sums its partial convolutions in another
/// order than one rank: 1.0e-5 measured on the generic path with slices of
/// 4 images. The one-image step is ill-conditioned in f32: one rank's
/// gradients on the CPU kernels and on the generic path differ by 1.0e-4
/// (dbn2.bias), the input split's by 1.1e-4. The other splits sum in one
/// rank's order.
fn same_steps(
    got: &[BTreeMap<String, Tensor>],
    want: &[BTreeMap<String, Tensor>],
    (split, ranks, groups): (ChannelSplit, usize, usize),
) {
    assert_eq!((got.len(), want.len()), (3, 3));
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let (e, at) = common::worst(g, w);
        let tol = match (split, step) {
            (ChannelSplit::Input, 2) => 2e-4,
            (ChannelSplit::Input, _) => 2e-5,
            _ => 1e-5,
        };
        assert!(
            e <= tol,
            "{split} on {ranks} ranks, {groups} replicas, step {step}: d{at} differs by {e:e}"
        );
    }
}

/// `--local-batch-norm`: G replicas, each normalising its own images alone,
/// compute what one rank computes normalising the same G slices of each
/// batch alone (ghost batch norm): every gradient of three steps, the last
/// of one image (so that other replicas hold none), and the running
/// statistics every rank holds after them (averaged over the replicas), on
/// 2 and 3 replicas (uneven: 3, 3, 2 images) and with either exact channel
/// split inside 2 groups of 2. Batch norm over the whole batch gives other
/// gradients (the test tells the two apart).
#[test]
fn local_batch_norm_on_replicas_is_ghost_batch_norm_on_one_rank() {
    let mut reference = BTreeMap::new();
    for (split, ranks, groups) in [
        (ChannelSplit::None, 2, 2),
        (ChannelSplit::None, 3, 3),
        (ChannelSplit::Output, 4, 2),
        (ChannelSplit::Input, 4, 2),
    ] {
        let (want, want_stats) = reference
            .entry(groups)
            .or_insert_with(|| short_last_batch(ChannelSplit::None, 1, 1, Some(groups)));
        let (got, stats) = short_last_batch(split, ranks, groups, Some(groups));
        same_steps(&got, want, (split, ranks, groups));
        for (name, v) in &stats {
            let w = &want_stats[name];
            let e = v
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                .fold(0f32, f32::max);
            assert!(
                e <= 1e-5,
                "{split} {ranks}/{groups}: {name} differs by {e:e}"
            );
        }
        if split == ChannelSplit::None {
            assert_eq!(stats.len(), 26, "{:?}", stats.keys());
        }
    }
    // The whole batch's statistics give other gradients.
    let whole = common::vgg16_first_gradients(ChannelSplit::None, 2, 2);
    let (e, at) = common::worst(&reference[&2].0[0], &whole);
    assert!(
        e > 1e-3,
        "local and whole-batch batch norm agree (d{at} by {e:e})"
    );
}

/// Data parallelism with the whole batch's statistics when an epoch's last
/// batch (1 image) leaves replicas without images: every gradient of the
/// three steps is one rank's, on 2 and 3 replicas and with each exact
/// split inside 2 groups of 2 (before, a replica without images failed in
/// the loss's log-softmax, and the input split's empty view in candle's
/// CPU ops).
#[test]
fn data_parallel_replicas_without_images_give_one_ranks_gradients() {
    let (one, _) = short_last_batch(ChannelSplit::None, 1, 1, None);
    for (split, ranks, groups) in [
        (ChannelSplit::None, 2, 2),
        (ChannelSplit::None, 3, 3),
        (ChannelSplit::Output, 4, 2),
        (ChannelSplit::Input, 4, 2),
    ] {
        let (got, _) = short_last_batch(split, ranks, groups, None);
        same_steps(&got, &one, (split, ranks, groups));
    }
}

/// VGG16 by its definition in f64 (candle's f64 ops and autograd, none of
/// our kernels): 13 3×3 convolutions, batch normalisation in training
/// mode (biased variance, ε = 1e-5), ReLU, 2×2 max pooling after the 2nd,
/// 4th, 7th, 10th and 13th, Linear → ReLU → Linear, the mean
/// cross-entropy; then SGD or Adam by their definitions. θ after each of
/// `steps` full-batch steps from `init`.
mod f64_reference {
    use candle_core::{DType, Tensor, Var, D};
    use std::collections::BTreeMap;

    /// How the f64 reference steps.
    #[derive(Clone, Copy, Debug)]
    pub enum Opt {
        /// torch.optim.SGD(lr, momentum, weight_decay).
        Sgd { lr: f64, momentum: f64, decay: f64 },
        /// torch.optim.Adam(lr) with β = (0.9, 0.999), ε = 1e-8.
        Adam { lr: f64 },
    }

    fn loss(p: &BTreeMap<String, Var>, x: &Tensor, t: &Tensor) -> Tensor {
        let mut h = x.clone();
        for k in 1..=13 {
            let w = p[&format!("conv{k}.weight")].as_tensor();
            h = h.conv2d(w, 1, 1, 1, 1).unwrap();
            let c = w.dims()[0];
            let mean = h.mean_keepdim((0, 2, 3)).unwrap();
            let centred = h.broadcast_sub(&mean).unwrap();
            let var = centred.sqr().unwrap().mean_keepdim((0, 2, 3)).unwrap();
            let gamma = p[&format!("bn{k}.weight")]
                .as_tensor()
                .reshape((1, c, 1, 1));
            let beta = p[&format!("bn{k}.bias")].as_tensor().reshape((1, c, 1, 1));
            h = centred
                .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&gamma.unwrap())
                .unwrap()
                .broadcast_add(&beta.unwrap())
                .unwrap()
                .relu()
                .unwrap();
            if [2, 4, 7, 10, 13].contains(&k) {
                // The 2×2 windows' maxima by reductions (candle 0.11's
                // max_pool2d backward scales the gradient by 1/4); ties
                // come only from ReLU's zeros, whose gradient ReLU stops.
                let (b, c, hh, ww) = h.dims4().unwrap();
                h = h
                    .reshape((b, c, hh / 2, 2, ww / 2, 2))
                    .unwrap()
                    .max(5)
                    .unwrap()
                    .max(3)
                    .unwrap();
            }
        }
        let h = h.flatten_from(1).unwrap();
        let linear = |h: &Tensor, name: &str| {
            let w = p[&format!("{name}.weight")].as_tensor();
            let b = p[&format!("{name}.bias")].as_tensor();
            h.matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap()
        };
        let y = linear(&linear(&h, "fc1").relu().unwrap(), "fc2");
        let logp = candle_nn::ops::log_softmax(&y, D::Minus1).unwrap();
        let nll = logp.gather(&t.unsqueeze(1).unwrap(), 1).unwrap();
        nll.mean_all().unwrap().neg().unwrap()
    }

    /// θ after `steps` full-batch steps on images `x` (f32, N×3×32×32) and
    /// labels `t`, from `init` (the parameters; running statistics are
    /// left out).
    pub fn train(
        init: &BTreeMap<String, Tensor>,
        x: &Tensor,
        t: &Tensor,
        opt: Opt,
        steps: usize,
    ) -> BTreeMap<String, Tensor> {
        let p: BTreeMap<String, Var> = init
            .iter()
            .filter(|(k, _)| !k.contains("running"))
            .map(|(k, v)| {
                (
                    k.clone(),
                    Var::from_tensor(&v.to_dtype(DType::F64).unwrap()).unwrap(),
                )
            })
            .collect();
        let zeros = || -> BTreeMap<String, Tensor> {
            p.iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().zeros_like().unwrap()))
                .collect()
        };
        let (mut a, mut b) = (zeros(), zeros());
        let x = x.to_dtype(DType::F64).unwrap();
        for step in 1..=steps {
            let grads = loss(&p, &x, t).backward().unwrap();
            for (k, v) in &p {
                let g = grads
                    .get(v.as_tensor())
                    .expect("a gradient for every parameter");
                let theta = v.as_tensor();
                let new = match opt {
                    Opt::Sgd {
                        lr,
                        momentum,
                        decay,
                    } => {
                        let d = (g + (theta * decay).unwrap()).unwrap();
                        let buf = if step == 1 {
                            d
                        } else {
                            ((&a[k] * momentum).unwrap() + d).unwrap()
                        };
                        let new = (theta - (&buf * lr).unwrap()).unwrap();
                        a.insert(k.clone(), buf);
                        new
                    }
                    Opt::Adam { lr } => {
                        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
                        let m = ((&a[k] * b1).unwrap() + (g * (1.0 - b1)).unwrap()).unwrap();
                        let s = ((&b[k] * b2).unwrap() + (g.sqr().unwrap() * (1.0 - b2)).unwrap())
                            .unwrap();
                        let m_hat = (&m / (1.0 - b1.powi(step as i32))).unwrap();
                        let v_hat = (&s / (1.0 - b2.powi(step as i32))).unwrap();
                        let upd = (m_hat / (v_hat.sqrt().unwrap() + eps).unwrap()).unwrap();
                        a.insert(k.clone(), m);
                        b.insert(k.clone(), s);
                        (theta - (upd * lr).unwrap()).unwrap()
                    }
                };
                v.set(&new).unwrap();
            }
        }
        p.into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect()
    }
}

/// A narrow VGG16 (4 to 32 channels, batch norm, no dropout) on 16
/// synthetic images, full batch, 3 steps of SGD (momentum, weight decay)
/// and of Adam, on 1 rank and split over 2 (output and input channels):
/// against the f64 definition, each parameter tensor's distance from it
/// within 2e-4 of its change (f32 rounding through 16 layers; measured on
/// every split: SGD up to 2.8e-5, Adam up to 7.6e-5, both at a batch norm
/// scale γ; the first-step gradients agree to 1e-6 of their norm).
#[test]
fn full_batch_steps_equal_the_f64_definition() {
    use f64_reference::Opt;
    use shardnet::optim::{OptimizerConfig, OptimizerKind};
    use shardnet::train::TrainModel;
    let n = 16;
    let images = shardnet::data::synthetic_images(n, 3, 32, 10, 0).unwrap();
    let x = images.x.reshape((n, 3, 32, 32)).unwrap();
    for (opt, lr) in [
        (
            Opt::Sgd {
                lr: 0.05,
                momentum: 0.9,
                decay: 5e-4,
            },
            0.05,
        ),
        (Opt::Adam { lr: 1e-3 }, 1e-3),
    ] {
        let config = |split: ChannelSplit| {
            let mut cfg = common::vgg16_config(split, 1, 3);
            cfg.synthetic_examples = n;
            cfg.batch_size = n;
            cfg.dropout = 0.0;
            cfg.train.epochs = 3;
            cfg.train.lr = lr;
            cfg.train.optimizer = match opt {
                Opt::Sgd {
                    momentum, decay, ..
                } => OptimizerConfig {
                    kind: OptimizerKind::Sgd,
                    momentum,
                    weight_decay: decay,
                },
                Opt::Adam { .. } => OptimizerConfig::default(),
            };
            cfg
        };
        let cfg = config(ChannelSplit::None);
        let init = launch_with_timeout(1, Duration::from_secs(60), |c| {
            shardnet::models::vgg16::Vgg16Training::new(&c, &cfg)?.gather_params()
        })
        .unwrap()
        .remove(0)
        .unwrap();
        let want = f64_reference::train(&init, &x, &images.t, opt, 3);
        for (split, ranks) in [
            (ChannelSplit::None, 1),
            (ChannelSplit::Output, 2),
            (ChannelSplit::Input, 2),
        ] {
            let cfg = config(split);
            let reports =
                launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
            let got = reports.into_iter().flatten().next().unwrap().params;
            for (k, w) in &want {
                let norm = |t: &Tensor| -> f64 {
                    t.sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap()
                        .sqrt()
                };
                let init = init[k].to_dtype(candle_core::DType::F64).unwrap();
                let ours = got[k].to_dtype(candle_core::DType::F64).unwrap();
                let moved = norm(&(w - &init).unwrap());
                let err = norm(&(&ours - w).unwrap()) / moved;
                assert!(
                    err <= 2e-4,
                    "{opt:?}, {split} on {ranks} rank(s): {k} is {err:e} of its change \
                     ({moved:e}) from the f64 definition"
                );
            }
        }
    }
}

/// `--shard-state parameters` and `gradients`: each replica holds a share
/// of every convolution's weight (1/G of the rank's weight elements, along
/// the channel split's dimension) as the parameter its optimizer steps
/// (`gradients` keeps a gathered copy between the passes of a step), and
/// the replicas train the parameters the unsharded replicas
/// (`--shard-state optimizer`) train, bit for bit: the weight gradients'
/// reduce-scatter adds the replicas' in the allreduce's order. On 2 and 3 replicas (uneven shares), and inside an output and an
/// input split; the first gradients are one rank's.
#[test]
fn fully_sharded_replicas_train_the_unsharded_parameters() {
    use shardnet::models::vgg16::{Config, Vgg16Training};
    use shardnet::optim::ShardState;
    let run = |cfg: &Config, ranks: usize| {
        let reports =
            launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, cfg)).unwrap();
        reports.into_iter().flatten().next().unwrap().params
    };
    // The convolution weights' elements on each rank.
    let conv_elements = |cfg: &Config, ranks: usize| -> Vec<usize> {
        launch_with_timeout(ranks, Duration::from_secs(60), |c| {
            Ok(Vgg16Training::new(&c, cfg)?
                .params()
                .iter()
                .filter(|p| p.name().starts_with("conv"))
                .map(|p| p.value().elem_count())
                .sum())
        })
        .unwrap()
    };
    let one = common::vgg16_first_gradients(ChannelSplit::None, 1, 1);
    for (split, ranks, groups) in [
        (ChannelSplit::None, 2, 2),
        (ChannelSplit::None, 3, 3),
        (ChannelSplit::Output, 4, 2),
        (ChannelSplit::Input, 4, 2),
    ] {
        let mut zero1 = common::vgg16_config(split, groups, steps());
        zero1.shard_state = ShardState::Optimizer;
        let mut zero3 = zero1.clone();
        zero3.shard_state = ShardState::Parameters;
        let mut zero2 = zero1.clone();
        zero2.shard_state = ShardState::Gradients;
        let want = run(&zero1, ranks);
        for cfg in [&zero3, &zero2] {
            let (e, at) = common::worst(&run(cfg, ranks), &want);
            assert!(
                e == 0.0,
                "{split} on {ranks} ranks in {groups} groups, --shard-state {}: {at} differs by \
                 {e:e}",
                cfg.shard_state
            );
        }
        let first = {
            let mut cfg = zero3.clone();
            cfg.train.max_steps = Some(1);
            launch_with_timeout(ranks, Duration::from_secs(60), |c| {
                Vgg16Training::new(&c, &cfg)?.gradients(0)
            })
            .unwrap()
            .into_iter()
            .flatten()
            .next()
            .unwrap()
        };
        let (e, at) = common::worst(&first, &one);
        assert!(
            e <= 1e-5,
            "{split} {ranks}/{groups}: d{at} differs by {e:e}"
        );
        let whole: usize = conv_elements(&zero1, ranks).iter().sum();
        for cfg in [&zero3, &zero2] {
            let held: usize = conv_elements(cfg, ranks).iter().sum();
            assert_eq!(
                held * groups,
                whole,
                "{split} {ranks}/{groups}, {}: the replicas hold {held} of {whole} weight \
                 elements",
                cfg.shard_state
            );
        }
    }
}
