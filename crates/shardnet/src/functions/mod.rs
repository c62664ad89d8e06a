//! Differentiable communication: communication as functions in the
//! computational graph, so that one `backward()` per rank carries gradients
//! across ranks (ChainerMN's differentiable communication).
//!
//! - [`send`] / [`recv`] / [`pseudo_connect`]: point to point with delegate
//!   variables ([`point_to_point`](self#point-to-point)).
//! - [`allgather`], [`allreduce`], [`reduce_scatter`], [`bcast`], [`gather`],
//!   [`scatter`], [`alltoall`], and the `_replicated` forms: collectives, each
//!   with the backward that mirrors it (the table, with the bytes per rank,
//!   is in the `collective` source).
//! - [`copy_to`]: a move between devices.
//! - [`copy_to_shards`]: identity forward, allreduce-sum backward: replicated
//!   features entering a sharded layer; [`split_to_shards`]: this rank's
//!   slice forward, allgather backward (Megatron's copy-to and scatter-to
//!   regions; its reduce-from and gather-from are [`allreduce_replicated`]
//!   and [`allgather_replicated`]).
//! - [`sharded_softmax_cross_entropy`]: the memory-balanced sharded classifier's loss over a classifier
//!   sharded by classes (forward: two small allreduces; backward: local).
//! - [`recompute`]: f(x) without keeping f's intermediates, run again in
//!   backward (activation recomputation).
//! - [`in_chain`]: a pipeline pass's communication on a chain of the tape
//!   of its own.
//!
//! Every rank must call the same ops in the same order, as with the
//! communicator itself; backward then runs them in exactly the reverse order
//! on every rank, whatever the shape of each rank's graph (see the tape).
//! A rule follows: whatever a rank calls `backward()` on must depend on the
//! *last* differentiable op it ran (through its output or its delegate);
//! otherwise backward stops with an error naming the op left behind, rather
//! than leaving its peers waiting. Evaluation, where no rank calls backward,
//! runs under [`Context::no_grad`].
//! Integer tensors have no gradient and are communicated plainly.
//!
//! Each op is a candle custom op whose forward is a communicator call and
//! whose backward is the mirrored call. Its value is computed before the
//! node is made (the communicator works on tensors); the node's forward
//! hands out a copy of it in storage the node owns (one copy of the output:
//! a custom op must return owned storage), on CPU, CUDA or Metal alike. The
//! tape lives in [`Context`], not in the communicator: `comm` knows nothing
//! of graphs, and a context wraps any communicator (clones and
//! [`Context::split`]s share its tape).
//!
//! [`backward_from`]: backward from a given output gradient (PyTorch's
//! `y.backward(g)`).
//!
//! [`tracked`]: a parameter's value in the graph, its gradient delivered
//! into the parameter during backward (the device-generic path's layers).
//!
//! [`top1_hits`] / [`is_hit`]: the one top-1 rule (strictly the best logit,
//! no NaN in the row) of every model's accuracy.
//!
//! ## Point to point
//! | op | forward | backward | bytes (x of b bytes) |
//! |----|---------|----------|----------------------|
//! | [`send`] (x, comm, dst) | x → dst | dL/dx ← dst | b each way |
//! | [`recv`] (comm, src, delegate) | y ← src | dL/dy → src | b each way |

mod accuracy;
mod backward_from;
mod collective;
mod device;
mod margin;
mod point_to_point;
mod recompute;
mod row_update;
mod sharded_cross_entropy;
mod tape;
mod tracked;

pub use accuracy::{is_hit, top1_hits};
pub use backward_from::backward_from;
pub use collective::{
    allgather, allgather_replicated, allreduce, allreduce_replicated, alltoall, bcast,
    bcast_replicated, copy_to_shards, gather, reduce_scatter, reduce_scatter_of, scatter,
    split_to_shards,
};
pub(crate) use collective::{allgather_along, reduce_scatter_along};
pub use device::copy_to;
pub use margin::Margin;
pub use point_to_point::{pseudo_connect, recv, send};
pub use recompute::{recompute, recompute_then};
pub use row_update::{InPlaceGrad, RowUpdate, Rows};
pub use sharded_cross_entropy::{
    sharded_softmax_cross_entropy, CrossEntropyConfig, CrossEntropyOutput, CLASS_BLOCK,
};
pub(crate) use tape::{backward, communicating};
pub use tape::{in_chain, Context, NoGrad};
pub use tracked::tracked;
pub(crate) use tracked::{tracked_rows, zero_of};
