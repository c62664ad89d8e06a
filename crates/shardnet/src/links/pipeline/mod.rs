//! `Pipeline`: a chain of layers cut into chunks over the ranks, trained
//! micro-batch by micro-batch under a [`Schedule`] — GPipe, 1F1B,
//! Megatron's interleaved stages, or a zero-bubble schedule.
//!
//! Rank r holds chunks v = 0..V, global chunk v·p + r; chunk 0 takes the
//! model's input on rank 0, the last chunk (on rank p − 1) gives the output
//! to the loss. Each rank runs its passes in the order the [`Plan`] gives
//! ([`schedule`](self::schedule) says how it is made):
//!
//! | pass | does | messages (plain, not on the tape) |
//! |------|------|-----------------------------------|
//! | F(v, i) | x = input or activation received; y = chunk(x); keep the graph | y → rank of chunk c + 1 |
//! | B(v, i) | backward from the loss (last chunk) or from y · g with g received | dL/dx → rank of chunk c − 1 |
//! | W(v, i) | the weight gradients B deferred (zero-bubble) | — |
//!
//! Messages between two ranks arrive in the order sent; a rank knows from
//! the plan which message each one is, so one it reaches early (interleaved
//! schedules on two ranks send both activations and gradients each way)
//! waits in a small buffer until its pass. Parameter gradients accumulate
//! in the layers' [`Param`](crate::nn::Param)s across micro-batches, in
//! ascending micro-batch order under every schedule.
//!
//! Unlike [`MultiNodeChainList`](super::MultiNodeChainList) (ChainerMN's
//! container: any wiring, one `backward()` per rank through the tape), a
//! pipeline is a straight chain and runs its own backward per micro-batch,
//! which is what lets backward passes start before the last forward.
//!
//! ```
//! use candle_core::{DType, Tensor};
//! use shardnet::links::{ChainLink, Pipeline, Schedule};
//! use shardnet::nn::ParamStore;
//!
//! shardnet::launch(2, |comm| {
//!     let store = ParamStore::new(comm.device(), 0);
//!     let layer = store.linear(&format!("layer{}", comm.rank()), comm.rank(), 3, 3)?;
//!     let chunk = move |xs: &[Tensor]| Ok(layer.forward(&xs[0])?.relu()?);
//!     let chunks: Vec<Box<dyn ChainLink>> = vec![Box::new(chunk)];
//!     let pipe = Pipeline::new(&comm, Schedule::OneFOneB, chunks)?;
//!     let xs: Vec<Tensor> = (0..4)
//!         .map(|_| Tensor::ones((2, 3), DType::F32, comm.device()))
//!         .collect::<candle_core::Result<_>>()?;
//!     let inputs = (comm.rank() == 0).then_some(xs.as_slice());
//!     let losses = pipe.step(inputs, 4, &mut |_, y| Ok(y.sum_all()?))?;
//!     assert_eq!(losses.len(), if comm.rank() == 1 { 4 } else { 0 });
//!     Ok(())
//! })?;
//! # Ok::<(), shardnet::Error>(())
//! ```

mod balance;
mod plan;
mod schedule;
mod simulate;

pub use balance::{balance, Balance};
pub use plan::{Message, Plan};
pub use schedule::{Action, Costs, Pass, Schedule, Timeline};

use super::ChainLink;
use crate::comm::Communicator;
use crate::nn::{defer_weight_grads, WeightGrads};
use crate::{Error, Result};
use candle_core::{Tensor, Var};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// This rank's chunks of a chain of layers and the schedule they train by.
pub struct Pipeline {
    comm: Communicator,
    chunks: Vec<Box<dyn ChainLink>>,
    schedule: Schedule,
    costs: Costs,
    /// Plans made so far, by micro-batch count (the last batch of an epoch
    /// may have fewer).
    plans: RefCell<HashMap<usize, Arc<Plan>>>,
}

/// What a forward pass keeps until its backward.
struct Held {
    /// The input as a variable (None for chunk 0: no gradient to send).
    x: Option<Var>,
    /// The output, or the loss on the last chunk.
    y: Tensor,
}

/// Receives in the plan's order: what arrives before its pass waits here.
struct Inbox<'a> {
    comm: &'a Communicator,
    /// Per source rank, the messages still to come, in order.
    expected: Vec<VecDeque<Message>>,
    /// Messages that arrived before their pass, and those this rank hands
    /// itself (a chunk followed by another of its own: one rank, V > 1).
    early: HashMap<Message, Tensor>,
}

