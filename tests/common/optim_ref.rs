//! The optimizers against their definitions in f64, step by step: SGD
//! (momentum, weight decay) and Adam (any β, ε, weight decay), in the
//! three forms a parameter is stepped in — whole-tensor (`step`), row by
//! row inside backward (`fuse`: on host slices on the CPU kernels, in
//! candle's ops on the generic path) and with the state sharded over
//! data-parallel replicas (`shard_state` + `sharded_step`).
//! Shared by `tests/optim.rs` (CPU kernels) and `tests/generic.rs` (the
//! generic path).
//!
//! **The measure.** Each element's distance from the f64 trajectory,
//! divided by that trajectory's path length Σₜ |θₜ − θₜ₋₁| (what the steps
//! moved it). θ0 is drawn at the scale of one step and every gradient
//! keeps its sign over the steps, so nothing cancels: the f32 rounding of
//! a correct update is a few ulps of the path (≤ 8e-7 after six steps),
//! and [`TOL`] = 2e-6 fails a systematic error of 1e-5 of the step (the
//! old kernel's 1 − β2 rounded in f32 made 6.4e-6 at the default β).

use super::uniform;
use candle_core::{Device, Tensor};
use shardnet::comm::{launch_with_timeout, ReduceOp};
use shardnet::functions::Rows;
use shardnet::nn::Param;
use shardnet::optim::{sharded_step, Adam, Optimizer, Sgd};
use std::time::Duration;

/// The largest error allowed, relative to each element's path length.
pub const TOL: f64 = 2e-6;

/// An optimizer and its settings, as f64 (PyTorch's Python floats).
#[derive(Clone, Copy, Debug)]
pub enum Settings {
    /// `torch.optim.SGD(lr, momentum, weight_decay)`.
    Sgd { lr: f64, momentum: f64, decay: f64 },
    /// `torch.optim.Adam(lr, betas, eps, weight_decay)`, or `AdamW` when
    /// `decoupled`.
    Adam {
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        decay: f64,
        decoupled: bool,
    },
}

impl Settings {
    /// Our optimizer with exactly these settings.
    pub fn optimizer(&self, params: Vec<Param>) -> Optimizer {
        match *self {
            Settings::Sgd {
                lr,
                momentum,
                decay,
            } => Optimizer::Sgd(Sgd::new(params, lr, momentum, decay).expect("sgd")),
            Settings::Adam {
                lr,
                betas,
                eps,
                decay,
                decoupled,
            } => {
                let mut a = Adam::new(params, lr).expect("adam");
                a.betas = betas;
                a.eps = eps;
                a.weight_decay = decay;
                a.decoupled = decoupled;
                Optimizer::Adam(a)
            }
        }
    }

    /// θ after each gradient of `grads`, by the definition in f64.
    pub fn reference(&self, theta0: &[f32], grads: &[Vec<f32>]) -> Vec<Vec<f64>> {
        let n = theta0.len();
        let mut theta: Vec<f64> = theta0.iter().map(|&v| f64::from(v)).collect();
        let (mut a, mut b) = (vec![0f64; n], vec![0f64; n]);
        let mut out = Vec::new();
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..n {
                match *self {
                    Settings::Sgd {
                        lr,
                        momentum,
                        decay,
                    } => {
                        let d = f64::from(g[i]) + decay * theta[i];
                        let d = if momentum > 0.0 {
                            a[i] = if t == 1 { d } else { momentum * a[i] + d };
                            a[i]
                        } else {
                            d
                        };
                        theta[i] -= lr * d;
                    }
                    Settings::Adam {
                        lr,
                        betas: (b1, b2),
                        eps,
                        decay,
                        decoupled,
                    } => {
                        let d = if decoupled {
                            theta[i] *= 1.0 - lr * decay;
                            f64::from(g[i])
                        } else {
                            f64::from(g[i]) + decay * theta[i]
                        };
                        a[i] = b1 * a[i] + (1.0 - b1) * d;
                        b[i] = b2 * b[i] + (1.0 - b2) * d * d;
                        let m_hat = a[i] / (1.0 - b1.powi(t));
                        let v_hat = b[i] / (1.0 - b2.powi(t));
                        theta[i] -= lr * m_hat / (v_hat.sqrt() + eps);
                    }
                }
            }
            out.push(theta.clone());
        }
        out
    }
}

