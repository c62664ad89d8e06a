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
