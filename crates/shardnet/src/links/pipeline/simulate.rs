//! The simulation a plan comes from: the fixed orders of GPipe, 1F1B and
//! interleaved run with the chunks' costs, or zero-bubble's order made by
//! the list scheduler itself; event-driven (a rank with nothing to run
//! sleeps until an input is due).

use super::schedule::{Action, Costs, Pass, Schedule, Timeline};
use crate::{Error, Result};

/// Per-rank streams and state of the list scheduler.
struct RankState {
    /// F passes in the order this rank may start them: (v, i).
    f: Vec<(usize, usize)>,
    /// B passes likewise.
    b: Vec<(usize, usize)>,
    next_f: usize,
    next_b: usize,
    /// Finished B whose W has not run (split schedules), oldest first.
    w: std::collections::VecDeque<(usize, usize)>,
    held: usize,
    peak: usize,
    limit: usize,
    /// The whole order, for schedules that fix it up front.
    fixed: Vec<Action>,
    free_at: f64,
    busy: f64,
    order: Vec<Action>,
    /// Waiting for an input, since `slept_at`.
    asleep: bool,
    slept_at: f64,
    /// Deferring to another rank free at the same time.
    waiting: bool,
}

impl RankState {
    /// Rank `r`'s streams and limit.
    fn new(schedule: Schedule, (p, m, v): (usize, usize, usize), r: usize, fixed: bool) -> Self {
        let (f, b) = (stream(p, m, 0..v), stream(p, m, (0..v).rev()));
        let limit = limit(schedule, p, m, v, r);
        let fixed = if schedule.splits_backward() || !fixed {
            Vec::new()
        } else {
            fixed_order(&f, &b, limit)
        };
        RankState {
            f,
            b,
            fixed,
            next_f: 0,
            next_b: 0,
            w: Default::default(),
            held: 0,
            peak: 0,
            limit,
            free_at: 0.0,
            busy: 0.0,
            order: Vec::new(),
            asleep: false,
            slept_at: 0.0,
            waiting: false,
        }
    }
}

/// Micro-batches in groups of p; within a group, chunks in `chunks` order.
fn stream(p: usize, m: usize, chunks: impl Iterator<Item = usize> + Clone) -> Vec<(usize, usize)> {
    let mut s = Vec::new();
    let mut g = 0;
    while g < m {
        let group = g..(g + p).min(m);
        for v in chunks.clone() {
            for i in group.clone() {
                s.push((v, i));
            }
        }
        g += p;
    }
    s
}

/// The order of a schedule that fixes it up front (all but zero-bubble):
/// `limit − 1` forwards, then one forward and one backward in turn, then
/// the remaining backwards (GPipe's limit is every forward).
fn fixed_order(f: &[(usize, usize)], b: &[(usize, usize)], limit: usize) -> Vec<Action> {
    let act = |pass, (chunk, micro_batch): (usize, usize)| Action {
        pass,
        chunk,
        micro_batch,
    };
    let warm = (limit - 1).min(f.len());
    let mut order: Vec<Action> = f[..warm].iter().map(|&x| act(Pass::F, x)).collect();
    let mut bs = b.iter();
    for &x in &f[warm..] {
        order.push(act(Pass::F, x));
        if let Some(&y) = bs.next() {
            order.push(act(Pass::B, y));
        }
    }
    order.extend(bs.map(|&y| act(Pass::B, y)));
    order
}

/// How many (chunk, micro-batch) pairs rank r may hold.
fn limit(schedule: Schedule, p: usize, m: usize, v: usize, r: usize) -> usize {
    let all = m * v;
    let l = match schedule {
        Schedule::GPipe => all,
        // Megatron's warm-up forwards, and one more in the steady phase.
        Schedule::OneFOneB if v == 1 => p - r,
        Schedule::OneFOneB | Schedule::Interleaved => (p - r - 1) * 2 + (v - 1) * p + 1,
        Schedule::ZeroBubble => 2 * (p - r) + (v - 1) * p,
    };
    l.clamp(1, all)
}

/// When each global chunk's F and B of each micro-batch end (infinity:
/// not scheduled yet).
struct Done {
    chunks: usize,
    f: Vec<Vec<f64>>,
    b: Vec<Vec<f64>>,
}

impl Done {
    /// When chunk `c`'s F of micro-batch `i` has its input.
    fn f_ready(&self, c: usize, i: usize) -> f64 {
        if c == 0 {
            0.0
        } else {
            self.f[c - 1][i]
        }
    }

    /// When chunk `c`'s B of micro-batch `i` has its input.
    fn b_ready(&self, c: usize, i: usize) -> f64 {
        if c + 1 == self.chunks {
            self.f[c][i]
        } else {
            self.b[c + 1][i]
        }
    }
}

