//! `--log-dir` as an extension: a JSON line per step (with every rank's
//! peak memory where the ranks agreed) and per epoch ([`RunLog`]).

use super::extension::{Cx, EpochEvent, Extension, StepEvent};
use crate::train::log::{RunLog, StepLine};
use crate::Result;

impl Extension for RunLog {
    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        let out = &ev.out;
        self.step(&StepLine {
            step: ev.step,
            epoch: ev.epoch,
            loss: out.loss,
            accuracy: (out.samples > 0).then(|| out.correct as f64 / out.samples as f64),
            samples_per_s: (ev.warm && ev.took > 0.0).then(|| out.samples as f64 / ev.took),
            lr: ev.lr,
            loss_scale: cx.model.loss_scale(),
            bytes_received: ev.received,
            time_s: self.elapsed(),
            memory_bytes: ev.agreed.as_ref().map(|a| a.memory.clone()),
        })
    }

    fn after_epoch(&mut self, _cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        self.epoch(&ev.metrics, ev.state.step)
    }
}
