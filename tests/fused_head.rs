//! The fused head step (the optimizer applied inside backward, no gradient
//! of the shard held: class block by class block on the CPU kernels, the
//! rows taking part at once on the generic path) against the unfused one
//! (gradient accumulated, then the optimizer's step): the same weights
//! after 10 steps, for SGD and Adam, plain and ArcFace logits, on 1–3 ranks,
//! with more classes than one class block. Under Partial FC the fused step
//! is lazy (InsightFace's sampled momentum: rows outside the sample keep
//! their weights and their momentum); checked against that rule applied by
//! hand to the unfused gradient, and step by step for SGD, Adam and AdamW
//! (unsampled rows and their state unchanged bit for bit, sampled ones
//! against the f64 definition). Every test runs on the process's kernel
//! path: the CPU kernels, or the generic path under
//! `SHARDNET_KERNELS=generic`.

mod common;

use candle_core::{Device, Tensor};
use shardnet::comm::launch;
use shardnet::functions::Margin;
use shardnet::functions::CLASS_BLOCK;
use shardnet::links::ShardedClassifier;
use shardnet::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use shardnet::Result;

const B: usize = 24;
const D: usize = 16;
const STEPS: usize = 10;

fn features(step: usize) -> (Tensor, Vec<u32>, usize) {
    let classes = 2 * CLASS_BLOCK + 77;
    let x: Vec<f32> = (0..B * D)
        .map(|i| (((i + 31 * step) * 2654435761usize % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let labels = (0..B)
        .map(|i| ((i * 97 + step * 13) % classes) as u32)
        .collect();
    (
        Tensor::from_vec(x, (B, D), &Device::Cpu).unwrap(),
        labels,
        classes,
    )
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// This rank's head weights after STEPS steps.
fn train(
    comm: &shardnet::Communicator,
    opt: OptimizerConfig,
    margin: Margin,
    fused: bool,
    rate: f64,
) -> Result<Vec<f32>> {
    let classes = features(0).2;
    let mut head = ShardedClassifier::new(comm, classes, D, margin, 5)?;
    head.sample_rate = rate;
    let mut o = Optimizer::new(&opt, vec![head.weight.clone()], 0.05)?;
    if fused {
        o.fuse(&head.weight)?;
    }
    for step in 0..STEPS {
        let (x, labels, _) = features(step);
        head.set_step(step as u64);
        let lr = 0.05 * (1.0 - step as f64 / 20.0);
        o.set_lr(lr);
        o.prepare_fused(1.0);
        let out = head.forward(&x, &labels)?;
        out.loss.backward()?;
        assert_eq!(
            head.weight.grad().is_some(),
            !fused,
            "fused: no gradient held"
        );
        o.step()?;
    }
    Ok(values(head.weight.value()))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fused_equals_unfused_after_ten_steps() {
    let sgd = OptimizerConfig::sgd();
    let adam = OptimizerConfig {
        weight_decay: 1e-3,
        ..OptimizerConfig::default()
    };
    for n in 1..=3 {
        for (opt, margin) in [
            (sgd, Margin::None),
            (sgd, Margin::ArcFace { m: 0.5 }),
            (adam, Margin::ArcFace { m: 0.5 }),
        ] {
            let worst = launch(n, |c| {
                let a = train(&c, opt, margin, true, 1.0)?;
                let b = train(&c, opt, margin, false, 1.0)?;
                Ok(max_abs_diff(&a, &b))
            })
            .unwrap();
            for (r, w) in worst.iter().enumerate() {
                // The same arithmetic in the same order: equal to 1e-6.
                assert!(
                    *w <= 1e-6,
                    "{n} ranks, {:?} {margin:?}, rank {r}: fused and unfused differ by {w:e}",
                    opt.kind
                );
            }
        }
    }
}

/// Partial FC with SGD: fused = InsightFace's sampled momentum, applied by
/// hand to the unfused gradient (rows outside the step's sample untouched,
/// momentum included).
#[test]
fn fused_partial_fc_is_lazy_momentum() {
    let cfg = OptimizerConfig::sgd();
    assert_eq!(cfg.kind, OptimizerKind::Sgd);
    for n in 1..=2 {
        let worst = launch(n, |c| {
            let fused = train(&c, cfg, Margin::ArcFace { m: 0.5 }, true, 0.3)?;
            // The reference: unfused gradients, the lazy rule by hand.
            let classes = features(0).2;
            let mut head = ShardedClassifier::new(&c, classes, D, Margin::ArcFace { m: 0.5 }, 5)?;
            head.sample_rate = 0.3;
            let mut w = values(head.weight.value());
            let mut momentum = vec![0f32; w.len()];
            let mut touched = vec![false; w.len() / D];
            for step in 0..STEPS {
                let (x, labels, _) = features(step);
                head.set_step(step as u64);
                let lr = (0.05 * (1.0 - step as f64 / 20.0)) as f32;
                let out = head.forward(&x, &labels)?;
                out.loss.backward()?;
                let g = values(&head.weight.take_grad().expect("unfused gradient"));
                let offset = head.offset() as u32;
                for gc in out.sample.expect("a sample") {
                    let r = (gc - offset) as usize;
                    touched[r] = true;
                    for k in r * D..(r + 1) * D {
                        let d = g[k] + cfg.weight_decay as f32 * w[k];
                        momentum[k] = cfg.momentum as f32 * momentum[k] + d;
                        w[k] -= lr * momentum[k];
                    }
                }
                head.weight.var().set(&Tensor::from_slice(
                    &w,
                    head.weight.value().shape(),
                    &Device::Cpu,
                )?)?;
            }
            // Some rows were never sampled: they must still be θ0.
            assert!(touched.iter().any(|t| !t), "every row sampled: a weak test");
            Ok(max_abs_diff(&fused, &w))
        })
        .unwrap();
        for (r, w) in worst.iter().enumerate() {
            assert!(
                *w <= 1e-6,
                "{n} ranks, rank {r}: lazy fused differs by {w:e}"
            );
        }
    }
}

/// This rank's optimizer state, slot by slot (name, values).
fn state_values(o: &Optimizer) -> Result<Vec<(String, Vec<f32>)>> {
    o.state()
        .iter()
        .map(|s| Ok((s.name.clone(), s.with_values(|v| Ok(v.to_vec()))?)))
        .collect()
}

/// One element's step by the optimizer's definition, in f64: θ with
/// `state` (SGD: [momentum]; Adam: [m, v]) and gradient g at step t (from
/// 1), at learning rate `lr`. Returns θ; `state` is stepped.
fn defined_step(
    opt: &OptimizerConfig,
    lr: f64,
    t: i32,
    theta: f64,
    state: &mut [f64],
    g: f64,
) -> f64 {
    let decay = opt.weight_decay;
    match opt.kind {
        OptimizerKind::Sgd => {
            let d = g + decay * theta;
            state[0] = opt.momentum * state[0] + d;
            theta - lr * state[0]
        }
        OptimizerKind::Adam | OptimizerKind::AdamW => {
            let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
            // The decayed gradient g + λθ in f32, as the optimizers form
            // it: where it nearly cancels, m/√v magnifies f32's rounding
            // of the sum (measured here: 3.3e-7 on θ, 1.2e-6 of the
            // largest |θ|), which is not the update's error.
            let (g, keep) = match opt.kind {
                OptimizerKind::AdamW => (g, 1.0 - lr * decay),
                _ => (f64::from(g as f32 + (decay as f32) * (theta as f32)), 1.0),
            };
            state[0] = b1 * state[0] + (1.0 - b1) * g;
            state[1] = b2 * state[1] + (1.0 - b2) * g * g;
            let m_hat = state[0] / (1.0 - b1.powi(t));
            let v_hat = state[1] / (1.0 - b2.powi(t));
            theta * keep - lr * m_hat / (v_hat.sqrt() + eps)
        }
    }
}

/// STEPS fused Partial FC steps (rate 0.3, ArcFace) of `opt` on this
/// rank's shard. Each step, every row outside the step's sample must keep
/// its weight and every optimizer state slot bit for bit (else a panic
/// naming the row); the sampled rows are compared with the optimizer's
/// definition in f64, applied to the same pre-step values and to the
/// gradient of an unfused twin head holding the same weights. Returns the
/// largest error of a sampled element, relative to the largest magnitude
/// of its tensor (weight, momentum, m or v) at that step.
fn lazy_steps(comm: &shardnet::Communicator, opt: OptimizerConfig) -> Result<f64> {
    let (classes, margin, rate) = (features(0).2, Margin::ArcFace { m: 0.5 }, 0.3);
    let mut head = ShardedClassifier::new(comm, classes, D, margin, 5)?;
    let mut twin = ShardedClassifier::new(comm, classes, D, margin, 5)?;
    (head.sample_rate, twin.sample_rate) = (rate, rate);
    let theta0 = values(head.weight.value());
    let mut o = Optimizer::new(&opt, vec![head.weight.clone()], 0.05)?;
    o.fuse(&head.weight)?;
    let cr = head.local_classes();
    let offset = head.offset() as u32;
    let mut never = vec![true; cr];
    let mut worst = 0f64;
    for step in 0..STEPS {
        let (x, labels, _) = features(step);
        let lr = 0.05 * (1.0 - step as f64 / 20.0);
        let (w0, s0) = (values(head.weight.value()), state_values(&o)?);
        // The gradient this step applies: the unfused twin's, from the
        // same weights and the same sample.
        twin.weight.var().set(head.weight.value())?;
        twin.set_step(step as u64);
        let out = twin.forward(&x, &labels)?;
        out.loss.backward()?;
        let g = values(&twin.weight.take_grad().expect("the twin's gradient"));
        head.set_step(step as u64);
        o.set_lr(lr);
        o.prepare_fused(1.0);
        let fused = head.forward(&x, &labels)?;
        assert_eq!(fused.sample, out.sample, "the twin drew another sample");
        fused.loss.backward()?;
        o.step()?;
        let (w1, s1) = (values(head.weight.value()), state_values(&o)?);
        let mut sampled = vec![false; cr];
        for c in out.sample.expect("a sample") {
            sampled[(c - offset) as usize] = true;
        }
        let max_abs = |v: &[f32]| v.iter().fold(0f64, |m, x| m.max(f64::from(x.abs())));
        let scale_w = max_abs(&w1).max(f64::MIN_POSITIVE);
        let scale_s: Vec<f64> = s1
            .iter()
            .map(|(_, v)| max_abs(v).max(f64::MIN_POSITIVE))
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for r in 0..cr {
            let span = r * D..(r + 1) * D;
            if !sampled[r] {
                let what = format!(
                    "{:?}, rank {}, step {step}: row {r} is outside the sample, but",
                    opt.kind,
                    comm.rank()
                );
                assert!(
                    bits(&w1[span.clone()]) == bits(&w0[span.clone()]),
                    "{what} its weight moved"
                );
                for ((name, after), (_, before)) in s1.iter().zip(&s0) {
                    assert!(
                        bits(&after[span.clone()]) == bits(&before[span.clone()]),
                        "{what} its {name} moved"
                    );
                }
                continue;
            }
            never[r] = false;
            for k in span {
                let mut state: Vec<f64> = s0.iter().map(|(_, v)| f64::from(v[k])).collect();
                let want = defined_step(
                    &opt,
                    lr,
                    step as i32 + 1,
                    f64::from(w0[k]),
                    &mut state,
                    f64::from(g[k]),
                );
                worst = worst.max((f64::from(w1[k]) - want).abs() / scale_w);
                for (j, want) in state.iter().enumerate() {
                    worst = worst.max((f64::from(s1[j].1[k]) - want).abs() / scale_s[j]);
                }
            }
        }
    }
    // Rows never sampled: still θ0, their state still zero.
    assert!(never.iter().any(|&n| n), "every row sampled: a weak test");
    let (w, s) = (values(head.weight.value()), state_values(&o)?);
    for r in (0..cr).filter(|&r| never[r]) {
        let span = r * D..(r + 1) * D;
        assert_eq!(
            w[span.clone()],
            theta0[span.clone()],
            "row {r} never sampled, yet moved"
        );
        for (name, v) in &s {
            assert!(
                v[span.clone()].iter().all(|x| x.to_bits() == 0),
                "row {r} never sampled, yet its {name} moved"
            );
        }
    }
    Ok(worst)
}

/// Partial FC under the fused step, on this process's kernel path (the
/// CPU kernels, or the device-generic path under
/// `SHARDNET_KERNELS=generic`), for SGD (momentum, weight decay), Adam
/// (L2 decay) and AdamW, on 1 and 2 ranks: InsightFace's lazy update.
/// Rows outside a step's sample keep their weight and all their optimizer
/// state bit for bit (weight decay and momentum decay included); the
/// sampled rows' weight and state equal the optimizer's definition in f64
/// to 1e-6 of the largest magnitude of their tensor (measured: 1.4e-7 at
/// most, on either path).
#[test]
fn fused_partial_fc_steps_the_sampled_rows_and_their_state_only() {
    let adam = OptimizerConfig {
        weight_decay: 1e-3,
        ..OptimizerConfig::default()
    };
    for opt in [OptimizerConfig::sgd(), adam, OptimizerConfig::adamw()] {
        for n in 1..=2 {
            let worst = launch(n, |c| lazy_steps(&c, opt)).unwrap();
            for (r, w) in worst.iter().enumerate() {
                assert!(
                    *w <= 1e-6,
                    "{:?}, {n} ranks, rank {r}: a sampled row is {w:e} from the f64 definition",
                    opt.kind
                );
            }
        }
    }
}
