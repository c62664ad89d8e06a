//! The tape: one rank's differentiable communication, in forward order, so
//! that backward runs it in exactly the mirrored order on every rank.
//!
//! candle's backward visits nodes in a reverse topological order that depends
//! on the shape of each rank's graph (`a + b` and `b + a` visit differently).
//! Two collectives whose backward order differed between ranks would exchange
//! each other's gradients, or wait for each other forever. So every
//! differentiable communication op takes one more input, a zero-size *token*
//! that descends from the op before it: op k depends on op k−1, and any
//! topological order runs op k's backward first. The first op of a step takes
//! a fresh zero-size `Var` as its token, so even an op whose data input is not
//! tracked is reached by backward, as its peers expect.
//!
//! The token chain also makes the rules checkable: backward must begin at the
//! last op recorded (otherwise an output or delegate was never consumed by the
//! loss), and each op runs backward once.
//!
//! There is one tape per communicator family, shared by clones and splits,
//! holding one chain by default; after a complete backward it starts
//! afresh. A pipeline runs several forward passes (micro-batches, chunks)
//! before their backwards, each pass on its own chain ([`in_chain`]): ops
//! are ordered within a pass, and one pass's backward does not wait for
//! another's. Under `no_grad` (evaluation)
//! nothing is recorded, and integer tensors never are. The token costs zero
//! bytes in forward; in backward the link from op k−1's output to op k's
//! token adds a broadcast zero to that output's gradient, once: one extra
//! pass over each op's output. The generic graph node every op is made of
//! (with CPU, CUDA and Metal forwards) is here too.

use crate::comm::Communicator;
use crate::{Error, Result};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, MetalStorage, Shape, Storage,
    Tensor, Var,
};
use std::sync::{Arc, Mutex, MutexGuard};

/// The per-rank record shared by a [`Context`], its clones and the contexts
/// split from it: its chains by id, and whether recording is off.
#[derive(Default)]
pub(crate) struct Tape {
    chains: std::collections::BTreeMap<u64, Chain>,
    no_grad: usize,
}

/// One chain of ops: those of a step, or of one pipeline micro-batch.
#[derive(Default)]
struct Chain {
    next_seq: u64,
    /// Ops whose backward has not run yet, in forward order.
    pending: Vec<(u64, String)>,
    /// The last recorded op's output; the next op's token descends from it.
    tail: Option<Tensor>,
    in_backward: bool,
}

thread_local! {
    /// The chain this thread's ops are recorded on (0 but inside
    /// [`in_chain`]).
    static CHAIN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Run `f` with this rank's differentiable communication recorded on chain
/// `id` (a pipeline's forward pass of one chunk on one micro-batch, with
/// its loss: a graph with a backward of its own), then return to the chain
/// before. Each chain is ordered on its own, so one pass's backward may run
/// while a later pass still waits for its own. Every rank of a group must
/// use the same chain for the same ops.
pub fn in_chain<R>(id: u64, f: impl FnOnce() -> R) -> R {
    let before = CHAIN.with(|c| c.replace(id));
    let out = f();
    CHAIN.with(|c| c.set(before));
    out
}

fn current_chain() -> u64 {
    CHAIN.with(|c| c.get())
}

type SharedTape = Arc<Mutex<Tape>>;

fn lock(tape: &SharedTape) -> MutexGuard<'_, Tape> {
    tape.lock().unwrap_or_else(|e| e.into_inner())
}

impl Chain {
    /// The token for the next op: the chain's tail (or a fresh root), joined
    /// with the user's delegate when that is a different tensor.
    fn token(&mut self, delegate: Option<&Tensor>, device: &candle_core::Device) -> Result<Tensor> {
        if self.in_backward {
            // A backward that failed half-way: its error was reported; start over.
            self.pending.clear();
            self.tail = None;
            self.in_backward = false;
            self.next_seq = 0;
        }
        let tail = match &self.tail {
            // The link is made only now that another op follows: a step with
            // one op pays nothing for ordering.
            Some(t) if t.elem_count() > 0 => t.apply_op1(Link)?,
            Some(t) => t.clone(),
            None => Var::zeros(0, DType::F32, device)?.as_tensor().clone(),
        };
        let tail = tail.to_device(device)?;
        Ok(match delegate {
            Some(d) if d.id() != tail.id() => tail.apply_op2(&d.to_device(device)?, Join)?,
            _ => tail,
        })
    }

