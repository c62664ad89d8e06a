//! Pipeline schedules (`links::Pipeline`, `train mnist-mlp --schedule`):
//! every plan runs each pass once in an order that completes, holds no more
//! than its schedule promises and has the bubble of its formula; every
//! schedule, placement and rank count trains bit-identical parameters (the
//! weight gradients sum in the same order); a resume may change the
//! schedule; a rank that fails mid-schedule is an error on every rank, not
//! a hang.

mod common;
use candle_core::{DType, Device, Tensor};
use common::data_dir;
use shardnet::comm::launch_with_timeout;
use shardnet::links::{ChainLink, Costs, Pass, Pipeline, Plan, Schedule};
use shardnet::models::mnist_mlp::{Balance, Config};
use shardnet::nn::ParamStore;
use shardnet::train::{run, Options};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

fn plan(s: Schedule, p: usize, m: usize, v: usize) -> std::sync::Arc<Plan> {
    Plan::new(s, p, m, v, &Costs::uniform(p * v))
        .unwrap_or_else(|e| panic!("{s} p={p} M={m} V={v}: {e}"))
}

#[test]
fn every_plan_runs_each_pass_once_in_an_order_that_completes() {
    for s in Schedule::ALL {
        for p in 1..=5 {
            for m in 1..=17 {
                for v in 1..=3 {
                    let what = format!("{s} p={p} M={m} V={v}");
                    let plan = plan(s, p, m, v);
                    for (r, acts) in plan.actions.iter().enumerate() {
                        let passes: &[Pass] = if s.splits_backward() {
                            &[Pass::F, Pass::B, Pass::W]
                        } else {
                            &[Pass::F, Pass::B]
                        };
                        assert_eq!(acts.len(), passes.len() * m * v, "{what} rank {r}");
                        let set: HashSet<_> = acts.iter().collect();
                        assert_eq!(set.len(), acts.len(), "{what} rank {r}: a pass twice");
                        for (k, a) in acts.iter().enumerate() {
                            // B after its F, W after its B, on this rank.
                            let before = |pass| {
                                acts[..k].iter().any(|b| {
                                    b.pass == pass
                                        && b.chunk == a.chunk
                                        && b.micro_batch == a.micro_batch
                                })
                            };
                            match a.pass {
                                Pass::B => assert!(before(Pass::F), "{what}: {a:?}"),
                                Pass::W => assert!(before(Pass::B), "{what}: {a:?}"),
                                Pass::F => {}
                            }
                        }
                        // Each chunk's backwards in ascending micro-batch
                        // order: the same gradient sums under every schedule.
                        for c in 0..v {
                            let order: Vec<usize> = acts
                                .iter()
                                .filter(|a| a.pass == Pass::B && a.chunk == c)
                                .map(|a| a.micro_batch)
                                .collect();
                            assert!(order.windows(2).all(|w| w[0] < w[1]), "{what}: {order:?}");
                        }
                        let peak = plan.timeline.peak_held[r];
                        match (s, v) {
                            (Schedule::GPipe, _) => assert!(peak <= m * v, "{what}"),
                            (Schedule::OneFOneB, 1) => assert!(peak <= p - r, "{what}: {peak}"),
                            (Schedule::ZeroBubble, 1) => {
                                assert!(peak <= 2 * (p - r), "{what}: {peak}")
                            }
                            _ => assert!(peak <= m * v, "{what}"),
                        }
                    }
                    // What each rank sends another is what that one needs.
                    for src in 0..p {
                        for dst in 0..p {
                            let sent = plan.messages(src, dst);
                            let set: HashSet<_> = sent.iter().collect();
                            assert_eq!(set.len(), sent.len(), "{what}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bubbles_are_those_of_the_formulas() {
    let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() < 1e-9, "{what}: {a} vs {b}");
    for p in 1..=5usize {
        for m in 1..=16usize {
            let gpipe = (p - 1) as f64 / (m + p - 1) as f64;
            let what = format!("p={p} M={m}");
            close(
                plan(Schedule::GPipe, p, m, 1).timeline.bubble(),
                gpipe,
                &what,
            );
            close(
                plan(Schedule::OneFOneB, p, m, 1).timeline.bubble(),
                gpipe,
                &what,
            );
            let zb = plan(Schedule::ZeroBubble, p, m, 1).timeline.bubble();
            assert!(
                zb <= gpipe + 1e-9,
                "{what}: zero-bubble {zb} > 1F1B {gpipe}"
            );
            if m >= 2 * p && p > 1 {
                assert!(
                    zb < gpipe,
                    "{what}: zero-bubble {zb} not below 1F1B {gpipe}"
                );
            }
            for v in 2..=3usize {
                // Megatron's interleaved schedule: (p−1)/(V·M + p − 1) with
                // chunks of 1/V the work, where M is a multiple of p.
                if m % p == 0 {
                    let mut c = Costs::uniform(p * v);
                    for x in c
                        .forward
                        .iter_mut()
                        .chain(&mut c.backward)
                        .chain(&mut c.weight)
                    {
                        *x /= v as f64;
                    }
                    let t = Plan::new(Schedule::Interleaved, p, m, v, &c)
                        .unwrap()
                        .timeline
                        .clone();
                    let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                    close(t.bubble(), want, &format!("{what} V={v}"));
                }
            }
        }
    }
}

/// `mnist-mlp` for 20 steps (U = 32, batch 100, 5 micro-batches, 9 stages)
/// on `ranks` ranks: rank 0's gathered parameters.
fn mlp(
    ranks: usize,
    schedule: Schedule,
    v: Option<usize>,
    balance: Balance,
) -> BTreeMap<String, Tensor> {
    let cfg = Config {
        units: 32,
        stages: Some(9),
        micro_batches: 5,
        schedule: Some(schedule),
        virtual_stages: v,
        balance,
        data: Some(data_dir()),
        train: Options {
            max_steps: Some(20),
            epochs: 1,
            evaluate: false,
            progress: false,
            ..Config::default().train
        },
        ..Config::default()
    };
    let what = format!("{ranks} ranks, {schedule}, V={v:?}, {balance:?}");
    launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .into_iter()
        .flatten()
        .next()
        .expect("rank 0 reports")
        .params
}

#[test]
fn every_schedule_and_placement_trains_bit_identical_parameters() {
    let one = mlp(1, Schedule::GPipe, None, Balance::Counts);
    // 9 stages: uneven over 2 and 4 ranks; 5 micro-batches: not a multiple
    // of the ranks (interleaving then takes the list scheduler's order).
    for ranks in 2..=4 {
        for s in Schedule::ALL {
            for balance in [Balance::Counts, Balance::Auto] {
                let v = (s == Schedule::Interleaved).then_some(2);
                let got = mlp(ranks, s, v, balance);
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    one.keys().collect::<Vec<_>>()
                );
                for (name, want) in &one {
                    let d = (&got[name] - want).unwrap().abs().unwrap();
                    let d = d.max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert_eq!(
                        d, 0.0,
                        "{ranks} ranks, {s}, {balance:?}: {name} differs by {d}"
                    );
                }
            }
        }
    }
    // The comparison would pass trivially if nothing trained.
    let init = {
        let store = ParamStore::new(&Device::Cpu, 0);
        store
            .linear("layer0", 0, 784, 32)
            .unwrap()
            .weight()
            .value()
            .clone()
    };
    let moved = (&one["layer0.weight"] - &init).unwrap().abs().unwrap();
    assert!(moved.max_all().unwrap().to_scalar::<f32>().unwrap() > 1e-3);
}

#[test]
fn a_resume_may_change_the_schedule() {
    let dir = std::env::temp_dir().join(format!("shardnet-pipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "train",
            "mnist-mlp",
            "--ranks",
            "2",
            "--units",
            "32",
            "--stages",
            "4",
            "--micro-batches",
            "4",
            "--batch-size",
            "200",
            "--max-steps",
            "12",
            "--epochs",
            "1",
            "--no-eval",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |args: Vec<String>| {
        let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (out, text) = common::shardnet(&a);
        assert!(out.status.success(), "{}:\n{text}", a.join(" "));
    };
    let file = |n: &str| dir.join(n).display().to_string();
    run(base(&[
        "--schedule",
        "gpipe",
        "--save-params",
        &file("straight.safetensors"),
    ]));
    for s in ["1f1b", "interleaved", "zero-bubble"] {
        let ck = file(&format!("ck-{s}"));
        run(base(&[
            "--schedule",
            "gpipe",
            "--checkpoint-dir",
            &ck,
            "--stop-after",
            "6",
        ]));
        run(base(&[
            "--schedule",
            s,
            "--checkpoint-dir",
            &ck,
            "--resume",
            &ck,
            "--save-params",
            &file(&format!("{s}.safetensors")),
        ]));
        let a = candle_core::safetensors::load(file("straight.safetensors"), &Device::Cpu).unwrap();
        let b = candle_core::safetensors::load(file(&format!("{s}.safetensors")), &Device::Cpu)
            .unwrap();
        assert_eq!(a.len(), b.len());
        for (name, x) in &a {
            let d = (x - &b[name]).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(
                d.to_scalar::<f32>().unwrap(),
                0.0,
                "resumed under {s}: {name}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chunk that fails at its `fail_at`-th forward on rank `bad`.
struct Failing {
    calls: std::cell::Cell<usize>,
    fail: Option<usize>,
}

impl ChainLink for Failing {
    fn forward(&self, xs: &[Tensor]) -> shardnet::Result<Tensor> {
        let n = self.calls.get();
        self.calls.set(n + 1);
        if self.fail == Some(n) {
            return Err(shardnet::Error::Usage("chunk failed on purpose".into()));
        }
        Ok((&xs[0] * 2.0)?)
    }
}

#[test]
fn a_rank_that_fails_mid_schedule_is_an_error_on_every_rank() {
    for s in Schedule::ALL {
        for ranks in [2, 3] {
            let got = launch_with_timeout(ranks, Duration::from_secs(20), |comm| {
                let v = if s == Schedule::Interleaved { 2 } else { 1 };
                let fail = (comm.rank() == 1).then_some(3);
                let chunks: Vec<Box<dyn ChainLink>> = (0..v)
                    .map(|_| {
                        Box::new(Failing {
                            calls: Default::default(),
                            fail,
                        }) as Box<dyn ChainLink>
                    })
                    .collect();
                let pipe = Pipeline::new(&comm, s, chunks)?;
                let xs: Vec<Tensor> = (0..6)
                    .map(|_| Tensor::ones((2, 3), DType::F32, comm.device()))
                    .collect::<candle_core::Result<_>>()?;
                let inputs = (comm.rank() == 0).then_some(xs.as_slice());
                pipe.step(inputs, 6, &mut |_, y| Ok(y.sum_all()?))?;
                Ok(())
            });
            let e = got
                .expect_err("a failed rank must fail the launch")
                .to_string();
            assert!(
                e.contains("chunk failed on purpose") || e.contains("rank 1"),
                "{s}: {e}"
            );
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_schedule_are_told_so() {
    let got = launch_with_timeout(2, Duration::from_secs(20), |comm| {
        let s = if comm.rank() == 0 {
            Schedule::GPipe
        } else {
            Schedule::OneFOneB
        };
        let chunk = |xs: &[Tensor]| Ok(xs[0].clone());
        let pipe = Pipeline::new(&comm, s, vec![Box::new(chunk) as Box<dyn ChainLink>])?;
        let xs = vec![Tensor::ones((2, 3), DType::F32, comm.device())?; 2];
        pipe.step(
            (comm.rank() == 0).then_some(xs.as_slice()),
            2,
            &mut |_, y| Ok(y.sum_all()?),
        )?;
        Ok(())
    });
    let e = got.unwrap_err().to_string();
    assert!(
        e.contains("schedule: gpipe on rank(s) [0], 1f1b on rank(s) [1]"),
        "{e}"
    );
}

#[test]
fn the_memory_plan_knows_each_schedule() {
    use shardnet::train::plan::MemoryEstimate;
    // The wide MLP on 2 ranks, 8 micro-batches: what rank r holds at once.
    let act = |s: Schedule, r: usize| {
        let cfg = Config {
            units: 4096,
            stages: Some(5),
            batch_size: 3200,
            micro_batches: 8,
            schedule: Some(s),
            train: Options {
                evaluate: false,
                ..Config::default().train
            },
            ..Config::default()
        };
        cfg.rank(2, r).activations
    };
    for r in 0..2 {
        let gpipe = act(Schedule::GPipe, r);
        // Each holds its micro-batches' activations, H under GPipe (all 8),
        // H (p − r) / 8 under 1F1B and 2 H (p − r) / 8 under zero-bubble,
        // plus one backward's dL/dy and dL/dx at its widest layer, t, the
        // same under every schedule (a micro-batch's, less than it holds).
        let one_f_one_b = act(Schedule::OneFOneB, r);
        let h = (gpipe - one_f_one_b) / (1.0 - (2 - r) as f64 / 8.0);
        let t = gpipe - h;
        assert!(t > 0.0 && t < h / 8.0, "rank {r}: H {h}, t {t}");
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        assert!(
            close(
                act(Schedule::ZeroBubble, r),
                h * (4 - 2 * r) as f64 / 8.0 + t
            ),
            "rank {r}"
        );
        assert!(act(Schedule::Interleaved, r) < gpipe, "rank {r}");
    }
}
