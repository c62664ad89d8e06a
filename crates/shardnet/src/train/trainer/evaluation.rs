//! Evaluation after each epoch ([`Evaluation`]): the model's test-set
//! accuracy, unless the epoch was cut short by a stop (kept, not
//! evaluated).

use super::extension::{Cx, EpochEvent, Extension};
use crate::Result;

/// Evaluates the model on its test set after each epoch.
pub struct Evaluation;

impl Extension for Evaluation {
    fn after_epoch(&mut self, cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        if !ev.interrupted {
            let _step = crate::heap::counting_as(crate::heap::Part::Activations);
            ev.metrics.test_accuracy = cx.model.evaluate()?;
            ev.evaluated = true;
        }
        Ok(())
    }
}