    /// Called by an op's backward: it must be the last pending op.
    fn backward_of(&mut self, seq: u64, what: &str) -> Result<()> {
        match self.pending.last() {
            Some((last, _)) if *last == seq => {
                self.pending.pop();
                self.in_backward = !self.pending.is_empty();
                if self.pending.is_empty() {
                    // The step is complete: the next forward starts a new chain.
                    self.tail = None;
                    self.next_seq = 0;
                }
                Ok(())
            }
            Some((_, last)) if !self.in_backward => {
                let unreached = last.clone();
                self.in_backward = true;
                Err(Error::Usage(format!(
                    "backward began at {what}, but {unreached} came after it in forward and \
                     was never reached: its output or delegate is not part of the loss. Pass the \
                     delegate to recv or pseudo_connect it into the loss (or call backward on it)"
                )))
            }
            _ => Err(Error::Usage(format!(
                "backward reached {what}, which is not waiting for backward: each forward \
                 supports one backward, and every rank must call it"
            ))),
        }
    }
}

/// A rank's differentiable communication: a [`Communicator`] and the tape
/// that orders its backward. Every differentiable op of [`crate::functions`]
/// takes one; make one per rank (it derefs to the communicator, so plain
/// communication and `rank()` work on it too). Clones share the tape, and so
/// do the contexts [`Context::split`] makes.
///
/// Autograd state lives here and not in the communicator, so `comm` stays
/// the bottom layer and knows nothing of graphs.
#[derive(Clone)]
pub struct Context {
    comm: Communicator,
    tape: SharedTape,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({:?})", self.comm)
    }
}

impl std::ops::Deref for Context {
    type Target = Communicator;
    fn deref(&self) -> &Communicator {
        &self.comm
    }
}

impl From<Communicator> for Context {
    fn from(comm: Communicator) -> Self {
        Context::new(&comm)
    }
}

impl Context {
    /// Differentiable communication over `comm` (a clone of it), with a
    /// fresh tape.
    pub fn new(comm: &Communicator) -> Self {
        Context {
            comm: comm.clone(),
            tape: Default::default(),
        }
    }

    /// The communicator underneath.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// [`Communicator::split`], keeping this rank's tape: ops on the
    /// sub-communicator and on this one are ordered together in backward.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Context>> {
        Ok(self.comm.split(color, key)?.map(|comm| Context {
            comm,
            tape: self.tape.clone(),
        }))
    }

    /// Turn off recording of differentiable communication until the guard is
    /// dropped (on this rank; every rank must do the same). Use it for
    /// evaluation, where no rank calls backward.
    ///
    /// ```
    /// use candle_core::{DType, Tensor};
    /// use shardnet::functions::{self, Context};
    /// use shardnet::launch;
    ///
    /// launch(2, |comm| {
    ///     let ctx = Context::new(&comm);
    ///     let _eval = ctx.no_grad();
    ///     let x = Tensor::ones(2, DType::F32, ctx.device())?;
    ///     let all = functions::allgather(&ctx, &x, 0)?;
    ///     assert_eq!(all.dims(), &[4]);
    ///     assert_eq!(ctx.pending_backward(), 0);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), shardnet::Error>(())
    /// ```
    pub fn no_grad(&self) -> NoGrad {
        lock(&self.tape).no_grad += 1;
        NoGrad {
            tape: self.tape.clone(),
        }
    }

    /// How many differentiable communication ops recorded on this rank still
    /// wait for their backward (0 after a complete backward).
    pub fn pending_backward(&self) -> usize {
        lock(&self.tape)
            .chains
            .values()
            .map(|c| c.pending.len())
            .sum()
    }
}

/// While alive, differentiable communication on its [`Context`] is plain
/// communication: nothing is recorded for backward. Made by
/// [`Context::no_grad`].
pub struct NoGrad {
    tape: SharedTape,
}

impl Drop for NoGrad {
    fn drop(&mut self) {
        lock(&self.tape).no_grad -= 1;
    }
}

/// What a differentiable op hands to [`record`].
pub(crate) struct Op<'a> {
    pub ctx: &'a Context,
    /// Used in messages: "allgather" etc.
    pub name: &'static str,
    /// The data input, if this rank has one.
    pub x: Option<&'a Tensor>,
    /// An extra delegate to join (recv's).
    pub delegate: Option<&'a Tensor>,
}

/// The backward communication of one op: from dL/dy to dL/dx (`None` when
/// this rank has no data input).
pub(crate) type Backward = Box<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// Box a backward closure.
pub(crate) fn backward(
    f: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
) -> Backward {
    Box::new(f)
}