/// A simulated time, ordered (costs are finite and ≥ 0).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// The ranks still to run, the free first; at equal times one not
/// already waiting, then the lowest rank (a rank asleep on an input no
/// pass has been scheduled to make yet is at infinity).
struct Queue(std::collections::BTreeSet<(Time, bool, usize)>);

impl Queue {
    /// Move rank `r` (of `s`) to `at`, waiting or not.
    fn set(&mut self, r: usize, s: &mut RankState, at: f64, waiting: bool) {
        self.0.remove(&(Time(s.free_at), s.waiting, r));
        // -0.0 and 0.0 are one time.
        s.free_at = at + 0.0;
        s.waiting = waiting;
        self.0.insert((Time(s.free_at), waiting, r));
    }
}

/// The event-driven list scheduler: the free rank first (at equal times
/// one not already waiting, then the lowest); it runs the pass its order
/// or the schedule's rule picks among those whose inputs have arrived, or
/// defers to another rank free at the same time, or sleeps until an input
/// of its next passes is due to arrive — woken early when the pass making
/// one is scheduled. O(log p) per pass and per wake: O(M·V·p·log p).
pub(super) fn simulate(
    schedule: Schedule,
    p: usize,
    m: usize,
    v: usize,
    costs: &Costs,
    fixed: bool,
) -> Result<(Vec<Vec<Action>>, Timeline)> {
    let chunks = p * v;
    let split = schedule.splits_backward();
    let mut ranks: Vec<RankState> = (0..p)
        .map(|r| RankState::new(schedule, (p, m, v), r, fixed))
        .collect();
    let mut done = Done {
        chunks,
        f: vec![vec![f64::INFINITY; m]; chunks],
        b: vec![vec![f64::INFINITY; m]; chunks],
    };
    let total: usize = (if split { 3 } else { 2 }) * m * v;
    let mut makespan: f64 = 0.0;
    let mut queue = Queue((0..p).map(|r| (Time(0.0), false, r)).collect());
    let mut waiters: Vec<usize> = Vec::new();
    // The passes rank r may run next and when their inputs arrive: its
    // fixed order's next, or the next F (where allowed) and the next B.
    let next_inputs = |s: &RankState, r: usize, done: &Done| -> [Option<f64>; 3] {
        let glob = |v: usize| v * p + r;
        match s.fixed.get(s.order.len()) {
            Some(a) => [
                Some(match a.pass {
                    Pass::F => done.f_ready(glob(a.chunk), a.micro_batch),
                    _ => done.b_ready(glob(a.chunk), a.micro_batch),
                }),
                None,
                None,
            ],
            None => [
                None,
                s.f.get(s.next_f)
                    .filter(|_| s.held < s.limit)
                    .map(|&(v, i)| done.f_ready(glob(v), i)),
                s.b.get(s.next_b).map(|&(v, i)| done.b_ready(glob(v), i)),
            ],
        }
    };
    // The first of those arrivals after `t` (infinity: none is known).
    let wake_after = |s: &RankState, r: usize, done: &Done, t: f64| {
        next_inputs(s, r, done)
            .into_iter()
            .flatten()
            .filter(|&at| at > t)
            .fold(f64::INFINITY, f64::min)
    };
    let mut now = 0.0;
    while let Some(&(Time(t), _, r)) = queue.0.first() {
        if t != now {
            // Every rank that deferred at the last time has since slept.
            waiters.clear();
            now = t;
        }
        if !t.is_finite() {
            return Err(Error::Usage(format!(
                "pipeline schedule {schedule}: no rank can go on ({p} ranks, {m} \
                 micro-batches, {v} chunks per rank); this is a bug"
            )));
        }
        let s = &ranks[r];
        let glob = |v: usize| v * p + r;
        let f_next =
            s.f.get(s.next_f)
                .map(|&(v, i)| (v, i, done.f_ready(glob(v), i)));
        let b_next =
            s.b.get(s.next_b)
                .map(|&(v, i)| (v, i, done.b_ready(glob(v), i)));
        let pick = if let Some(a) = s.fixed.get(s.order.len()).copied() {
            let at = next_inputs(s, r, &done)[0].unwrap_or(f64::INFINITY);
            (at <= t).then_some((a.pass, a.chunk, a.micro_batch))
        } else if schedule == Schedule::GPipe && f_next.is_some() {
            f_next.filter(|f| f.2 <= t).map(|(v, i, _)| (Pass::F, v, i))
        } else if let Some((v, i, _)) = b_next.filter(|b| b.2 <= t) {
            Some((Pass::B, v, i))
        } else if let Some((v, i, _)) = f_next.filter(|f| s.held < s.limit && f.2 <= t) {
            Some((Pass::F, v, i))
        } else {
            s.w.front().map(|&(v, i)| (Pass::W, v, i))
        };
        let Some((pass, cv, i)) = pick else {
            let other_at_t = queue
                .0
                .iter()
                .nth(1)
                .is_some_and(|&(Time(t2), w2, _)| t2 <= t && !w2);
            let s = &mut ranks[r];
            if other_at_t {
                // Another rank acts at this same time first.
                queue.set(r, s, t, true);
                waiters.push(r);
            } else {
                // Asleep until an input of ours arrives.
                let at = wake_after(s, r, &done, t);
                s.asleep = true;
                s.slept_at = t;
                queue.set(r, s, at, false);
            }
            continue;
        };
        let c = cv * p + r;
        let cost = match pass {
            Pass::F => costs.forward[c],
            Pass::B if split => costs.backward[c] - costs.weight[c],
            Pass::B => costs.backward[c],
            Pass::W => costs.weight[c],
        };
        let end = t + cost.max(0.0);
        let s = &mut ranks[r];
        match pass {
            Pass::F => {
                s.next_f += 1;
                s.held += 1;
                s.peak = s.peak.max(s.held);
                done.f[c][i] = end;
            }
            Pass::B => {
                s.next_b += 1;
                if split {
                    s.w.push_back((cv, i));
                } else {
                    s.held -= 1;
                }
                done.b[c][i] = end;
            }
            Pass::W => {
                s.w.pop_front();
                s.held -= 1;
            }
        }
        s.order.push(Action {
            pass,
            chunk: cv,
            micro_batch: i,
        });
        s.busy += cost;
        s.asleep = false;
        makespan = makespan.max(end);
        if s.order.len() < total {
            queue.set(r, s, end, false);
        } else {
            queue.0.remove(&(Time(s.free_at), s.waiting, r));
        }
        // Every rank deferring to this one looks again, if this pass took
        // no time (its output may be theirs now); otherwise each still
        // finds nothing at t, and sleeps once no other rank acts at t.
        if end == t {
            for q in waiters.drain(..) {
                let s = &mut ranks[q];
                if s.waiting {
                    let at = s.free_at;
                    queue.set(q, s, at, false);
                }
            }
        }
        // The rank this pass sends to, if asleep, wakes when it arrives.
        let to = match pass {
            Pass::F if c + 1 < chunks => Some((c + 1) % p),
            Pass::B if c > 0 => Some((c - 1) % p),
            _ => None,
        };
        if let Some(u) = to.filter(|&u| u != r && ranks[u].asleep) {
            let at = wake_after(&ranks[u], u, &done, ranks[u].slept_at);
            queue.set(u, &mut ranks[u], at, false);
        }
    }
    let timeline = Timeline {
        makespan,
        busy: ranks.iter().map(|s| s.busy).collect(),
        peak_held: ranks.iter().map(|s| s.peak).collect(),
    };
    Ok((ranks.into_iter().map(|s| s.order).collect(), timeline))
}

