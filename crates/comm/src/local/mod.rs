//! The `local` backend: N ranks as threads of one process.
//!
//! All ranks of a [`launch`] share one `World`: a mutex-protected table of
//! open collective rounds and point-to-point mailboxes, and one condition
//! variable. A collective is one *round*: each rank deposits its description
//! and its tensors (reference-counted, not copied), waits until every rank of
//! the communicator has deposited, checks that the descriptions agree, and
//! builds its own result from the deposits. A `send` appends to the
//! (source, destination) mailbox and returns; `recv` waits for the head of it.
//!
//! Nothing waits forever: every wait also wakes for a failed rank (error or
//! panic), for a rank that returned while others still wait on it, and for
//! the timeout ([`super::timeout`]), whose error lists the ranks that never
//! arrived.
//!
//! `in_place` holds the in-place allreduce of host buffers (the gradients
//! of data parallelism), which reads and writes the ranks' memory directly.
//!
//! **Rounds.** A collective takes the next sequence number of its
//! communicator. From the cloned deposits (reference counts, no data) bcast,
//! scatter and alltoall hand over the other rank's tensor as is (zero copy),
//! allgather concatenates (one copy, the output), allreduce and
//! reduce_scatter fold in rank order (one pass over the inputs). The last
//! rank to take a round removes it. A wait asks "ready?" before anything
//! else, and a rank whose wait fails marks the round broken under the lock:
//! a round completes for all of its ranks or for none. A waiter spins
//! (yielding) up to 200 µs on a generation counter before it sleeps on the
//! condition variable: a futex wake-up costs tens of microseconds, the spin
//! makes a small collective ~10× faster.
//!
//! **Values, not aliases.** candle tensors are immutable except variables,
//! which optimizers update in place: a `Var` (or a tensor that is one) is
//! copied at `send`, everything else is shared, graphs never (`detach`). A
//! view of a variable (a `reshape`, a `narrow`, candle's `cat` of that one
//! tensor) is not a variable to candle and is shared, so a rank that writes
//! the variable after the call may change what a slower rank still reads:
//! callers pass a copy (`optim`'s generic gradient allreduce does).
//!
//! **Failures.** [`launch`] records the first rank whose function returned
//! an error or panicked; every pending and later call of every rank fails
//! with `PeerFailed` naming it, and `launch` returns that rank's own error.
//!
//! **Cost.** Every collective returns a fresh tensor: `tune_allocator`
//! (called by the `shardnet` command) keeps freed blocks in the process, so
//! large outputs do not page-fault on every call (a 64 MB allgather: 1.8 →
//! 9.5 GB/s). The in-place allreduce sums VGG16's 59 MB of gradients in
//! 6–7 ms on 2 ranks (29 ms through copies); the closing barrier waits for
//! ranks certain to come (every rank passed the first round).

mod in_place;
mod world;

use super::desc::{check, Desc, Kind};
use super::reduce::{fold, snapshot};
use super::{Backend, Communicator, InPlace, ReduceOp};
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
pub use world::LAUNCH_GRACE;
use world::{Limit, Round, World};

/// Run `f` on `n` ranks, each a thread with its own [`Communicator`], and
/// return their results in rank order.
///
/// If a rank returns an error or panics, every other rank's pending and later
/// communication fails with [`Error::PeerFailed`] naming it, and `launch`
/// returns [`Error::PeerFailed`] with that rank's own message.
///
/// `launch` ends within the timeout plus [`LAUNCH_GRACE`] whatever the
/// ranks do: a rank still busy outside communication that long after
/// another failed (a thread cannot be stopped from outside) ends the
/// process with the failure on stderr, as `MPI_Abort` ends an MPI job.
pub fn launch<T, F>(n: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    launch_with_timeout(n, super::timeout()?, f)
}

/// [`launch`] with an explicit wait limit instead of `SHARDNET_TIMEOUT`.
pub fn launch_with_timeout<T, F>(n: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    launch_impl(n, None, timeout, f)
}

/// [`launch`] with one rank per entry of `devices`, rank r bound to
/// `devices[r]` ([`Communicator::device`]): a model split over the GPUs of
/// one machine, ranks as threads.
///
/// ```
/// use shardnet_comm::HOST;
/// let names = shardnet_comm::launch_on(&[HOST, HOST], |comm| {
///     Ok(format!("rank {} on {:?}", comm.rank(), comm.device().location()))
/// })?;
/// assert_eq!(names.len(), 2);
/// # Ok::<(), shardnet_comm::Error>(())
/// ```
pub fn launch_on<T, F>(devices: &[Device], f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    launch_impl(devices.len(), Some(devices), super::timeout()?, f)
}

