//! The loop's extensions, as a user's own model and extension meet them: a
//! `TrainModel` written here (no data set, one parameter vector per rank)
//! gets the agreement, evaluation, checkpoints, resume and the divergence
//! guard, and an extension of its own sees every step, epoch and end in
//! order, after the standard ones.

use candle_core::{Device, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::nn::ParamStore;
use shardnet::optim::OptimizerConfig;
use shardnet::train::{
    train_with, Checkpointing, Cx, EndEvent, EpochEvent, Extension, Options, Parts, StepEvent,
    StepOutput, Trace, TrainModel,
};
use shardnet::Result;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;
use common::scratch;

/// Pulls w towards 1: loss = mean((w − 1)²), its gradient set by hand.
/// Steps listed in `nan_at` (1-based) report a NaN loss.
struct Pull {
    parts: Parts,
    nan_at: Option<usize>,
}

impl Pull {
    fn new(nan_at: Option<usize>) -> Self {
        let store = ParamStore::new(&Device::Cpu, 7);
        let w = Tensor::new(&[3f32, -2.0, 0.5, 8.0], &Device::Cpu).unwrap();
        store.add("w", &w, None).unwrap();
        let parts = Parts::new(store, &OptimizerConfig::sgd(), 0.1, None).unwrap();
        Pull { parts, nan_at }
    }

    fn w(&self) -> Vec<f32> {
        self.parts.store.params()[0].value().to_vec1().unwrap()
    }
}

impl TrainModel for Pull {
    fn name(&self) -> &str {
        "pull"
    }

    fn steps_per_epoch(&self) -> usize {
        5
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        trace.start();
        let p = self.parts.store.params()[0].clone();
        let w = p.value();
        let d = (w - 1.0)?;
        let loss = d.sqr()?.mean_all()?.to_scalar::<f32>()? as f64;
        p.set_grad(&(d * 0.5)?)?;
        self.parts.opt.step()?;
        let loss = match self.nan_at {
            Some(n) if n == step + 1 => f64::NAN,
            _ => loss,
        };
        Ok(StepOutput {
            loss,
            correct: 1,
            samples: 2,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        Ok(0.25)
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }
}

/// Writes down every hook call it sees.
struct Record(Arc<Mutex<Vec<String>>>);

impl Extension for Record {
    fn after_step(&mut self, _cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        let agreed = if ev.agreed.is_some() { " agreed" } else { "" };
        self.0
            .lock()
            .unwrap()
            .push(format!("step {} of epoch {}{agreed}", ev.step, ev.epoch));
        Ok(())
    }

    fn after_epoch(&mut self, _cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        self.0.lock().unwrap().push(format!(
            "epoch {}: {} steps, test {}, train accuracy {}",
            ev.metrics.epoch, ev.metrics.steps, ev.metrics.test_accuracy, ev.metrics.train_accuracy
        ));
        Ok(())
    }

    fn finish(&mut self, _cx: &mut Cx<'_>, end: &EndEvent<'_>) -> Result<()> {
        self.0
            .lock()
            .unwrap()
            .push(format!("end at step {} ({})", end.step, end.interrupted));
        Ok(())
    }
}

fn options(epochs: usize) -> Options {
    Options {
        epochs,
        lr: 0.1,
        optimizer: OptimizerConfig::sgd(),
        progress: false,
        ..Options::default()
    }
}

/// Train `Pull` on `ranks` thread ranks: each rank's w and hook record.
fn run(
    ranks: usize,
    opts: &Options,
    nan_at: Option<usize>,
) -> Result<Vec<(Vec<f32>, Vec<String>)>> {
    launch_with_timeout(ranks, Duration::from_secs(60), |c| {
        let mut m = Pull::new(nan_at);
        let seen = Arc::new(Mutex::new(Vec::new()));
        train_with(&c, &mut m, opts, vec![Box::new(Record(seen.clone()))])?;
        let seen = seen.lock().unwrap().clone();
        Ok((m.w(), seen))
    })
}

#[test]
fn a_users_extension_sees_every_step_epoch_and_end_after_the_standard_ones() {
    let got = run(2, &options(2), None).unwrap();
    let mut want = Vec::new();
    for step in 1..=10 {
        let epoch = (step - 1) / 5 + 1;
        // The first step and each epoch's last are agreed.
        let agreed = if step == 1 || step % 5 == 0 {
            " agreed"
        } else {
            ""
        };
        want.push(format!("step {step} of epoch {epoch}{agreed}"));
        if step % 5 == 0 {
            // Evaluated before this extension sees the epoch.
            want.push(format!(
                "epoch {epoch}: 5 steps, test 0.25, train accuracy 0.5"
            ));
        }
    }
    want.push("end at step 10 (false)".into());
    for (rank, (_, seen)) in got.iter().enumerate() {
        assert_eq!(seen, &want, "rank {rank}");
    }
}

#[test]
fn a_users_model_gets_checkpoints_and_resumes_bit_for_bit() {
    let dir = scratch("extensions", "resume");
    let straight = run(2, &options(3), None).unwrap();
    let mut first = options(3);
    first.checkpoint = Some(Checkpointing {
        dir: dir.clone(),
        every: Some(4),
        keep: 2,
    });
    first.stop_after = Some(7);
    let stopped = run(2, &first, None).unwrap();
    assert_eq!(
        stopped[0].1.last().unwrap(),
        "end at step 7 (true)",
        "{:?}",
        stopped[0].1
    );
    let mut rest = first.clone();
    rest.stop_after = None;
    rest.resume = Some(dir.clone());
    let resumed = run(2, &rest, None).unwrap();
    for r in 0..2 {
        assert_eq!(resumed[r].0, straight[r].0, "rank {r}");
    }
    // The resumed run's first step is the checkpoint's next.
    assert_eq!(resumed[0].1[0], "step 8 of epoch 2 agreed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_users_model_that_diverges_is_stopped_by_the_guard_before_its_checkpoint() {
    let dir = scratch("extensions", "diverged");
    let mut opts = options(2);
    opts.checkpoint = Some(Checkpointing {
        dir: dir.clone(),
        every: Some(3),
        keep: 5,
    });
    let e = run(2, &opts, Some(2)).unwrap_err().to_string();
    // Step 2's NaN is agreed at step 3, because step 3 writes a
    // checkpoint: the run stops before it (no agreement would otherwise
    // come before the epoch's end, at step 5).
    assert!(e.contains("step 2 (epoch 1): the loss is NaN"), "{e}");
    assert!(e.contains("no checkpoint of it was written"), "{e}");
    let kept = common::step_dirs(&dir);
    assert!(kept.is_empty(), "{kept:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