/// Run `forward` (the communication, which returns its result and its
/// backward) and put the result into the graph, on the tape. Integer data and `no_grad` skip
/// the tape: no gradient can flow through them on any rank.
pub(crate) fn record(
    op: Op<'_>,
    forward: impl FnOnce() -> Result<(Tensor, Backward)>,
) -> Result<Tensor> {
    let tape = op.ctx.tape.clone();
    let plain = lock(&tape).no_grad > 0 || op.x.is_some_and(|x| x.dtype().is_int());
    let (y, backward) = forward()?;
    if plain || y.dtype().is_int() {
        return Ok(y);
    }
    let chain = current_chain();
    let what = format!(
        "{} #{}{} on rank {} ({})",
        op.name,
        lock(&tape).chains.entry(chain).or_default().next_seq,
        if chain == 0 {
            String::new()
        } else {
            format!(" of pipeline pass chain {chain}")
        },
        op.ctx.rank(),
        match op.x {
            Some(x) => format!("input {:?}", x.dims()),
            None => format!("output {:?}", y.dims()),
        }
    );
    let token = lock(&tape)
        .chains
        .entry(chain)
        .or_default()
        .token(op.delegate, y.device())?;
    let seq = {
        let mut t = lock(&tape);
        let c = t.chains.entry(chain).or_default();
        let seq = c.next_seq;
        c.next_seq += 1;
        c.pending.push((seq, what.clone()));
        seq
    };
    let node = Node {
        out: Once::new(y.contiguous()?),
        backward,
        tape: tape.clone(),
        chain,
        seq,
        what,
    };
    // The token is the first input: candle's backward then runs the work
    // that produced x (this op's own micro-batch) before walking up the
    // chain to earlier ops, which is what lets pipeline stages overlap.
    let out = match op.x {
        Some(x) => token.apply_op2(x, node)?,
        None => token.apply_op1(node)?,
    };
    lock(&tape).chains.entry(chain).or_default().tail = Some(out.clone());
    Ok(out)
}

/// A layer's op that communicates on `ctx` inside its forward and its
/// backward (batch normalisation's statistics across ranks): `forward`
/// computes y from `x` and returns it with the backward from dL/dy to
/// dL/dx. Recorded on the tape like the ops of this module, so its backward
/// communication runs in the mirrored order on every rank.
pub(crate) fn communicating(
    ctx: &Context,
    name: &'static str,
    x: &Tensor,
    forward: impl FnOnce() -> Result<(Tensor, Backward)>,
) -> Result<Tensor> {
    record(
        Op {
            ctx,
            name,
            x: Some(x),
            delegate: None,
        },
        forward,
    )
}

/// Zeros shaped like `t`, without allocating when `t` is large.
pub(crate) fn zeros_for(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.elem_count() == 0 {
        Tensor::zeros(t.shape(), t.dtype(), t.device())
    } else {
        Tensor::zeros((), t.dtype(), t.device())?.broadcast_as(t.shape())
    }
}

/// An owned copy of a contiguous tensor's storage: a custom op must return
/// storage it owns.
pub(crate) fn owned(t: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("shardnet: differentiable communication runs on CPU tensors for now")
    };
    let r = layout.start_offset()..layout.start_offset() + layout.shape().elem_count();
    let owned = match cpu {
        CpuStorage::F32(v) => CpuStorage::F32(v[r].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[r].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[r].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[r].to_vec()),
        other => candle_core::bail!("shardnet: no gradient for dtype {:?}", other.dtype()),
    };
    Ok((owned, layout.shape().clone()))
}

/// The same, on a GPU: a fresh contiguous copy's storage (the dummy backends
/// of a build without CUDA or Metal report that they are not built in).
pub(crate) fn owned_on<S: BackendStorage>(
    t: &Tensor,
    pick: fn(&Storage) -> Option<&S>,
) -> candle_core::Result<(S, Shape)> {
    let t = t.copy()?;
    let (storage, layout) = t.storage_and_layout();
    match pick(&storage) {
        Some(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
        None => candle_core::bail!("shardnet: a graph value on another device than its op"),
    }
}

pub(crate) fn cuda_of(s: &Storage) -> Option<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Some(c),
        _ => None,
    }
}

pub(crate) fn metal_of(s: &Storage) -> Option<&MetalStorage> {
    match s {
        Storage::Metal(m) => Some(m),
        _ => None,
    }
}

/// A zero-size token on the device of `like`.
fn empty_like<S>(like: &S) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let shape = Shape::from(0);
    Ok((like.device().zeros_impl(&shape, DType::F32)?, shape))
}