fn launch_impl<T, F>(
    n: usize,
    devices: Option<&[Device]>,
    timeout: Duration,
    f: F,
) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    if n == 0 {
        return Err(Error::Usage("launch: needs at least one rank".into()));
    }
    let world = Arc::new(World::new(n, timeout));
    let results: Vec<Option<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let w = world.clone();
                let f = &f;
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .stack_size(crate::RANK_STACK)
                    .spawn_scoped(s, move || {
                        let world = w;
                        let comm = Communicator::from_backend(Arc::new(LocalComm::world(
                            world.clone(),
                            r,
                        )));
                        let comm = match devices {
                            Some(d) => comm.on_device(d[r].clone()),
                            None => comm,
                        };
                        let out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                            || f(comm),
                        )) {
                            Ok(Ok(v)) => {
                                world.finish(r);
                                Some(v)
                            }
                            Ok(Err(e)) => {
                                world.fail(r, e.to_string());
                                None
                            }
                            Err(p) => {
                                world.fail(r, format!("panicked: {}", panic_message(&p)));
                                None
                            }
                        };
                        world.returned(r);
                        out
                    });
                if let Err(e) = &spawned {
                    world.fail(r, format!("could not start its thread: {e}"));
                    world.returned(r);
                }
                spawned
            })
            .collect();
        world.end_within_grace();
        handles
            .into_iter()
            .map(|h| h.ok().and_then(|h| h.join().ok().flatten()))
            .collect()
    });
    if let Some((rank, message)) = world.lock().failed.clone() {
        return Err(Error::PeerFailed {
            op: "launch".into(),
            rank,
            message,
        });
    }
    results
        .into_iter()
        .enumerate()
        .map(|(r, v)| {
            v.ok_or_else(|| Error::Usage(format!("launch: rank {r} could not be started")))
        })
        .collect()
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// One rank's handle on one communicator of a local world.
pub(crate) struct LocalComm {
    world: Arc<World>,
    id: String,
    /// World rank of each member, by rank in this communicator.
    members: Vec<usize>,
    rank: usize,
    seq: AtomicU64,
}

impl LocalComm {
    fn world(world: Arc<World>, rank: usize) -> Self {
        let n = world.lock().finished.len();
        LocalComm {
            world,
            id: "world".into(),
            members: (0..n).collect(),
            rank,
            seq: AtomicU64::new(0),
        }
    }

    /// One collective round: deposit, wait for all, check, return every deposit.
    fn exchange(&self, desc: Desc, tensors: Vec<Tensor>) -> Result<Vec<(Desc, Vec<Tensor>)>> {
        self.exchange_within(desc, tensors, Limit::Timeout)
    }

    /// [`LocalComm::exchange`] with its wait's limit. A rank whose wait
    /// fails breaks the round first (its deposit stays, for the others'
    /// errors, but the round never completes): a round completes for all of
    /// its ranks or for none.
    fn exchange_within(
        &self,
        desc: Desc,
        tensors: Vec<Tensor>,
        limit: Limit,
    ) -> Result<Vec<(Desc, Vec<Tensor>)>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let op = desc.op_name();
        let (n, me) = (self.members.len(), self.rank);
        let mut st = self.world.lock();
        let group = st.groups.entry(self.id.clone()).or_default();
        let round = group.rounds.entry(seq).or_insert_with(|| Round {
            deposits: vec![None; n],
            taken: 0,
            broken: false,
        });
        round.deposits[me] = Some((desc, tensors));
        drop(st);
        self.world.notify();
        let st = self.world.lock();
        let id = &self.id;
        let all = self.world.wait(
            &op,
            st,
            |st| {
                let group = st.groups.get_mut(id)?;
                let round = group.rounds.get_mut(&seq)?;
                if round.broken || round.deposits.iter().any(Option::is_none) {
                    return None;
                }
                let all: Vec<(Desc, Vec<Tensor>)> =
                    round.deposits.iter().flatten().cloned().collect();
                round.taken += 1;
                if round.taken == n {
                    group.rounds.remove(&seq);
                }
                Some(all)
            },
            |st| {
                let deposits = st
                    .groups
                    .get(id)
                    .and_then(|g| g.rounds.get(&seq))
                    .map(|r| &r.deposits);
                (0..n)
                    .filter(|r| deposits.is_none_or(|d| d[*r].is_none()))
                    .map(|r| self.members[r])
                    .collect()
            },
            |st| {
                if let Some(round) = st.groups.get_mut(id).and_then(|g| g.rounds.get_mut(&seq)) {
                    round.broken = true;
                }
            },
            limit,
        )?;
        let descs: Vec<Desc> = all.iter().map(|(d, _)| d.clone()).collect();
        check(&descs, &self.members)?;
        Ok(all)
    }
}

