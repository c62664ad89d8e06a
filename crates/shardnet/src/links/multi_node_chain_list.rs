//! `MultiNodeChainList` (ChainerMN's container for model parallelism): a model's components on this rank, each
//! receiving its inputs from `rank_in` and sending its output to `rank_out`.
//!
//! Forward runs the components in the order added. A component with empty
//! `rank_in` takes the model's input; with several, it gets one input per rank,
//! in that order. Its output is sent to every rank of `rank_out` (its own rank
//! means a local queue, read by a later component of this rank); empty
//! `rank_out` makes it the model's output (at most one component). Sends'
//! delegates are chained into the next receive or joined to the output, so
//! one `backward()` per rank runs the whole graph.
//!
//! **Micro-batches** (GPipe): `forward` takes M micro-batches and runs each
//! component over all of them before the next component. Sends do not wait,
//! so stage k works on micro-batch i while stage k+1 works on i − 1; backward
//! mirrors it.
//!
//! **Wiring check**: the first forward exchanges every rank's wiring and
//! simulates the message flow; a `rank_in` with no matching send, a send
//! nobody receives, or a cycle that would wait forever is an error on every
//! rank, naming the components and ranks.
//!
//! ```
//! use candle_core::{DType, Tensor, Var};
//! use shardnet::{functions::Context, launch, links::MultiNodeChainList};
//!
//! launch(2, |comm| {
//!     let w = Var::ones((3, 3), DType::F32, comm.device())?;
//!     let mut model = MultiNodeChainList::new(&Context::new(&comm));
//!     let w2 = w.clone();
//!     let layer = move |xs: &[Tensor]| Ok(xs[0].matmul(w2.as_tensor())?.relu()?);
//!     if comm.rank() == 0 {
//!         model.add_link(layer, &[], &[1])?;                       // MLP0SubA
//!         model.add_link(|xs: &[Tensor]| Ok(xs[0].clone()), &[1], &[])?; // MLP0SubB
//!     } else {
//!         model.add_link(layer, &[0], &[0])?;                      // MLP1Sub
//!     }
//!     let x = Tensor::ones((2, 3), DType::F32, comm.device())?;
//!     let out = model.forward(Some(&[x]), 1)?;
//!     let loss = out.outputs.first().map(|y| y.sum_all()).transpose()?;
//!     out.backward_root(loss)?.backward()?;
//!     Ok(())
//! })?;
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::functions::{pseudo_connect, recv, send, Context};
use crate::{Error, Result};
use candle_core::Tensor;
use std::cell::Cell;
use std::collections::VecDeque;

/// One component: its inputs (one per `rank_in`, or the model's input) to
/// its output. Closures `Fn(&[Tensor]) -> Result<Tensor>` are components.
pub trait ChainLink {
    /// Compute the component's output.
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor>;
}

impl<F: Fn(&[Tensor]) -> Result<Tensor>> ChainLink for F {
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        self(xs)
    }
}

struct Entry {
    link: Box<dyn ChainLink>,
    rank_in: Vec<usize>,
    rank_out: Vec<usize>,
}

/// The components of a model that live on this rank, and their wiring.
pub struct MultiNodeChainList {
    comm: Context,
    links: Vec<Entry>,
    checked: Cell<bool>,
}

/// What [`MultiNodeChainList::forward`] returns.
pub struct ChainOutput {
    /// The model's output per micro-batch, on the rank with the output
    /// component; empty elsewhere.
    pub outputs: Vec<Tensor>,
    /// The last send's delegate when nothing after it consumed it.
    pub delegate: Option<Tensor>,
}

impl ChainOutput {
    /// What this rank calls `backward()` on: its loss (on the output rank)
    /// joined to any pending delegate, or the delegate alone.
    pub fn backward_root(&self, loss: Option<Tensor>) -> Result<Tensor> {
        match (loss, &self.delegate) {
            (Some(l), Some(d)) => pseudo_connect(d, &l),
            (Some(l), None) => Ok(l),
            (None, Some(d)) => Ok(d.clone()),
            (None, None) => Err(Error::Usage(
                "MultiNodeChainList: this rank has no output and sends nothing; there is \
                 nothing to run backward from"
                    .into(),
            )),
        }
    }
}

/// A rank's wiring: (rank_in, rank_out) per component.
type Wiring = Vec<(Vec<usize>, Vec<usize>)>;

impl MultiNodeChainList {
    /// The differentiable communication context it runs on (for
    /// [`Context::no_grad`] in evaluation).
    pub fn context(&self) -> &Context {
        &self.comm
    }

    /// An empty list on `comm`.
    pub fn new(comm: &Context) -> Self {
        MultiNodeChainList {
            comm: comm.clone(),
            links: Vec::new(),
            checked: Cell::new(false),
        }
    }