/// The GPU forms of an op whose value is known before the node is made
/// (its `$field`) or is an empty token (`empty`).
macro_rules! gpu_fwd {
    (op1, $field:ident) => {
        fn cuda_fwd(
            &self,
            _: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            owned_on(&self.$field.take()?, cuda_of)
        }
        fn metal_fwd(
            &self,
            _: &MetalStorage,
            _: &Layout,
        ) -> candle_core::Result<(MetalStorage, Shape)> {
            owned_on(&self.$field.take()?, metal_of)
        }
    };
    (op2, $field:ident) => {
        fn cuda_fwd(
            &self,
            _: &CudaStorage,
            _: &Layout,
            _: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            owned_on(&self.$field.take()?, cuda_of)
        }
        fn metal_fwd(
            &self,
            _: &MetalStorage,
            _: &Layout,
            _: &MetalStorage,
            _: &Layout,
        ) -> candle_core::Result<(MetalStorage, Shape)> {
            owned_on(&self.$field.take()?, metal_of)
        }
    };
    (op1 empty) => {
        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            empty_like(s)
        }
        fn metal_fwd(
            &self,
            s: &MetalStorage,
            _: &Layout,
        ) -> candle_core::Result<(MetalStorage, Shape)> {
            empty_like(s)
        }
    };
    (op2 empty) => {
        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            _: &Layout,
            _: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            empty_like(s)
        }
        fn metal_fwd(
            &self,
            s: &MetalStorage,
            _: &Layout,
            _: &MetalStorage,
            _: &Layout,
        ) -> candle_core::Result<(MetalStorage, Shape)> {
            empty_like(s)
        }
    };
}
pub(crate) use gpu_fwd;

/// An op's forward value, handed to candle once and then let go: candle
/// keeps the op until backward, and a value held there would stay beside
/// the copy candle makes of it as the op's output (every recorded op's
/// result twice, for the whole step).
pub(crate) struct Once(Mutex<Option<Tensor>>);

impl Once {
    pub(crate) fn new(t: Tensor) -> Self {
        Once(Mutex::new(Some(t)))
    }

    /// The value, the one time the op's forward asks for it.
    pub(crate) fn take(&self) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("shardnet: an op's forward ran twice".into()))
    }
}

/// The graph node of one recorded op. Its value was computed by the op's
/// forward communication; its backward runs the op's backward communication.
struct Node {
    out: Once,
    backward: Backward,
    tape: SharedTape,
    chain: u64,
    seq: u64,
    what: String,
}

impl Node {
    fn grad(&self, x: Option<&Tensor>, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mut tape = lock(&self.tape);
        let done = {
            let c = tape.chains.entry(self.chain).or_default();
            c.backward_of(self.seq, &self.what)?;
            c.pending.is_empty() && self.chain != 0
        };
        if done {
            // A micro-batch's chain is spent: the next step makes it anew.
            tape.chains.remove(&self.chain);
        }
        drop(tape);
        let g = (self.backward)(grad)?;
        Ok(match (g, x) {
            (Some(g), Some(x)) if g.dims() != x.dims() => candle_core::bail!(
                "{}: the gradient that arrived has shape {:?}, the input {:?}",
                self.what,
                g.dims(),
                x.dims()
            ),
            (Some(g), Some(_)) => Some(g),
            (None, Some(x)) if x.track_op() => Some(zeros_for(x)?),
            _ => None,
        })
    }
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        "shardnet-comm"
    }
    gpu_fwd!(op1, out);
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.out.take()?)
    }
    fn bwd(
        &self,
        token: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.grad(None, grad)?;
        Ok(Some(zeros_for(token)?))
    }
}

impl CustomOp2 for Node {
    fn name(&self) -> &'static str {
        "shardnet-comm"
    }
    gpu_fwd!(op2, out);
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.out.take()?)
    }
    fn bwd(
        &self,
        token: &Tensor,
        x: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(zeros_for(token)?), self.grad(Some(x), grad)?))
    }
}

/// A zero-size token that descends from its input (the chain's next link).
struct Link;

impl CustomOp1 for Link {
    fn name(&self) -> &'static str {
        "shardnet-link"
    }
    gpu_fwd!(op1 empty);
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(Vec::new()), Shape::from(0)))
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(zeros_for(arg)?))
    }
}

/// A zero-size token that descends from both inputs.
struct Join;

impl CustomOp2 for Join {
    fn name(&self) -> &'static str {
        "shardnet-join"
    }
    gpu_fwd!(op2 empty);
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(Vec::new()), Shape::from(0)))
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(zeros_for(a)?), Some(zeros_for(b)?)))
    }
}

/// `x`, joined in the graph to `delegate` (see [`crate::functions::pseudo_connect`]).
pub(crate) struct Connect {
    /// `x`, contiguous.
    pub out: Once,
}

impl CustomOp2 for Connect {
    fn name(&self) -> &'static str {
        "shardnet-pseudo-connect"
    }
    gpu_fwd!(op2, out);
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.out.take()?)
    }
    fn bwd(
        &self,
        _: &Tensor,
        delegate: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(zeros_for(delegate)?)))
    }
}
