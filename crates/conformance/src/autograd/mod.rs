//! The differentiable-communication suite: every op of [`shardnet::functions`]
//! against finite differences and against the same network on one device.
//!
//! Runs on the local backend (`tests/functions.rs`, 1–4 thread ranks) and
//! under MPI (`shardnet selftest`, driven by `tests/mpi.rs`). Every rank
//! builds every rank's data and parameters from seeds, so it can compute the
//! one-device reference on its own.
//!
//! - **Finite differences** (f64): the global loss is the sum of the ranks'
//!   losses (or, for `_replicated` ops, the one loss every rank computes).
//!   Each input element of each rank is moved by ±h = 1e-5 on its rank only,
//!   all ranks recompute, and the central difference must match the analytic
//!   gradient: |a − fd| ≤ 1e-6 · max(1, |fd|). On more than 4 ranks every
//!   rank moves all its elements at once along 3 seeded directions v, and
//!   Σ_ranks a·v must match the central difference along v.
//! - **One device** (f32): each rank's parameters before and after the op;
//!   the loss and every parameter gradient must match the one-device network
//!   with relative error ≤ 1e-5 (max |got − want| / max |want|).
//!
//! Ranks' losses differ (their weights are seeded by rank) except for the
//! `_replicated` forms, so a wrong backward for either form fails.
//!
//! `common` holds the shared inputs and checks, `ops` the collectives'
//! cases, `special` the others.

mod common;
mod ops;
mod special;

pub use common::seeded;
pub(super) use common::{close, close_in, values, weighted};
pub use special::unconsumed_delegate;

use common::tape_is_empty;
use ops::{op_fd, op_network, ops, OpCase};
use shardnet::comm::Communicator;
use shardnet::functions::Context;
use shardnet::Result;
use special::{
    forms_differ, integers_plain, max_refused, no_parameters, order_mirrors, ring_fd, ring_network,
};

/// One named body, run on every rank of a communicator.
pub type Case = (String, Box<dyn Fn(&Context) -> Result<()> + Send + Sync>);

/// A case body: one rank's part.
type Body = fn(&Context) -> Result<()>;

/// Every case: each op under finite differences and in a network, and the
/// designed-out failures.
pub fn cases() -> Vec<Case> {
    let mut all: Vec<Case> = Vec::new();
    let along_dims = ops().into_iter().filter(|op| {
        [
            "allgather",
            "reduce_scatter",
            "gather",
            "scatter",
            "alltoall",
        ]
        .iter()
        .any(|p| op.name.starts_with(p))
    });
    let mut variants = ops();
    for d in [1, 2] {
        variants.extend(along_dims.clone().map(|op| OpCase { dim: d, ..op }));
    }
    for op in variants {
        let name = match op.dim {
            0 => op.name.to_string(),
            d => format!("{}_dim{d}", op.name),
        };
        let op2 = op.clone();
        all.push((
            format!("{name}_finite_differences"),
            Box::new(move |c| op_fd(c, &op)),
        ));
        all.push((
            format!("{name}_network_vs_one_device"),
            Box::new(move |c| op_network(c, &op2)),
        ));
    }
    let special: [(&str, Body); 7] = [
        ("send_recv_ring_finite_differences", ring_fd),
        ("send_recv_ring_network_vs_one_device", ring_network),
        ("backward_mirrors_forward_order", order_mirrors),
        ("backward_reaches_ops_without_parameters", no_parameters),
        ("replicated_form_is_wrong_for_distinct_losses", forms_differ),
        ("integer_tensors_pass_plainly", integers_plain),
        ("max_has_no_gradient", max_refused),
    ];
    for (name, body) in special {
        all.push((name.to_string(), Box::new(body)));
    }
    all
}

/// Run every case ([`super::Tally::run`]: the ranks agree on each outcome).
pub fn run_all(comm: &Communicator, tally: &mut super::Tally) -> Result<()> {
    for (name, body) in cases() {
        // A fresh tape per case: a failed case's pending ops stay behind.
        let cx = &Context::new(comm);
        tally.run(comm, &name, || body(cx).and_then(|_| tape_is_empty(cx)))?;
    }
    Ok(())
}
