//! The CPU kernels and the device-generic path (candle's ops, what a GPU
//! runs) side by side in one process: one behaviour, not two. The path is
//! chosen per process (`kernels::set_kernels`), so the tests here take
//! turns under one lock.

mod common;
use candle_core::Tensor;
use common::optim_ref::{fixed_settings, inputs, run, Case, Form, Settings};
use shardnet::kernels::{set_kernels, Kernels};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

static TURN: Mutex<()> = Mutex::new(());

/// `f` on the CPU kernels, then on the generic path.
fn on_both<R>(f: impl Fn() -> R) -> (R, R) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    set_kernels(Kernels::Fast);
    let fast = f();
    set_kernels(Kernels::Generic);
    let generic = f();
    set_kernels(Kernels::Fast);
    (fast, generic)
}

/// From the same gradients, every optimizer gives the same parameters on
/// both paths, bit for bit, after six steps (whole-tensor and
/// sharded-state forms): the same f32 constants, the same operations in
/// the same order.
#[test]
fn optimizer_steps_are_the_same_bits_on_both_paths() {
    let mut settings = fixed_settings();
    settings.push(Settings::Adam {
        lr: 0.37,
        betas: (0.8, 0.95),
        eps: 1e-6,
        decay: 3e-3,
        decoupled: false,
    });
    for settings in settings {
        for form in [Form::Whole, Form::Sharded(3)] {
            let case = Case {
                settings,
                form,
                rows: 6,
                cols: 37,
                steps: 6,
                seed: 5,
            };
            let (theta0, grads) = inputs(&case);
            let (fast, generic) = on_both(|| run(&case, &theta0, &grads));
            for (i, (a, b)) in fast.iter().zip(&generic).enumerate() {
                assert!(
                    a == b,
                    "{case:?}: element {i}: {a:e} on the CPU kernels, {b:e} on the generic path"
                );
            }
        }
    }
}

/// ChainerMN's MLP (784–100–100–10 on MNIST, batch 100), three Adam steps
/// from one initialisation on each path: the gradients differ only in
/// their sums' order (f32 rounding), so the parameters' changes agree to
/// 5e-6 of their norm, tensor by tensor (measured: 3.5e-7 to 7e-7; the
/// CPU kernel's 1 − β2 rounded in f32 put them 6.4e-6 apart).
#[test]
fn mlp_adam_steps_agree_on_both_paths() {
    use shardnet::models::mnist_mlp::Config;
    use shardnet::train::run;
    let train = |steps: usize| -> BTreeMap<String, Tensor> {
        let mut cfg = Config {
            data: Some(common::data_dir()),
            ..Config::default()
        };
        cfg.train.max_steps = Some(steps);
        cfg.train.epochs = 1;
        cfg.train.evaluate = false;
        cfg.train.progress = false;
        let reports =
            shardnet::comm::launch_with_timeout(1, Duration::from_secs(60), |c| run(&c, &cfg))
                .expect("run");
        reports.into_iter().flatten().next().expect("rank 0").params
    };
    let (fast, generic) = on_both(|| train(3));
    // The initialisation, as the model draws it (seed 0, layer by layer).
    let store = shardnet::nn::ParamStore::new(&shardnet::comm::HOST, 0);
    let mut init = BTreeMap::new();
    for l in 0..3 {
        let (o, i) = fast[&format!("layer{l}.weight")].dims2().unwrap();
        let layer = store.linear(&format!("layer{l}"), l, i, o).unwrap();
        init.insert(format!("layer{l}.weight"), layer.weight().value().clone());
        let b = layer.bias().expect("bias").value().clone();
        init.insert(format!("layer{l}.bias"), b);
    }
    assert_eq!(init.len(), fast.len(), "{:?}", fast.keys());
    let norm = |t: &Tensor| -> f64 {
        f64::from(
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
        )
        .sqrt()
    };
    for (name, w0) in &init {
        let moved = norm(&(&generic[name] - w0).unwrap());
        let apart = norm(&(&fast[name] - &generic[name]).unwrap());
        assert!(moved > 0.0, "{name} did not move");
        assert!(
            apart <= 5e-6 * moved,
            "{name}: the paths are {apart:e} apart after a change of {moved:e}"
        );
    }
}