impl Backend for LocalComm {
    /// Sums and means (the gradients' reductions) in place; max and min
    /// through the copy.
    fn allreduce_in_place(&self, bufs: &mut [&mut [f32]], op: ReduceOp) -> Option<Result<()>> {
        let units = vec![1; bufs.len()];
        matches!(op, ReduceOp::Sum | ReduceOp::Mean)
            .then(|| self.shared(bufs, &units, InPlace::Allreduce(op)))
    }
    fn rows_in_place(
        &self,
        bufs: &mut [&mut [f32]],
        units: &[usize],
        what: InPlace,
    ) -> Option<Result<()>> {
        Some(self.shared(bufs, units, what))
    }
    fn name(&self) -> &'static str {
        "local"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn intra_rank(&self) -> usize {
        self.rank
    }
    fn intra_size(&self) -> usize {
        self.members.len()
    }
    fn world_ranks(&self) -> Vec<usize> {
        self.members.clone()
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let t = snapshot(t)?;
        let mut st = self.world.lock();
        if let Some((rank, message)) = &st.failed {
            return Err(Error::PeerFailed {
                op: "send".into(),
                rank: *rank,
                message: message.clone(),
            });
        }
        st.groups
            .entry(self.id.clone())
            .or_default()
            .mail
            .entry((self.rank, dst))
            .or_default()
            .push_back(t);
        drop(st);
        self.world.notify();
        Ok(())
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        let op = format!("recv(from rank {})", self.members[src]);
        let key = (src, self.rank);
        let st = self.world.lock();
        self.world.wait(
            &op,
            st,
            |st| st.groups.get_mut(&self.id)?.mail.get_mut(&key)?.pop_front(),
            |_| vec![self.members[src]],
            |_| {},
            Limit::Timeout,
        )
    }

    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor> {
        let mut desc = Desc::new(Kind::Bcast).root(root);
        let mut mine = Vec::new();
        if let Some(t) = t {
            desc = desc.tensor(t);
            if self.rank == root {
                mine.push(snapshot(t)?);
            }
        }
        let all = self.exchange(desc, mine)?;
        Ok(all[root].1[0].clone())
    }

    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let all = self.exchange(
            Desc::new(Kind::Gather).root(root).tensor(t),
            vec![snapshot(t)?],
        )?;
        Ok((self.rank == root).then(|| all.into_iter().map(|(_, mut ts)| ts.remove(0)).collect()))
    }

    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let ts = if self.rank == root {
            ts.unwrap_or(&[])
        } else {
            &[]
        };
        let mine = ts.iter().map(snapshot).collect::<Result<Vec<_>>>()?;
        let all = self.exchange(Desc::new(Kind::Scatter).root(root).tensors(ts), mine)?;
        Ok(all[root].1[self.rank].clone())
    }

    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let all = self.exchange(Desc::new(Kind::Allgather).tensor(t), vec![t.detach()])?;
        let parts: Vec<&Tensor> = all.iter().map(|(_, ts)| &ts[0]).collect();
        let counts = parts
            .iter()
            .map(|p| p.dim(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((Tensor::cat(&parts, 0)?, counts))
    }

    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        let mine = ts.iter().map(snapshot).collect::<Result<Vec<_>>>()?;
        let all = self.exchange(Desc::new(Kind::Alltoall).tensors(ts), mine)?;
        Ok(all
            .into_iter()
            .map(|(_, ts)| ts[self.rank].clone())
            .collect())
    }

    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let all = self.exchange(
            Desc::new(Kind::Allreduce).reduce(op).tensor(t),
            vec![t.detach()],
        )?;
        let parts: Vec<Tensor> = all.into_iter().map(|(_, mut ts)| ts.remove(0)).collect();
        fold(&parts, op)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let all = self.exchange(
            Desc::new(Kind::ReduceScatter).reduce(op).tensor(t),
            vec![t.detach()],
        )?;
        let mine = super::reduce::chunk_range(t.dim(0)?, self.size(), self.rank);
        let parts = all
            .iter()
            .map(|(_, ts)| ts[0].narrow(0, mine.start, mine.len()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        fold(&parts, op)
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Desc::new(Kind::Barrier), Vec::new())
            .map(|_| ())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>> {
        let seq = self.seq.load(Ordering::Relaxed);
        let mut desc = Desc::new(Kind::Split);
        desc.color = color.map_or(-1, i64::from);
        desc.key = key;
        let all = self.exchange(desc, Vec::new())?;
        let Some(color) = color else { return Ok(None) };
        let mut mine: Vec<(i64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, (d, _))| d.color == i64::from(color))
            .map(|(r, (d, _))| (d.key, r))
            .collect();
        mine.sort();
        let rank = mine.iter().position(|(_, r)| *r == self.rank).unwrap_or(0);
        Ok(Some(Arc::new(LocalComm {
            world: self.world.clone(),
            id: format!("{}/{seq}:{color}", self.id),
            members: mine.iter().map(|(_, r)| self.members[*r]).collect(),
            rank,
            seq: AtomicU64::new(0),
        })))
    }
}