impl Inbox<'_> {
    /// Send `t` as `what` to `dst` (kept here when `dst` is this rank).
    fn send(&mut self, t: &Tensor, dst: usize, what: Message) -> Result<()> {
        if dst == self.comm.rank() {
            self.early.insert(what, t.clone());
            Ok(())
        } else {
            self.comm.send(t, dst)
        }
    }

    fn take(&mut self, src: usize, want: Message) -> Result<Tensor> {
        if let Some(t) = self.early.remove(&want) {
            return Ok(t);
        }
        loop {
            let Some(next) = self.expected[src].pop_front() else {
                return Err(Error::Usage(format!(
                    "pipeline: rank {} waits for {want:?} from rank {src}, which the plan does \
                     not send; this is a bug",
                    self.comm.rank()
                )));
            };
            let t = self.comm.recv(src)?;
            if next == want {
                return Ok(t);
            }
            self.early.insert(next, t);
        }
    }
}

impl Pipeline {
    /// This rank's `chunks` (V of them, the same V on every rank: global
    /// chunk v·p + r is `chunks[v]`), trained by `schedule`. The plan is
    /// made with equal costs per chunk; [`Pipeline::with_costs`] gives
    /// measured or estimated ones.
    pub fn new(
        comm: &Communicator,
        schedule: Schedule,
        chunks: Vec<Box<dyn ChainLink>>,
    ) -> Result<Self> {
        if chunks.is_empty() {
            return Err(Error::Usage(
                "Pipeline: every rank needs at least one chunk of layers".into(),
            ));
        }
        let costs = Costs::uniform(comm.size() * chunks.len());
        Ok(Pipeline {
            comm: comm.clone(),
            chunks,
            schedule,
            costs,
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// The same with each global chunk's costs (p·V of each), which decide
    /// the order of passes where the schedule leaves a choice.
    pub fn with_costs(mut self, costs: Costs) -> Self {
        self.costs = costs;
        self.plans.borrow_mut().clear();
        self
    }

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// The plan for `micro_batches` micro-batches (made once per count).
    pub fn plan(&self, micro_batches: usize) -> Result<Arc<Plan>> {
        if let Some(p) = self.plans.borrow().get(&micro_batches) {
            return Ok(p.clone());
        }
        let plan = Plan::new(
            self.schedule,
            self.comm.size(),
            micro_batches,
            self.chunks.len(),
            &self.costs,
        )?;
        self.plans.borrow_mut().insert(micro_batches, plan.clone());
        Ok(plan)
    }

    /// Every rank runs the same schedule with the same shape (a
    /// disagreement would pair the wrong messages). Collective.
    fn agree(&self, micro_batches: usize) -> Result<()> {
        self.comm.agree(
            "pipeline settings",
            &[
                ("schedule".into(), self.schedule.to_string()),
                ("micro-batches".into(), micro_batches.to_string()),
                ("chunks per rank".into(), self.chunks.len().to_string()),
            ],
        )
    }

    fn inputs<'a>(&self, inputs: Option<&'a [Tensor]>, m: usize) -> Result<Option<&'a [Tensor]>> {
        let r = self.comm.rank();
        match (r, inputs) {
            (0, Some(xs)) if xs.len() == m => Ok(Some(xs)),
            (0, _) => Err(Error::Usage(format!(
                "Pipeline: rank 0 holds chunk 0 and takes the model's input: pass {m} \
                 micro-batches"
            ))),
            (_, Some(_)) => Err(Error::Usage(format!(
                "Pipeline: rank {r} was given inputs; only rank 0 (chunk 0) takes the \
                 model's input, the others pass None"
            ))),
            (_, None) => Ok(None),
        }
    }

    /// Train one step: forward and backward of `micro_batches`
    /// micro-batches (rank 0 passes them, the others `None`), by the
    /// schedule. On rank p − 1, `loss(i, y)` turns the output of
    /// micro-batch i into the scalar to run backward from; the losses come
    /// back there (detached), empty elsewhere. Parameter gradients are in
    /// the layers' `Param`s afterwards. Collective.
    pub fn step(
        &self,
        inputs: Option<&[Tensor]>,
        micro_batches: usize,
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let m = micro_batches;
        let inputs = self.inputs(inputs, m)?;
        self.agree(m)?;
        let plan = self.plan(m)?;
        let (p, r) = (self.comm.size(), self.comm.rank());
        let last = p * self.chunks.len() - 1;
        let mut inbox = Inbox {
            comm: &self.comm,
            expected: (0..p)
                .map(|src| plan.messages(src, r).into_iter().collect())
                .collect(),
            early: HashMap::new(),
        };
        let mut held: HashMap<(usize, usize), Held> = HashMap::new();
        let mut deferred: HashMap<(usize, usize), WeightGrads> = HashMap::new();
        let mut losses = Vec::new();
        let split = self.schedule.splits_backward();
        for a in &plan.actions[r] {
            let (v, i) = (a.chunk, a.micro_batch);
            let c = v * p + r;
            match a.pass {
                schedule::Pass::F => {
                    let (x, xv) = match inputs {
                        Some(xs) if c == 0 => (xs[i].clone(), None),
                        _ => {
                            let t = inbox
                                .take((c - 1) % p, Message::Activation(c - 1, i))?
                                .to_device(self.comm.device())?;
                            let var = Var::from_tensor(&t)?;
                            (var.as_tensor().clone(), Some(var))
                        }
                    };
                    // Each pass's communication on its own chain (one per
                    // micro-batch and chunk: each pass has its own graph
                    // and backward), so that a backward need not wait for
                    // later passes'.
                    let chain = (i * self.chunks.len() + v) as u64 + 1;
                    let y = crate::functions::in_chain(chain, || -> Result<Tensor> {
                        let y = self.chunks[v].forward(std::slice::from_ref(&x))?;
                        if c == last {
                            loss(i, &y)
                        } else {
                            Ok(y)
                        }
                    })?;
                    let y = if c == last {
                        losses.push(y.detach());
                        y
                    } else {
                        inbox.send(&y.detach(), (c + 1) % p, Message::Activation(c, i))?;
                        y
                    };
                    held.insert((v, i), Held { x: xv, y });
                }
                schedule::Pass::B => {
                    let h = held.remove(&(v, i)).ok_or_else(|| order_bug(a))?;
                    // The last chunk's y is the loss; any other's gradient
                    // comes from the chunk after it.
                    let g = if c == last {
                        None
                    } else {
                        let g = inbox
                            .take((c + 1) % p, Message::Gradient(c + 1, i))?
                            .to_device(h.y.device())?;
                        Some(g)
                    };
                    let backward = || match &g {
                        None => Ok(h.y.backward()?),
                        Some(g) => crate::functions::backward_from(&h.y, g),
                    };
                    let grads = if split {
                        let (grads, work) = defer_weight_grads(backward)?;
                        deferred.insert((v, i), work);
                        grads
                    } else {
                        backward()?
                    };
                    if let Some(x) = &h.x {
                        let dx = match grads.get(x.as_tensor()) {
                            Some(g) => g.clone(),
                            // The chunk does not depend on its input.
                            None => x.zeros_like()?,
                        };
                        inbox.send(&dx, (c - 1) % p, Message::Gradient(c, i))?;
                    }
                }
                schedule::Pass::W => {
                    deferred
                        .remove(&(v, i))
                        .ok_or_else(|| order_bug(a))?
                        .run()?;
                }
            }
        }
        if !held.is_empty() || !deferred.is_empty() || !inbox.early.is_empty() {
            return Err(Error::Usage(format!(
                "pipeline: rank {r} ended its step with passes or messages left over; this is a bug"
            )));
        }
        Ok(losses)
    }

    /// Forward only (evaluation): the outputs of `micro_batches`
    /// micro-batches on rank p − 1, empty elsewhere. Collective.
    pub fn forward(&self, inputs: Option<&[Tensor]>, micro_batches: usize) -> Result<Vec<Tensor>> {
        let m = micro_batches;
        let inputs = self.inputs(inputs, m)?;
        self.agree(m)?;
        let (p, r, chunks) = (self.comm.size(), self.comm.rank(), self.chunks.len());
        let last = p * chunks - 1;
        let mut outputs = Vec::new();
        // One rank alone hands itself each chunk's outputs.
        let mut own: VecDeque<Tensor> = VecDeque::new();
        // Chunk by chunk in the order of the data; a micro-batch's sends
        // never wait, so rank r works on i while rank r + 1 works on i − 1.
        for v in 0..chunks {
            let c = v * p + r;
            for i in 0..m {
                let x = match inputs {
                    Some(xs) if c == 0 => xs[i].clone(),
                    _ if p == 1 => own.pop_front().ok_or_else(|| {
                        Error::Usage("pipeline: a chunk's input is missing; this is a bug".into())
                    })?,
                    _ => self.comm.recv((c - 1) % p)?.to_device(self.comm.device())?,
                };
                let y = self.chunks[v].forward(std::slice::from_ref(&x))?.detach();
                if c == last {
                    outputs.push(y);
                } else if p == 1 {
                    own.push_back(y);
                } else {
                    self.comm.send(&y, (c + 1) % p)?;
                }
            }
        }
        Ok(outputs)
    }
}

fn order_bug(a: &Action) -> Error {
    Error::Usage(format!(
        "pipeline: {a:?} before the pass it needs; this is a bug"
    ))
}
