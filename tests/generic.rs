//! The device-generic path (what a GPU runs), forced on the CPU: the
//! exactness suites again, with every custom op in candle's tensor ops
//! (`SHARDNET_KERNELS=generic`, set here through `kernels::set_kernels` so
//! the process environment is left alone).

mod common;
use candle_core::{Tensor, Var};
use shardnet::kernels::{set_kernels, Kernels};
use shardnet::nn::{Linear, Param};
use shardnet::optim::Adam;
use shardnet_conformance::run_local;
use std::time::Duration;

fn generic() {
    set_kernels(Kernels::Generic);
}

#[test]
fn autograd_suite_on_the_generic_path() {
    generic();
    let failures = run_local(
        shardnet_conformance::autograd::cases,
        4,
        Duration::from_secs(20),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sharded_head_suite_on_the_generic_path() {
    generic();
    let failures = run_local(
        shardnet_conformance::head::cases,
        4,
        Duration::from_secs(20),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn tensor_parallel_suite_on_the_generic_path() {
    generic();
    let failures = run_local(
        shardnet_conformance::tensor_parallel::cases,
        4,
        Duration::from_secs(20),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn chains_on_the_generic_path() {
    generic();
    let failures = run_local(
        shardnet_conformance::chains::cases,
        4,
        Duration::from_secs(20),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn channel_parallel_suite_on_the_generic_path() {
    generic();
    let failures = run_local(
        shardnet_conformance::channel_parallel::cases,
        4,
        Duration::from_secs(20),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn vgg16_output_split_on_the_generic_path_gives_one_ranks_gradients() {
    generic();
    use shardnet::links::ChannelSplit;
    let one = common::vgg16_first_gradients(ChannelSplit::None, 1, 1);
    for (split, ranks) in [(ChannelSplit::Output, 2), (ChannelSplit::Input, 3)] {
        let (e, at) = common::worst(&common::vgg16_first_gradients(split, ranks, 1), &one);
        assert!(
            e <= 1e-5,
            "{split} on {ranks} ranks: d{at} differs by {e:e}"
        );
    }
}

fn max_rel(got: &Tensor, want: &Tensor) -> f64 {
    shardnet_conformance::max_rel(got, want).unwrap()
}

/// `functions::backward_from` on the generic path: y's gradient g, none
/// for g.
#[test]
fn backward_from_on_the_generic_path() {
    generic();
    let dev = &shardnet::comm::HOST;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (3, 50), dev).unwrap()).unwrap();
    let g = Var::from_tensor(&Tensor::randn(0f32, 1., (3, 50), dev).unwrap()).unwrap();
    let y = (x.as_tensor() * 2.0).unwrap();
    let grads = shardnet::functions::backward_from(&y, g.as_tensor()).unwrap();
    let twice_g = (g.as_tensor() * 2.0).unwrap();
    assert!(max_rel(grads.get(&x).unwrap(), &twice_g) == 0.0);
    assert!(grads.get(&g).is_none());
}

#[test]
fn linear_and_adam_on_the_generic_path() {
    generic();
    let dev = &shardnet::comm::HOST;
    let seq = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
    let x = Tensor::from_vec(seq(12, 0.37), (3, 4), dev).unwrap();
    let w0 = Tensor::from_vec(seq(20, 0.71), (5, 4), dev).unwrap();
    let b0 = Tensor::from_vec(seq(5, 1.3), 5, dev).unwrap();
    let (w, b) = (Param::new("w", &w0).unwrap(), Param::new("b", &b0).unwrap());
    let y = Linear::new(w.clone(), Some(b.clone())).forward(&x).unwrap();
    let mut grads = y.tanh().unwrap().sum_all().unwrap().backward().unwrap();
    // The generic path delivers the gradients in backward, as the kernel
    // does: nothing is left in candle's GradStore to move by hand.
    assert!(w.grad().is_some() && b.grad().is_some());
    assert!(!w.absorb(&mut grads).unwrap() && !b.absorb(&mut grads).unwrap());

    let (wv, bv) = (
        Var::from_tensor(&w0).unwrap(),
        Var::from_tensor(&b0).unwrap(),
    );
    let y_ref = x
        .matmul(&wv.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(bv.as_tensor())
        .unwrap();
    let g = y_ref.tanh().unwrap().sum_all().unwrap().backward().unwrap();
    let (gw, gb) = (
        g.get(wv.as_tensor()).unwrap(),
        g.get(bv.as_tensor()).unwrap(),
    );
    assert!(max_rel(&y, &y_ref) < 1e-6);
    assert!(max_rel(w.grad().unwrap(), gw) < 1e-6);
    assert!(max_rel(b.grad().unwrap(), gb) < 1e-6);

    // Adam's first step: θ − lr · g / (|g| + ε).
    let lr = 0.01;
    let mut opt = Adam::new(vec![w.clone(), b.clone()], lr).unwrap();
    opt.step().unwrap();
    let want = |t0: &Tensor, g: &Tensor| {
        (t0 - ((g / (g.abs().unwrap() + 1e-8).unwrap()).unwrap() * lr).unwrap()).unwrap()
    };
    assert!(max_rel(w.value(), &want(&w0, gw)) < 1e-6);
    assert!(max_rel(b.value(), &want(&b0, gb)) < 1e-6);
    assert!(w.grad().is_none(), "the step consumes the gradient");
}

/// ChainerMN's model-parallel MLP, 20 steps on MNIST on the generic path
/// over `ranks` ranks (2 micro-batches): rank 0's parameters.
fn train_mlp(ranks: usize) -> std::collections::BTreeMap<String, Tensor> {
    use shardnet::models::mnist_mlp::Config;
    use shardnet::train::run;
    let data = common::data_dir();
    let mut cfg = Config {
        stages: Some(3),
        micro_batches: 2,
        data: Some(data),
        ..Config::default()
    };
    cfg.train.max_steps = Some(20);
    cfg.train.epochs = 1;
    cfg.train.evaluate = false;
    cfg.train.progress = false;
    let reports =
        shardnet::comm::launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg))
            .unwrap();
    reports.into_iter().flatten().next().unwrap().params
}

#[test]
fn mlp_training_on_the_generic_path_is_split_exactly_and_trains() {
    generic();
    let one = train_mlp(1);
    // Trained: far from the initialisation (the gradients reached Adam).
    let init = shardnet::nn::ParamStore::new(&shardnet::comm::HOST, 0)
        .linear("layer0", 0, 784, 100)
        .unwrap();
    assert!(max_rel(&one["layer0.weight"], init.weight().value()) > 1e-2);
    for ranks in [2, 3] {
        let split = train_mlp(ranks);
        for (name, want) in &one {
            let rel = max_rel(&split[name], want);
            assert!(rel <= 1e-5, "{ranks} ranks: {name} relative error {rel:e}");
        }
    }
}

/// Each optimizer in candle's ops equals PyTorch: stepped whole from the
/// accumulated gradient, and fused (the row update the sharded head's
/// backward calls on this path), over a range of rows then a list of the
/// others, with a gradient scaled by 8 and unscaled by 1/8.
#[test]
fn optimizers_on_the_generic_path_equal_pytorch() {
    use shardnet::functions::Rows;
    generic();
    let (theta0, shape, grads, cases) = common::torch_optim_fixture();
    let cpu = &candle_core::Device::Cpu;
    let (rows, d) = (shape[0], shape[1]);
    for case in &cases {
        for fused in [false, true] {
            let p = Param::new(
                "w",
                &Tensor::from_slice(&theta0, shape.as_slice(), cpu).unwrap(),
            )
            .unwrap();
            let mut opt = common::optimizer_of(case, vec![p.clone()]);
            if fused {
                opt.fuse(&p).unwrap();
            }
            for (k, (g, want)) in grads.iter().zip(&case.after_each_step).enumerate() {
                match p.fused() {
                    Some(update) => {
                        opt.prepare_fused(1.0 / 8.0);
                        let g: Vec<f32> = g.iter().map(|v| v * 8.0).collect();
                        let part = |from: usize, to: usize| {
                            Tensor::from_slice(&g[from * d..to * d], (to - from, d), cpu).unwrap()
                        };
                        let half = rows / 2;
                        let rest: Vec<u32> = (half as u32..rows as u32).collect();
                        update
                            .update_rows_on_device(Rows::Range(0..half), p.value(), &part(0, half))
                            .unwrap();
                        update
                            .update_rows_on_device(Rows::List(&rest), p.value(), &part(half, rows))
                            .unwrap();
                    }
                    None => p
                        .set_grad(&Tensor::from_slice(g, shape.as_slice(), cpu).unwrap())
                        .unwrap(),
                }
                opt.step().unwrap();
                let got = p.value().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let err = common::max_rel(&got, want);
                assert!(
                    err < 1e-6,
                    "{} (fused: {fused}) step {}: {err:e} from PyTorch",
                    case.name,
                    k + 1
                );
            }
        }
    }
}

mod props {
    //! The convolution property tests (`tests/conv_props.rs`) on the
    //! generic path: candle's conv2d, which used to fail backward with
    //! "shape mismatch in add" whenever (H + 2p − kh) mod s ≠
    //! (W + 2p − kw) mod s.
    use super::common::conv_ref::{check_channel_parallel, check_conv2d, geometry, FORMS};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        #[test]
        fn conv2d_equals_the_definition_on_the_generic_path(g in geometry(), seed in 0u64..1000) {
            super::generic();
            prop_assert_eq!(check_conv2d(&g, seed), Ok(()), "{:?}", g);
        }

        #[test]
        fn channel_parallel_forms_equal_the_definition_on_the_generic_path(
            g in geometry(),
            seed in 0u64..1000,
            ranks in 1usize..=4,
            form in 0usize..FORMS.len(),
        ) {
            super::generic();
            let form = FORMS[form];
            prop_assert_eq!(
                check_channel_parallel(&g, seed, ranks, form),
                Ok(()),
                "{:?} on {} ranks, {:?}", g, ranks, form
            );
        }
    }

    /// The cases the issue named, each once.
    #[test]
    fn strided_convolutions_with_unequal_remainders_run_backward() {
        super::generic();
        use super::common::conv_ref::Geometry;
        for (h, w, kh, kw, s, p) in [
            (11, 13, 5, 5, 3, 2),
            (10, 11, 3, 3, 3, 0),
            (7, 9, 2, 3, 2, 0),
        ] {
            let g = Geometry {
                n: 2,
                c: 3,
                h,
                w,
                o: 4,
                kh,
                kw,
                s,
                p,
            };
            assert_eq!(check_conv2d(&g, 7), Ok(()), "{g:?}");
        }
    }
}

/// The data-parallel step with the optimizer's state sharded over the
/// replicas, on the generic path: the plain step's parameters and state,
/// bit for bit (the same cases as `tests/optim.rs`).
#[test]
fn a_sharded_state_steps_as_the_plain_one_on_the_generic_path() {
    generic();
    for case in common::sharded_step::cases() {
        if let Err(e) = common::sharded_step::check(&case) {
            panic!("{case:?}:\n{e}");
        }
    }
}

/// Each optimizer on the generic path against its f64 definition: the
/// same settings and tolerance as `tests/optim.rs` (whole-tensor and
/// sharded-state forms; the row update is the CPU kernels' alone).
#[test]
fn each_optimizer_equals_its_f64_definition_on_the_generic_path() {
    use common::optim_ref::{check, fixed_settings, Case, Form};
    generic();
    for settings in fixed_settings() {
        for form in [Form::Whole, Form::Sharded(2), Form::Sharded(3)] {
            for (rows, cols, seed) in [(7, 9, 11), (1, 33, 12), (5, 1, 13)] {
                let case = Case {
                    settings,
                    form,
                    rows,
                    cols,
                    steps: 6,
                    seed,
                };
                if let Err(e) = check(&case) {
                    panic!("{e}");
                }
            }
        }
    }
}
