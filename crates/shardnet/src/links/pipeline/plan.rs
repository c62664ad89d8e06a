//! A schedule's plan ([`Plan`]): every rank's passes in order, from the
//! simulation with the chunks' costs, made once per set of inputs and
//! shared; the messages between two ranks it implies.

use super::schedule::{Action, Costs, Pass, Schedule, Timeline};
use super::simulate::simulate;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// A plan's inputs: schedule, p, M, V and the costs' bits.
type PlanKey = (Schedule, usize, usize, usize, Vec<u64>);

/// How many of the plans last made are kept.
const KEPT_PLANS: usize = 8;

/// The plans last made, oldest first.
static MADE: Mutex<Vec<(PlanKey, Arc<Plan>)>> = Mutex::new(Vec::new());

/// Every rank's passes in order, and the simulated run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The schedule.
    pub schedule: Schedule,
    /// p.
    pub ranks: usize,
    /// M.
    pub micro_batches: usize,
    /// V.
    pub virtual_stages: usize,
    /// Per rank, its passes in the order it runs them.
    pub actions: Vec<Vec<Action>>,
    /// The simulation the orders come from.
    pub timeline: Timeline,
}

/// A message of the pipeline: chunk c's output for micro-batch i (to chunk
/// c + 1), or the gradient of chunk c's input (to chunk c − 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Message {
    /// The activation chunk `.0` sends for micro-batch `.1`.
    Activation(usize, usize),
    /// The input gradient chunk `.0` sends for micro-batch `.1`.
    Gradient(usize, usize),
}

impl Plan {
    /// The orders of `schedule` on `ranks` ranks with `micro_batches`
    /// micro-batches and `virtual_stages` chunks per rank, simulated with
    /// `costs` (per global chunk). The plan is shared: every rank builds
    /// the same one, and the last few made are kept by their inputs.
    pub fn new(
        schedule: Schedule,
        ranks: usize,
        micro_batches: usize,
        virtual_stages: usize,
        costs: &Costs,
    ) -> Result<Arc<Self>> {
        let (p, m, v) = (ranks, micro_batches, virtual_stages);
        if p == 0 || m == 0 || v == 0 {
            return Err(Error::Usage(format!(
                "a pipeline needs at least one rank, micro-batch and chunk per rank \
                 ({p} ranks, {m} micro-batches, {v} chunks per rank)"
            )));
        }
        let chunks = p * v;
        for (what, c) in [
            ("forward", &costs.forward),
            ("backward", &costs.backward),
            ("weight", &costs.weight),
        ] {
            if c.len() != chunks || c.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(Error::Usage(format!(
                    "pipeline costs: {what} needs {chunks} finite costs ≥ 0, got {c:?}"
                )));
            }
        }
        // Every rank builds the same plan, and the memory plan asks for it
        // once per rank: the last few made are kept, by their inputs.
        let key = (schedule, p, m, v, costs.bits());
        let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, plan)) = made.iter().find(|(k, _)| *k == key) {
            return Ok(plan.clone());
        }
        // A fixed order that cannot complete (interleaving with M not a
        // multiple of p can wait in a circle) falls back to the list
        // scheduler's greedy order under the same limits.
        let (actions, timeline) = match simulate(schedule, p, m, v, costs, true) {
            Ok(x) => x,
            Err(_) => simulate(schedule, p, m, v, costs, false)?,
        };
        let plan = Arc::new(Plan {
            schedule,
            ranks: p,
            micro_batches: m,
            virtual_stages: v,
            actions,
            timeline,
        });
        if made.len() == KEPT_PLANS {
            made.remove(0);
        }
        made.push((key, plan.clone()));
        Ok(plan)
    }

    /// The messages rank `src` sends to rank `dst`, in the order it sends
    /// them (what `dst` receives from `src`, in that order).
    pub fn messages(&self, src: usize, dst: usize) -> Vec<Message> {
        let (p, chunks) = (self.ranks, self.ranks * self.virtual_stages);
        let mut out = Vec::new();
        for a in &self.actions[src] {
            let c = a.chunk * p + src;
            match a.pass {
                Pass::F if c + 1 < chunks && (c + 1) % p == dst && dst != src => {
                    out.push(Message::Activation(c, a.micro_batch))
                }
                Pass::B if c > 0 && (c - 1) % p == dst && dst != src => {
                    out.push(Message::Gradient(c, a.micro_batch))
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{Costs, Plan, Schedule};

    /// Each rank (and the memory plan, once per rank) asks for the same
    /// plan: it is simulated once and shared; other inputs, another plan.
    #[test]
    fn the_same_inputs_share_one_plan() {
        let costs = Costs::uniform(13);
        let a = Plan::new(Schedule::OneFOneB, 13, 11, 1, &costs).unwrap();
        let b = Plan::new(Schedule::OneFOneB, 13, 11, 1, &costs).unwrap();
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        let mut other = costs.clone();
        other.forward[3] = 1.5;
        let c = Plan::new(Schedule::OneFOneB, 13, 11, 1, &other).unwrap();
        assert!(!std::sync::Arc::ptr_eq(&a, &c));
        assert!(c.timeline.makespan > a.timeline.makespan);
    }
}
