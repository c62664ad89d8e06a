//! The fused head step (the optimizer applied inside backward, class block
//! by class block, no gradient of the shard held) against the unfused one
//! (gradient accumulated, then the optimizer's step): the same weights
//! after 10 steps, for SGD and Adam, plain and ArcFace logits, on 1–3 ranks,
//! with more classes than one class block. Under Partial FC the fused step
//! is lazy (InsightFace's sampled momentum: rows outside the sample keep
//! their weights and their momentum); checked against that rule applied by
//! hand to the unfused gradient.

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
    if common::cpu_kernels_only("the fused head step (the optimizer inside backward; the generic path accumulates, then steps)") {
        return;
    }
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
    if common::cpu_kernels_only("the fused head step (the optimizer inside backward; the generic path accumulates, then steps)") {
        return;
    }
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