/// How the parameter is stepped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `Optimizer::step` on the whole tensor.
    Whole,
    /// `Optimizer::fuse`: rows updated inside backward (rows 0..r/2 as a
    /// range, the rest as a list), the gradient scaled by 8 and unscaled.
    Rows,
    /// `shard_state` over this many thread ranks, `sharded_step` (rank 0
    /// holds the gradient, the others zeros: the sum is exact).
    Sharded(usize),
}

/// One check: a `rows` × `cols` parameter, `steps` gradients from `seed`.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub settings: Settings,
    pub form: Form,
    pub rows: usize,
    pub cols: usize,
    pub steps: usize,
    pub seed: u64,
}

/// θ0 at the scale of one step of each element, and `steps` gradients that keep each
/// element's sign, of a magnitude in 10^[-3, 3) drawn per element.
pub fn inputs(case: &Case) -> (Vec<f32>, Vec<Vec<f32>>) {
    let n = case.rows * case.cols;
    let signs = uniform(case.seed ^ 1, n);
    // Adam's θ reaches lr·(steps + 1): its weight decay λθ stays under a
    // hundredth of the gradient, so g + λθ never cancels (where it does,
    // Adam's step g/(|g| + ε) takes g's rounding at full weight).
    let floor = match case.settings {
        Settings::Adam {
            lr,
            decay,
            decoupled: false,
            ..
        } => 200.0 * decay * lr * (case.steps + 1) as f64,
        Settings::Adam { .. } => 0.0,
        Settings::Sgd { .. } => 0.0,
    };
    let scales: Vec<f64> = uniform(case.seed ^ 2, n)
        .iter()
        .map(|u| 10f64.powf(6.0 * u - 3.0).max(floor))
        .collect();
    // One step moves an element by about lr (Adam) or lr·|g| (SGD).
    let step = |i: usize| match case.settings {
        Settings::Adam { lr, .. } => lr,
        Settings::Sgd { lr, .. } => lr * scales[i],
    };
    let theta0 = uniform(case.seed, n)
        .iter()
        .enumerate()
        .map(|(i, u)| (step(i) * (2.0 * u - 1.0)) as f32)
        .collect();
    let grads = (0..case.steps)
        .map(|t| {
            let u = uniform(case.seed ^ (3 + t as u64), n);
            (0..n)
                .map(|i| {
                    let sign = if signs[i] < 0.5 { -1.0 } else { 1.0 };
                    (sign * scales[i] * (0.5 + u[i])) as f32
                })
                .collect()
        })
        .collect();
    (theta0, grads)
}

