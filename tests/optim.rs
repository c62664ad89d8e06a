//! The optimizers against values PyTorch produced
//! (`tests/fixtures/torch_optim.json`, written by
//! `tests/fixtures/torch_optim.py`): `torch.optim.SGD` with and without
//! momentum and weight decay, `torch.optim.Adam` with and without weight
//! decay, five steps each, on the dense step and on the fused row update
//! (whole rows, a subset of rows, a loss-scaled gradient); and against
//! their f64 definitions over random settings and shapes, in every form
//! (`tests/common/optim_ref.rs`, which states the tolerance).

mod common;
use candle_core::{Device, Tensor};
use common::{max_rel, optimizer_of, torch_optim_fixture};
use shardnet::functions::{RowUpdate, Rows};
use shardnet::nn::Param;

/// f32 updates: every value within 1e-6 of PyTorch's, relative to
/// max(1, |value|) (a few ulps after five steps).
const TOL: f64 = 1e-6;

fn param(theta0: &[f32], shape: &[usize]) -> Param {
    Param::new(
        "w",
        &Tensor::from_slice(theta0, shape, &Device::Cpu).unwrap(),
    )
    .unwrap()
}

fn values(p: &Param) -> Vec<f32> {
    p.value().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `update` applied to rows `rows` of `p` from their gradient `g` ((rows,
/// d) row-major, in the order of `rows`), as this process's kernel path
/// calls it: on host slices on the CPU kernels, in candle's ops on the
/// generic path.
fn update_rows(
    update: &dyn RowUpdate,
    rows: Rows<'_>,
    p: &Param,
    g: &[f32],
    d: usize,
) -> shardnet::Result<()> {
    if shardnet::kernels::fast(&Device::Cpu) {
        let mut w = values(p);
        update.update_rows(rows, &mut w, g, d)?;
        p.var()
            .set(&Tensor::from_vec(w, p.value().shape(), &Device::Cpu)?)?;
        Ok(())
    } else {
        let g = Tensor::from_slice(g, (g.len() / d, d), &Device::Cpu)?;
        update.update_rows_on_device(rows, p.value(), &g)
    }
}

#[test]
fn dense_steps_equal_pytorch() {
    let (theta0, shape, grads, cases) = torch_optim_fixture();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let p = param(&theta0, &shape);
        let mut opt = optimizer_of(case, vec![p.clone()]);
        for (k, (g, want)) in grads.iter().zip(&case.after_each_step).enumerate() {
            p.set_grad(&Tensor::from_slice(g, shape.as_slice(), &Device::Cpu).unwrap())
                .unwrap();
            opt.step().unwrap();
            let err = max_rel(&values(&p), want);
            assert!(
                err < TOL,
                "{} step {}: {err:e} from PyTorch",
                case.name,
                k + 1
            );
        }
        assert_eq!(opt.steps(), 5);
    }
}

/// The fused row update, on this process's kernel path, against PyTorch:
/// every row in two calls (a range and a list), a subset of the rows (the
/// others keep θ0 bit for bit), a loss-scaled gradient.
#[test]
fn fused_row_updates_equal_pytorch_and_leave_other_rows_alone() {
    let (theta0, shape, grads, cases) = torch_optim_fixture();
    let (rows, d) = (shape[0], shape[1]);
    for case in &cases {
        // All rows in two calls (a range and a list); then only rows 1 and 3
        // (lazy: rows 0 and 2 keep θ0, and their state stays untouched);
        // then all rows with a gradient scaled by 8 and unscale 1/8.
        for variant in ["all", "subset", "scaled"] {
            let p = param(&theta0, &shape);
            let mut opt = optimizer_of(case, vec![p.clone()]);
            opt.fuse(&p).unwrap();
            let update = p.fused().expect("fused update set");
            for g in &grads {
                let scale = if variant == "scaled" { 8.0 } else { 1.0 };
                opt.prepare_fused(1.0 / scale);
                let g: Vec<f32> = g.iter().map(|v| v * scale as f32).collect();
                let pick = |r: &[usize]| -> Vec<f32> {
                    r.iter()
                        .flat_map(|&r| g[r * d..(r + 1) * d].to_vec())
                        .collect()
                };
                if variant == "subset" {
                    update_rows(&*update, Rows::List(&[1, 3]), &p, &pick(&[1, 3]), d).unwrap();
                } else {
                    update_rows(&*update, Rows::Range(0..2), &p, &g[..2 * d], d).unwrap();
                    update_rows(&*update, Rows::List(&[2, 3]), &p, &pick(&[2, 3]), d).unwrap();
                }
                // The step skips the fused parameter (no gradient, no warning).
                opt.step().unwrap();
            }
            let got = values(&p);
            let want = case.after_each_step.last().unwrap();
            for r in 0..rows {
                let span = r * d..(r + 1) * d;
                if variant == "subset" && r % 2 == 0 {
                    assert_eq!(
                        got[span.clone()],
                        theta0[span],
                        "{} row {r} moved",
                        case.name
                    );
                    continue;
                }
                let err = max_rel(&got[span.clone()], &want[span]);
                assert!(err < TOL, "{} {variant} row {r}: {err:e}", case.name);
            }
        }
    }
}

#[test]
fn a_fused_update_outside_a_step_is_an_error() {
    let (theta0, shape, grads, cases) = torch_optim_fixture();
    let p = param(&theta0, &shape);
    let mut opt = optimizer_of(&cases[0], vec![p.clone()]);
    opt.fuse(&p).unwrap();
    let update = p.fused().unwrap();
    let d = shape[1];
    let err = update_rows(&*update, Rows::Range(0..4), &p, &grads[0], d).unwrap_err();
    assert!(err.to_string().contains("prepare_fused"), "{err}");
    opt.prepare_fused(1.0);
    update_rows(&*update, Rows::Range(0..4), &p, &grads[0], d).unwrap();
    opt.step().unwrap();
    // Disarmed again by the step.
    assert!(update_rows(&*update, Rows::Range(0..4), &p, &grads[0], d).is_err());
    // A row outside the weight is an error, not a panic.
    opt.prepare_fused(1.0);
    assert!(update_rows(&*update, Rows::List(&[7]), &p, &grads[0][..d], d).is_err());
}

#[test]
fn bad_optimizer_settings_are_refused() {
    use shardnet::optim::{Optimizer, OptimizerConfig};
    let p = param(&[1.0], &[1]);
    for (momentum, decay, what) in [
        (1.0, 0.0, "--momentum"),
        (-0.1, 0.0, "--momentum"),
        (0.9, -1e-4, "--weight-decay"),
        (0.9, f64::NAN, "--weight-decay"),
    ] {
        let cfg = OptimizerConfig {
            momentum,
            weight_decay: decay,
            ..OptimizerConfig::sgd()
        };
        let err = Optimizer::new(&cfg, vec![p.clone()], 0.1).err().unwrap();
        assert!(err.to_string().contains(what), "{err}");
    }
}

/// A parameter listed twice in `allreduce_grads` (every gradient buffer is
/// borrowed at once) is an error naming it, on every rank, not a wait on
/// itself.
#[test]
fn allreduce_grads_refuses_a_parameter_listed_twice() {
    use shardnet::nn::Param;
    use shardnet::optim::allreduce_grads;
    use shardnet::ReduceOp;
    let out = shardnet::comm::launch_with_timeout(2, std::time::Duration::from_secs(20), |comm| {
        let p = Param::new(
            "w",
            &candle_core::Tensor::ones(3, candle_core::DType::F32, &candle_core::Device::Cpu)?,
        )?;
        p.set_grad(&candle_core::Tensor::ones(
            3,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?)?;
        let err = allreduce_grads(&comm, &[p.clone(), p], ReduceOp::Sum)
            .expect_err("a parameter listed twice was accepted");
        Ok(err.to_string())
    })
    .unwrap();
    for e in out {
        assert!(e.contains("w is listed twice"), "{e}");
    }
}

/// The data-parallel step with the state sharded over the replicas gives
/// the plain step's parameters and state, bit for bit, on 1–4 ranks
/// (`tests/common/sharded_step.rs`; the generic path runs the same cases
/// in `tests/generic.rs`).
#[test]
fn a_sharded_state_steps_as_the_plain_one() {
    for case in common::sharded_step::cases() {
        if let Err(e) = common::sharded_step::check(&case) {
            panic!("{case:?}:\n{e}");
        }
    }
}

mod sharded_shapes {
    use super::common::sharded_step::{check, Case};
    use proptest::prelude::*;
    use shardnet::optim::{OptimizerConfig, OptimizerKind};
    use shardnet::ReduceOp;

    fn param() -> impl Strategy<Value = (Vec<usize>, Option<usize>)> {
        (
            proptest::collection::vec(1usize..6, 0..3),
            1usize..10,
            0usize..3,
        )
            .prop_map(|(rest, rows, d)| {
                let mut shape = vec![rows];
                shape.extend(rest);
                let dim = match d {
                    0 => None,
                    _ => Some((d - 1).min(shape.len() - 1)),
                };
                (shape, dim)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Random shapes (rows 1–9, so fewer rows than ranks too), shards
        /// along dimensions 0 and 1, each optimizer, sums and means.
        #[test]
        fn random_shapes_step_as_the_plain_step(
            ranks in 1usize..5,
            params in proptest::collection::vec(param(), 1..5),
            which in 0usize..3,
            mean in any::<bool>(),
            steps in 1usize..4,
            seed in any::<u64>(),
        ) {
            let optimizer = OptimizerConfig {
                kind: if which == 0 { OptimizerKind::Adam } else { OptimizerKind::Sgd },
                momentum: if which == 1 { 0.9 } else { 0.0 },
                weight_decay: 0.01,
            };
            let op = if mean { ReduceOp::Mean } else { ReduceOp::Sum };
            let case = Case { ranks, params, optimizer, op, steps, seed };
            if let Err(e) = check(&case) {
                prop_assert!(false, "{case:?}:\n{e}");
            }
        }
    }
}

/// Sharding the state after a step, or over a group the step's
/// communicator is not, is an error naming what to do; on every rank.
#[test]
fn a_sharded_state_refuses_misuse() {
    use shardnet::optim::{sharded_step, Adam, Optimizer};
    use shardnet::ReduceOp;
    let out = shardnet::comm::launch_with_timeout(2, std::time::Duration::from_secs(20), |comm| {
        let p = Param::new(
            "w",
            &Tensor::ones((4, 2), candle_core::DType::F32, &Device::Cpu)?,
        )?;
        let mut late = Optimizer::Adam(Adam::new(vec![p.clone()], 0.1)?);
        p.set_grad(&Tensor::ones(
            (4, 2),
            candle_core::DType::F32,
            &Device::Cpu,
        )?)?;
        late.step()?;
        let after_a_step = late
            .shard_state(2, comm.rank())
            .expect_err("sharded after a step");
        // Both ranks claim rank 0's rows.
        let mut wrong = Optimizer::Adam(Adam::new(vec![p.clone()], 0.1)?);
        wrong.shard_state(2, 0)?;
        p.set_grad(&Tensor::ones(
            (4, 2),
            candle_core::DType::F32,
            &Device::Cpu,
        )?)?;
        let mismatch = sharded_step(&comm, &mut wrong, ReduceOp::Sum).map(|_| ());
        // A sharded state cannot be fused into backward afterwards.
        let fused = wrong.fuse(&p).expect_err("fused after sharding");
        Ok((
            after_a_step.to_string(),
            mismatch.err().map(|e| e.to_string()),
            fused.to_string(),
        ))
    })
    .unwrap();
    for (r, (late, mismatch, fused)) in out.iter().enumerate() {
        assert!(late.contains("before the first step"), "{late}");
        assert!(
            fused.contains("w's state is sharded over replicas"),
            "{fused}"
        );
        if r == 1 {
            let m = mismatch.as_deref().unwrap_or("");
            assert!(m.contains("call shard_state(2, 1)"), "{m}");
        }
    }
}

/// PyTorch's default Adam, Adam with L2 and with decoupled weight decay
/// (AdamW), SGD with and without
/// momentum: the f64 definition to 2e-6 of each element's path, stepped
/// whole, row by row inside backward, and with the state sharded over 2
/// and 3 replicas (uneven rows).
#[test]
fn each_optimizer_equals_its_f64_definition_in_every_form() {
    use common::optim_ref::{check, fixed_settings, Case, Form};
    for settings in fixed_settings() {
        for form in [Form::Whole, Form::Rows, Form::Sharded(2), Form::Sharded(3)] {
            let case = Case {
                settings,
                form,
                rows: 7,
                cols: 9,
                steps: 6,
                seed: 11,
            };
            if let Err(e) = check(&case) {
                panic!("{e}");
            }
        }
    }
}

mod definitions {
    use super::common::optim_ref::{check, Case, Form, Settings};
    use proptest::prelude::*;

    fn settings() -> impl Strategy<Value = Settings> {
        prop_oneof![
            (
                1e-4f64..1.0,
                0.0f64..0.99,
                prop_oneof![Just(0.0), 1e-5f64..1e-2]
            )
                .prop_map(|(lr, momentum, decay)| Settings::Sgd {
                    lr,
                    momentum,
                    decay
                }),
            (
                1e-4f64..1.0,
                0.5f64..0.99,
                0.9f64..0.99999,
                prop_oneof![Just(1e-8), Just(1e-6)],
                prop_oneof![Just(0.0), 1e-5f64..1e-2],
                any::<bool>(),
            )
                .prop_map(|(lr, b1, b2, eps, decay, decoupled)| Settings::Adam {
                    lr,
                    betas: (b1, b2),
                    eps,
                    decay: if decoupled { decay * 50.0 } else { decay },
                    decoupled,
                }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
        /// Random settings, shapes (1–8 rows, 1–40 columns, vector tails
        /// included), 1–6 steps and forms.
        #[test]
        fn random_settings_equal_the_f64_definition(
            settings in settings(),
            rows in 1usize..9,
            cols in 1usize..41,
            steps in 1usize..7,
            form in 0usize..4,
            seed in any::<u64>(),
        ) {
            let form = match form {
                0 => Form::Whole,
                1 => Form::Rows,
                f => Form::Sharded(f),
            };
            let case = Case { settings, form, rows, cols, steps, seed };
            if let Err(e) = check(&case) {
                prop_assert!(false, "{e}");
            }
        }
    }
}