/// This rank's head weight and optimizer state (weight first) after
/// `steps` fused Partial FC steps (rate 0.3, ArcFace, 700 classes of 16)
/// of `opt`, and the same before the first step.
fn fused_partial_fc(
    comm: &shardnet::Communicator,
    opt: shardnet::optim::OptimizerConfig,
    steps: usize,
) -> shardnet::Result<[Vec<Vec<f32>>; 2]> {
    use shardnet::functions::Margin;
    use shardnet::links::ShardedClassifier;
    use shardnet::optim::Optimizer;
    let (b, d, classes) = (24usize, 16usize, 700usize);
    let mut head = ShardedClassifier::new(comm, classes, d, Margin::ArcFace { m: 0.5 }, 5)?;
    head.sample_rate = 0.3;
    let mut o = Optimizer::new(&opt, vec![head.weight.clone()], 0.05)?;
    o.fuse(&head.weight)?;
    let snapshot = |o: &Optimizer| -> shardnet::Result<Vec<Vec<f32>>> {
        let mut out = vec![head.weight.value().flatten_all()?.to_vec1::<f32>()?];
        for s in o.state() {
            out.push(s.with_values(|v| Ok(v.to_vec()))?);
        }
        Ok(out)
    };
    let before = snapshot(&o)?;
    for step in 0..steps {
        let x: Vec<f32> = (0..b * d)
            .map(|i| (((i + 31 * step) * 2654435761usize % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x = Tensor::from_vec(x, (b, d), &candle_core::Device::Cpu)?;
        let labels: Vec<u32> = (0..b)
            .map(|i| ((i * 97 + step * 13) % classes) as u32)
            .collect();
        head.set_step(step as u64);
        o.prepare_fused(1.0);
        head.forward(&x, &labels)?.loss.backward()?;
        o.step()?;
    }
    Ok([before, snapshot(&o)?])
}

/// Partial FC's fused head step on each path, for SGD (momentum, weight
/// decay), Adam (L2 decay) and AdamW, on 2 ranks, 5 steps: the same lazy
/// update. The rows that moved are the same on both paths (the others
/// keep θ0 and zero state bit for bit on both), and each tensor's change
/// (weight, momentum, m, v) agrees to 1e-5 of its norm for SGD, 1e-4 for
/// Adam (measured: 1.1e-6 and 1.0e-5). The gradients differ only in their
/// sums' order; Adam's m/√v magnifies that where a gradient element is
/// near zero.
#[test]
fn fused_partial_fc_is_the_same_lazy_step_on_both_paths() {
    use shardnet::optim::OptimizerConfig;
    let adam = OptimizerConfig {
        weight_decay: 1e-3,
        ..OptimizerConfig::default()
    };
    for opt in [OptimizerConfig::sgd(), adam, OptimizerConfig::adamw()] {
        let run = || {
            shardnet::comm::launch_with_timeout(2, Duration::from_secs(60), |c| {
                fused_partial_fc(&c, opt, 5)
            })
            .expect("run")
        };
        let (fast, generic) = on_both(run);
        for (rank, (f, g)) in fast.iter().zip(&generic).enumerate() {
            let [before, f] = f;
            let [_, g] = g;
            for (t, ((b, f), g)) in before.iter().zip(f).zip(g).enumerate() {
                let d = 16;
                for r in 0..b.len() / d {
                    let span = r * d..(r + 1) * d;
                    let moved = |v: &[f32]| {
                        v[span.clone()]
                            .iter()
                            .zip(&b[span.clone()])
                            .any(|(x, y)| x.to_bits() != y.to_bits())
                    };
                    assert_eq!(
                        moved(f),
                        moved(g),
                        "{:?}, rank {rank}, tensor {t}, row {r}: moved on one path only",
                        opt.kind
                    );
                }
                let norm = |x: &[f32], y: &[f32]| {
                    x.iter()
                        .zip(y)
                        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
                        .sum::<f64>()
                        .sqrt()
                };
                let (change, apart) = (norm(f, b), norm(f, g));
                assert!(
                    change > 0.0,
                    "{:?}, rank {rank}, tensor {t}: nothing moved",
                    opt.kind
                );
                let tol = match opt.kind {
                    shardnet::optim::OptimizerKind::Sgd => 1e-5,
                    _ => 1e-4,
                };
                assert!(
                    apart <= tol * change,
                    "{:?}, rank {rank}, tensor {t}: the paths are {apart:e} apart after a change of {change:e}",
                    opt.kind
                );
            }
        }
    }
}