#[cfg(test)]
#[path = "simulate_reference.rs"]
mod reference;

#[cfg(test)]
mod tests {
    use super::simulate;
    use crate::links::pipeline::{Costs, Schedule};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// The event-driven scheduler gives the reference scheduler's
        /// orders and timeline, bit for bit, for every schedule, fixed
        /// or not, with costs that include zeros and ties.
        #[test]
        fn the_event_driven_scheduler_matches_the_reference(
            s in 0usize..4,
            p in 1usize..7,
            m in 1usize..9,
            v in 1usize..4,
            fixed in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let schedule = Schedule::ALL[s];
            let v = if schedule == Schedule::Interleaved || schedule == Schedule::ZeroBubble { v } else { 1 };
            let chunks = p * v;
            // Costs of 0 to 3 in halves: zeros and ties are common.
            let mut x = seed;
            let mut draw = || {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % 7) as f64 / 2.0
            };
            let forward: Vec<f64> = (0..chunks).map(|_| draw()).collect();
            let weight: Vec<f64> = (0..chunks).map(|_| draw()).collect();
            let backward: Vec<f64> = weight.iter().map(|w| w + draw()).collect();
            let costs = if seed % 3 == 0 { Costs::uniform(chunks) } else { Costs { forward, backward, weight } };
            let new = simulate(schedule, p, m, v, &costs, fixed);
            let old = super::reference::simulate(schedule, p, m, v, &costs, fixed);
            match (new, old) {
                (Ok((a, t)), Ok((b, u))) => {
                    prop_assert_eq!(a, b);
                    prop_assert_eq!(t.makespan.to_bits(), u.makespan.to_bits());
                    prop_assert_eq!(t.peak_held, u.peak_held);
                    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(bits(&t.busy), bits(&u.busy));
                }
                (Err(_), Err(_)) => {}
                (n, o) => prop_assert!(false, "new {:?}, reference {:?}", n.is_ok(), o.is_ok()),
            }
        }
    }
}