    /// Add a component receiving from `rank_in` (empty: the model's input)
    /// and sending to `rank_out` (empty: the model's output).
    pub fn add_link(
        &mut self,
        link: impl ChainLink + 'static,
        rank_in: &[usize],
        rank_out: &[usize],
    ) -> Result<&mut Self> {
        let n = self.comm.size();
        if let Some(r) = rank_in.iter().chain(rank_out).find(|r| **r >= n) {
            return Err(Error::Usage(format!(
                "add_link: rank {r} is out of range (communicator of {n} ranks)"
            )));
        }
        if rank_out.is_empty() && self.links.iter().any(|e| e.rank_out.is_empty()) {
            return Err(Error::Usage(
                "add_link: a second component with no rank_out; at most one produces the output"
                    .into(),
            ));
        }
        self.links.push(Entry {
            link: Box::new(link),
            rank_in: rank_in.to_vec(),
            rank_out: rank_out.to_vec(),
        });
        self.checked.set(false);
        Ok(self)
    }

    /// Whether a component of this rank produces the model's output.
    pub fn has_output(&self) -> bool {
        self.links.iter().any(|e| e.rank_out.is_empty())
    }

    /// Run every component over `micro_batches` micro-batches. Ranks whose
    /// components take the model's input pass that many inputs; others pass
    /// `None`. Every rank passes the same `micro_batches`.
    pub fn forward(&self, inputs: Option<&[Tensor]>, micro_batches: usize) -> Result<ChainOutput> {
        if !self.checked.get() {
            self.check_wiring()?;
            self.checked.set(true);
        }
        let me = self.comm.rank();
        let m = micro_batches;
        let mut queue: VecDeque<Tensor> = VecDeque::new();
        let mut delegate: Option<Tensor> = None;
        let mut outputs = Vec::new();
        for (k, e) in self.links.iter().enumerate() {
            for i in 0..m {
                let xs = if e.rank_in.is_empty() {
                    match inputs {
                        Some(x) if x.len() == m => vec![x[i].clone()],
                        _ => {
                            return Err(Error::Usage(format!(
                                "MultiNodeChainList: component {k} on rank {me} takes the \
                                 model's input; pass {m} input micro-batches"
                            )))
                        }
                    }
                } else {
                    let mut xs = Vec::with_capacity(e.rank_in.len());
                    for &r in &e.rank_in {
                        xs.push(if r == me {
                            queue.pop_front().ok_or_else(|| {
                                Error::Usage(format!(
                                    "MultiNodeChainList: component {k} on rank {me} reads its \
                                     own queue, but no earlier component sent to rank {me}"
                                ))
                            })?
                        } else {
                            recv(&self.comm, r, delegate.take().as_ref())?
                        });
                    }
                    xs
                };
                // Each micro-batch leaves as soon as it is computed: the next
                // stage starts on it while this one computes the next.
                let y = e.link.forward(&xs)?;
                if e.rank_out.is_empty() {
                    outputs.push(y);
                    continue;
                }
                for &r in &e.rank_out {
                    if r == me {
                        queue.push_back(y.clone());
                    } else {
                        delegate = Some(send(&y, &self.comm, r)?);
                    }
                }
            }
        }
        if !queue.is_empty() {
            return Err(Error::Usage(format!(
                "MultiNodeChainList: {} items sent by rank {me} to itself were never read by a \
                 later component",
                queue.len()
            )));
        }
        Ok(ChainOutput { outputs, delegate })
    }

    /// Exchange every rank's wiring and simulate one forward's messages
    /// (sends never wait; a receive waits for its message).
    fn check_wiring(&self) -> Result<()> {
        let mine: Wiring = self
            .links
            .iter()
            .map(|e| (e.rank_in.clone(), e.rank_out.clone()))
            .collect();
        let all: Vec<Wiring> = self.comm.allgather_obj(&mine)?;
        simulate(&all)
    }
}

/// Run every rank's program: per component, receive from each of rank_in
/// (other ranks), then send to each of rank_out. Report what never completes.
fn simulate(all: &[Wiring]) -> Result<()> {
    let n = all.len();
    // in_flight[src][dst]: messages sent and not yet received.
    let mut in_flight = vec![vec![0usize; n]; n];
    // Per rank: (component, position in rank_in) reached.
    let mut at: Vec<(usize, usize)> = vec![(0, 0); n];
    loop {
        let mut progressed = false;
        for r in 0..n {
            while at[r].0 < all[r].len() {
                let (k, j) = at[r];
                let (rank_in, rank_out) = &all[r][k];
                if let Some(&src) = rank_in.get(j) {
                    if src != r {
                        if in_flight[src][r] == 0 {
                            break;
                        }
                        in_flight[src][r] -= 1;
                    }
                    at[r].1 += 1;
                } else {
                    for &dst in rank_out {
                        if dst != r {
                            in_flight[r][dst] += 1;
                        }
                    }
                    at[r] = (k + 1, 0);
                }
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    let mut problems = Vec::new();
    for r in 0..n {
        if let Some((rank_in, _)) = all[r].get(at[r].0) {
            problems.push(format!(
                "  rank {r}: component {} waits to receive from rank {}, which never sends it",
                at[r].0, rank_in[at[r].1]
            ));
        }
    }
    for (src, row) in in_flight.iter().enumerate() {
        for (dst, k) in row.iter().enumerate() {
            if *k > 0 {
                problems.push(format!(
                    "  rank {src} sends {k} message(s) to rank {dst} that no component of rank {dst} receives"
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Mismatch {
            op: "MultiNodeChainList wiring".into(),
            details: problems.join("\n"),
        })
    }
}
