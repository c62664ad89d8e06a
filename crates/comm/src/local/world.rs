//! What the ranks of one launch share ([`World`]): the open rounds, the
//! mailboxes, who failed or returned, and the one wait every call makes,
//! which never waits for ever.

use crate::desc::Desc;
use crate::{Error, Result};
use candle_core::Tensor;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What all ranks of one launch share.
pub(super) struct World {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// Bumped on every change, so that a waiter can spin briefly on it
    /// before sleeping on the condition variable (a futex wake-up costs tens
    /// of microseconds, a collective on small tensors a few).
    pub(super) generation: AtomicU64,
    pub(super) timeout: Duration,
}

/// After a rank fails, how long the others have to return before the
/// process ends ([`crate::launch`]'s bound: the timeout plus this).
pub const LAUNCH_GRACE: Duration = Duration::from_secs(2);

/// How long a waiter spins before it sleeps.
pub(super) const SPIN: Duration = Duration::from_micros(200);

#[derive(Default)]
pub(super) struct State {
    /// The first rank that failed, and its message.
    pub(super) failed: Option<(usize, String)>,
    /// Ranks whose function has returned a value.
    pub(super) finished: Vec<bool>,
    /// Ranks whose thread is done, whatever the outcome.
    pub(super) returned: Vec<bool>,
    /// Per communicator (by id): open rounds and mailboxes.
    pub(super) groups: HashMap<String, Group>,
}

#[derive(Default)]
pub(super) struct Group {
    pub(super) rounds: HashMap<u64, Round>,
    pub(super) mail: HashMap<(usize, usize), VecDeque<Tensor>>,
}

pub(super) struct Round {
    pub(super) deposits: Vec<Option<(Desc, Vec<Tensor>)>>,
    pub(super) taken: usize,
    /// A rank's wait failed before the round completed: it never will.
    pub(super) broken: bool,
}

impl World {
    pub(super) fn new(n: usize, timeout: Duration) -> Self {
        World {
            state: Mutex::new(State {
                finished: vec![false; n],
                returned: vec![false; n],
                ..Default::default()
            }),
            cv: Condvar::new(),
            generation: AtomicU64::new(0),
            timeout,
        }
    }
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another rank panicked while holding it;
        // the table is still consistent (every update is a single step).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn fail(&self, rank: usize, message: String) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some((rank, message));
        }
        drop(st);
        self.notify();
    }
    pub(super) fn finish(&self, rank: usize) {
        self.lock().finished[rank] = true;
        self.notify();
    }
    /// Rank `rank`'s thread is done (whatever its outcome).
    pub(super) fn returned(&self, rank: usize) {
        self.lock().returned[rank] = true;
        self.notify();
    }

    /// Wait until every rank's thread is done. After a failure, the others
    /// get [`LAUNCH_GRACE`] to reach a call (which then fails) and return; a
    /// rank still busy outside communication after it cannot be stopped
    /// from outside, so the process ends here, with the failure, as
    /// `MPI_Abort` ends an MPI job.
    pub(super) fn end_within_grace(&self) {
        let mut st = self.lock();
        let mut failed_at: Option<Instant> = None;
        loop {
            if st.returned.iter().all(|r| *r) {
                return;
            }
            if st.failed.is_some() {
                let since = *failed_at.get_or_insert_with(Instant::now);
                if since.elapsed() >= LAUNCH_GRACE {
                    let (rank, message) = st.failed.clone().unwrap_or_default();
                    let busy: Vec<usize> = (0..st.returned.len())
                        .filter(|r| !st.returned[*r])
                        .collect();
                    eprintln!(
                        "shardnet: rank {rank} failed: {message}; rank(s) {busy:?} still busy \
                         outside communication {:.0} s later: ending the process",
                        LAUNCH_GRACE.as_secs_f64()
                    );
                    std::process::exit(1);
                }
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
    /// Wake every waiter; call after changing the state.
    pub(super) fn notify(&self) {
        self.generation.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }

    /// Wait until `ready` gives a value. `missing` lists the world ranks that
    /// the wait still needs (for errors). `ready` is asked first, so a wait
    /// whose round is complete always completes, even after a failure
    /// elsewhere. Before returning an error, `leave` withdraws the caller from
    /// what it waited on (under the lock: no rank can complete the round
    /// with it afterwards). `Limit::Settle` waits without limit and ignores
    /// failures: for ranks that are certain to arrive.
    pub(super) fn wait<'a, R>(
        &'a self,
        op: &str,
        mut st: MutexGuard<'a, State>,
        mut ready: impl FnMut(&mut State) -> Option<R>,
        missing: impl Fn(&State) -> Vec<usize>,
        leave: impl Fn(&mut State),
        limit: Limit,
    ) -> Result<R> {
        let start = Instant::now();
        let mut spun = false;
        loop {
            if let Some(r) = ready(&mut st) {
                return Ok(r);
            }
            let left = match limit {
                Limit::Settle => Duration::from_secs(1),
                Limit::Timeout => {
                    if let Some((rank, message)) = st.failed.clone() {
                        leave(&mut st);
                        return Err(Error::PeerFailed {
                            op: op.to_string(),
                            rank,
                            message,
                        });
                    }
                    let gone: Vec<usize> = missing(&st)
                        .into_iter()
                        .filter(|r| st.finished[*r])
                        .collect();
                    if let Some(&r) = gone.first() {
                        leave(&mut st);
                        return Err(Error::PeerFailed {
                            op: op.to_string(),
                            rank: r,
                            message: format!("returned without calling {op}"),
                        });
                    }
                    let left = self.timeout.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        let missing = missing(&st);
                        leave(&mut st);
                        return Err(Error::Timeout {
                            op: op.to_string(),
                            missing,
                            secs: self.timeout.as_secs_f64(),
                        });
                    }
                    left
                }
            };
            if !spun {
                // Spin (unlocked) until something changes or SPIN passes.
                let seen = self.generation.load(Ordering::Acquire);
                drop(st);
                let t = Instant::now();
                while self.generation.load(Ordering::Acquire) == seen && t.elapsed() < SPIN {
                    std::thread::yield_now();
                }
                spun = self.generation.load(Ordering::Acquire) == seen;
                st = self.lock();
                continue;
            }
            spun = false;
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How long [`World::wait`] may wait.
#[derive(Clone, Copy)]
pub(super) enum Limit {
    /// Up to the world's timeout, failing at once when a rank failed.
    Timeout,
    /// Until ready: for ranks that are certain to come (the closing barrier
    /// of the in-place allreduce, whose ranks are all inside it).
    Settle,
}