/// Our optimizer's θ after the case's steps.
pub fn run(case: &Case, theta0: &[f32], grads: &[Vec<f32>]) -> Vec<f32> {
    let shape = (case.rows, case.cols);
    let tensor = |v: &[f32]| Tensor::from_slice(v, shape, &Device::Cpu).expect("tensor");
    match case.form {
        Form::Whole | Form::Rows => {
            let p = Param::new("w", &tensor(theta0)).expect("param");
            let mut opt = case.settings.optimizer(vec![p.clone()]);
            if case.form == Form::Rows {
                opt.fuse(&p).expect("fuse");
            }
            for g in grads {
                match p.fused() {
                    Some(update) => {
                        opt.prepare_fused(1.0 / 8.0);
                        let g: Vec<f32> = g.iter().map(|v| v * 8.0).collect();
                        let (d, half) = (case.cols, case.rows / 2);
                        let rest: Vec<u32> = (half as u32..case.rows as u32).collect();
                        if shardnet::kernels::fast(&Device::Cpu) {
                            let mut w = p.value().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                            update
                                .update_rows(Rows::Range(0..half), &mut w, &g[..half * d], d)
                                .expect("rows");
                            update
                                .update_rows(Rows::List(&rest), &mut w, &g[half * d..], d)
                                .expect("rows");
                            p.var().set(&tensor(&w)).unwrap();
                        } else {
                            // The generic path's row update, in candle's ops.
                            let part = |from: usize, to: usize| {
                                Tensor::from_slice(
                                    &g[from * d..to * d],
                                    (to - from, d),
                                    &Device::Cpu,
                                )
                                .expect("rows")
                            };
                            update
                                .update_rows_on_device(
                                    Rows::Range(0..half),
                                    p.value(),
                                    &part(0, half),
                                )
                                .expect("rows");
                            update
                                .update_rows_on_device(
                                    Rows::List(&rest),
                                    p.value(),
                                    &part(half, case.rows),
                                )
                                .expect("rows");
                        }
                    }
                    None => p.set_grad(&tensor(g)).expect("grad"),
                }
                opt.step().expect("step");
            }
            p.value().flatten_all().unwrap().to_vec1().unwrap()
        }
        Form::Sharded(ranks) => {
            let (settings, theta0, grads) = (case.settings, theta0.to_vec(), grads.to_vec());
            let out = launch_with_timeout(ranks, Duration::from_secs(30), move |comm| {
                let p = Param::new("w", &tensor(&theta0))?;
                let mut opt = settings.optimizer(vec![p.clone()]);
                opt.shard_state(comm.size(), comm.rank())?;
                for g in &grads {
                    let g = if comm.rank() == 0 {
                        tensor(g)
                    } else {
                        tensor(g).zeros_like()?
                    };
                    p.set_grad(&g)?;
                    sharded_step(&comm, &mut opt, ReduceOp::Sum)?;
                }
                Ok(p.value().flatten_all()?.to_vec1::<f32>()?)
            })
            .expect("sharded run");
            for (r, o) in out.iter().enumerate() {
                assert_eq!(o, &out[0], "rank {r} holds other parameters");
            }
            out[0].clone()
        }
    }
}

/// The largest error of `got` against the reference trajectory, relative
/// to each element's path length; with the element it was found at.
pub fn worst_error(theta0: &[f32], reference: &[Vec<f64>], got: &[f32]) -> (f64, usize) {
    let mut worst = (0.0, 0);
    for i in 0..got.len() {
        let mut prev = f64::from(theta0[i]);
        let mut path = 0.0;
        for r in reference {
            path += (r[i] - prev).abs();
            prev = r[i];
        }
        let err = (f64::from(got[i]) - prev).abs() / path.max(f64::MIN_POSITIVE);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    worst
}

/// `Err` naming the case and the worst element where the error passes
/// [`TOL`].
pub fn check(case: &Case) -> Result<(), String> {
    let (theta0, grads) = inputs(case);
    let reference = case.settings.reference(&theta0, &grads);
    let got = run(case, &theta0, &grads);
    let (err, i) = worst_error(&theta0, &reference, &got);
    if err > TOL {
        let want = reference.last().map_or(0.0, |r| r[i]);
        return Err(format!(
            "{case:?}: element {i} is {} where the f64 definition gives {want} \
             ({err:.2e} of its path, more than {TOL:e})",
            got[i]
        ));
    }
    Ok(())
}

/// The settings every run checks: PyTorch's defaults (where the old f32
/// 1 − β2 showed), Adam with L2 and with decoupled decay (AdamW), and SGD
/// with and without momentum.
pub fn fixed_settings() -> Vec<Settings> {
    vec![
        Settings::Adam {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            decay: 0.0,
            decoupled: false,
        },
        Settings::Adam {
            lr: 0.1,
            betas: (0.9, 0.999),
            eps: 1e-8,
            decay: 1e-2,
            decoupled: false,
        },
        // AdamW with a decay strong enough that θ's shrinking shows.
        Settings::Adam {
            lr: 0.1,
            betas: (0.9, 0.999),
            eps: 1e-8,
            decay: 0.5,
            decoupled: true,
        },
        Settings::Sgd {
            lr: 0.1,
            momentum: 0.9,
            decay: 5e-4,
        },
        Settings::Sgd {
            lr: 0.01,
            momentum: 0.0,
            decay: 0.0,
        },
    ]
}
