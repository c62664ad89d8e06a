//! Pipeline schedules: which pass of which micro-batch each rank runs, and
//! in what order.
//!
//! p ranks, M micro-batches, V chunks of layers per rank. Global chunk
//! c = v·p + r lives on rank r (Megatron's interleaved placement), so the
//! data go 0 → 1 → … → p−1 → 0 → … and the last chunk is on rank p−1.
//! F is a chunk's forward, B its backward (dx and dW; under zero-bubble dx
//! only) and W its deferred weight gradients.
//!
//! | schedule | order on rank r | micro-batches held on rank r | bubble, F = 1, B = 2 (W = 1 when split) |
//! |----------|-----------------|-----------------------------|-----------------------------|
//! | `gpipe` | every F, then every B | M | (p−1)/(M+p−1) |
//! | `1f1b` | p−1−r F, then one F and one B in turn, then the last B | p − r | (p−1)/(M+p−1) |
//! | `interleaved` | Megatron's: (p−r−1)·2 + (V−1)·p F over V chunks (micro-batches in groups of p), then F and B in turn | that + 1, of 1/V the size | (p−1)/(V·M+p−1) when p divides M |
//! | `zero-bubble` | B first, then F while fewer than 2(p − r) are held, else W (B is dx only; W the deferred dW) | 2(p − r) | p = 2, M = 8: 0.040 (1F1B 0.111) |
//!
//! GPipe, 1F1B and interleaved fix each rank's order up front (above); the
//! simulation below runs those orders with the chunks' costs and reports
//! their time, bubble and memory. An interleaved order with M not a multiple
//! of p can wait in a circle (Megatron refuses such M): the simulation finds
//! that and falls back to the list scheduler's greedy order under the same
//! limit. Zero-bubble's order is made by the list scheduler itself: it
//! simulates every rank with the stage costs and each rank, when free, takes
//! by the schedule's rule the next pass whose input has arrived — a B before
//! an F, an F only while fewer micro-batches than its limit are held, a W
//! when nothing else is ready, so the weight gradients fill the time a rank
//! would wait. Either way the recorded order comes from one valid execution,
//! so it completes for any real timing (a pass only waits for passes
//! recorded before it).
//!
//! Every schedule runs each chunk's backward passes in ascending
//! micro-batch order, so the weight gradients sum in the same order and
//! every schedule trains bit-identical parameters.

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// A pipeline schedule (`--schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Every forward, then every backward (GPipe).
    GPipe,
    /// One forward, one backward (PipeDream-Flush): at most p − r
    /// micro-batches' activations on rank r.
    OneFOneB,
    /// 1F1B over V non-adjacent chunks per rank (Megatron-LM).
    Interleaved,
    /// 1F1B with each backward split into its input- and weight-gradient
    /// parts; the weight gradients fill the time ranks would wait (in the
    /// spirit of ZB-H1, with up to 2(p − r) micro-batches held).
    ZeroBubble,
}

impl Schedule {
    /// Every schedule, by name.
    pub const ALL: [Schedule; 4] = [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved,
        Schedule::ZeroBubble,
    ];

    /// The flag's word for it.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZeroBubble => "zero-bubble",
        }
    }

    /// Whether its backward leaves the weight gradients to a W pass.
    pub fn splits_backward(self) -> bool {
        self == Schedule::ZeroBubble
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Schedule {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Schedule::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "--schedule {s}: give one of gpipe, 1f1b, interleaved, zero-bubble"
                ))
            })
    }
}

/// A pass of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    F,
    /// Backward (input gradient; also the weight gradients unless the
    /// schedule splits them off).
    B,
    /// The deferred weight gradients.
    W,
}

/// One thing a rank does: a pass of its chunk `chunk` (0..V, its own
/// numbering) on micro-batch `micro_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// F, B or W.
    pub pass: Pass,
    /// This rank's chunk v (global chunk v·p + r).
    pub chunk: usize,
    /// The micro-batch.
    pub micro_batch: usize,
}

/// The time each pass of each global chunk takes in the simulation (any
/// unit). `backward` is the whole backward; a split schedule runs
/// `backward − weight` in B and `weight` in W.
#[derive(Clone, Debug)]
pub struct Costs {
    /// F per global chunk.
    pub forward: Vec<f64>,
    /// B (dx and dW) per global chunk.
    pub backward: Vec<f64>,
    /// The dW part of `backward` per global chunk.
    pub weight: Vec<f64>,
}

impl Costs {
    /// F = 1, B = 2 with W = 1 for every one of `chunks` chunks.
    pub fn uniform(chunks: usize) -> Self {
        Costs {
            forward: vec![1.0; chunks],
            backward: vec![2.0; chunks],
            weight: vec![1.0; chunks],
        }
    }
}

/// What the simulation found.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// When the last pass ends.
    pub makespan: f64,
    /// Time each rank computes.
    pub busy: Vec<f64>,
    /// Per rank, the most (chunk, micro-batch) pairs whose activations are
    /// held at once (from F until B, or until W when split).
    pub peak_held: Vec<usize>,
}

impl Timeline {
    /// The fraction of the ranks' time spent waiting: 1 − Σ busy / (p ·
    /// makespan).
    pub fn bubble(&self) -> f64 {
        let p = self.busy.len() as f64;
        if self.makespan <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<f64>() / (p * self.makespan)
    }
}

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
    /// `costs` (per global chunk).
    pub fn new(
        schedule: Schedule,
        ranks: usize,
        micro_batches: usize,
        virtual_stages: usize,
        costs: &Costs,
    ) -> Result<Self> {
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
        // A fixed order that cannot complete (interleaving with M not a
        // multiple of p can wait in a circle) falls back to the list
        // scheduler's greedy order under the same limits.
        let (actions, timeline) = match simulate(schedule, p, m, v, costs, true) {
            Ok(x) => x,
            Err(_) => simulate(schedule, p, m, v, costs, false)?,
        };
        Ok(Plan {
            schedule,
            ranks: p,
            micro_batches: m,
            virtual_stages: v,
            actions,
            timeline,
        })
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

fn simulate(
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
        .map(|r| {
            let (f, b) = (stream(p, m, 0..v), stream(p, m, (0..v).rev()));
            let limit = limit(schedule, p, m, v, r);
            let fixed = if split || !fixed {
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
            }
        })
        .collect();
    // When each global chunk's F and B of each micro-batch end.
    let mut f_done = vec![vec![f64::INFINITY; m]; chunks];
    let mut b_done = vec![vec![f64::INFINITY; m]; chunks];
    let f_ready = |f_done: &Vec<Vec<f64>>, c: usize, i: usize| {
        if c == 0 {
            0.0
        } else {
            f_done[c - 1][i]
        }
    };
    let b_ready = |f_done: &Vec<Vec<f64>>, b_done: &Vec<Vec<f64>>, c: usize, i: usize| {
        if c + 1 == chunks {
            f_done[c][i]
        } else {
            b_done[c + 1][i]
        }
    };
    let total: usize = (if split { 3 } else { 2 }) * m * v;
    let mut makespan: f64 = 0.0;
    let mut waiting = vec![false; p];
    // The rank free first; at equal times one not already waiting.
    let first = |ranks: &[RankState], waiting: &[bool]| {
        (0..p)
            .filter(|&r| ranks[r].order.len() < total)
            .min_by(|&a, &b| {
                (ranks[a].free_at, waiting[a])
                    .partial_cmp(&(ranks[b].free_at, waiting[b]))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
    };
    while let Some(r) = first(&ranks, &waiting) {
        let t = ranks[r].free_at;
        let s = &ranks[r];
        let glob = |v: usize| v * p + r;
        // The candidates and when their inputs arrive.
        let f_next =
            s.f.get(s.next_f)
                .map(|&(v, i)| (v, i, f_ready(&f_done, glob(v), i)));
        let b_next =
            s.b.get(s.next_b)
                .map(|&(v, i)| (v, i, b_ready(&f_done, &b_done, glob(v), i)));
        let f_allowed = s.held < s.limit;
        let gpipe_f_first = schedule == Schedule::GPipe && f_next.is_some();
        let fixed = s.fixed.get(s.order.len()).copied();
        let pick = if let Some(a) = fixed {
            let at = match a.pass {
                Pass::F => f_ready(&f_done, glob(a.chunk), a.micro_batch),
                _ => b_ready(&f_done, &b_done, glob(a.chunk), a.micro_batch),
            };
            (at <= t).then_some((a.pass, a.chunk, a.micro_batch))
        } else if gpipe_f_first {
            f_next.filter(|f| f.2 <= t).map(|(v, i, _)| (Pass::F, v, i))
        } else if let Some((v, i, _)) = b_next.filter(|b| b.2 <= t) {
            Some((Pass::B, v, i))
        } else if let Some((v, i, _)) = f_next.filter(|f| f_allowed && f.2 <= t) {
            Some((Pass::F, v, i))
        } else {
            s.w.front().map(|&(v, i)| (Pass::W, v, i))
        };
        let s = &mut ranks[r];
        match pick {
            Some((pass, cv, i)) => {
                let c = cv * p + r;
                let cost = match pass {
                    Pass::F => costs.forward[c],
                    Pass::B if split => costs.backward[c] - costs.weight[c],
                    Pass::B => costs.backward[c],
                    Pass::W => costs.weight[c],
                };
                let end = t + cost.max(0.0);
                match pass {
                    Pass::F => {
                        s.next_f += 1;
                        s.held += 1;
                        s.peak = s.peak.max(s.held);
                        f_done[c][i] = end;
                    }
                    Pass::B => {
                        s.next_b += 1;
                        if split {
                            s.w.push_back((cv, i));
                        } else {
                            s.held -= 1;
                        }
                        b_done[c][i] = end;
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
                s.free_at = end;
                makespan = makespan.max(end);
                waiting.fill(false);
            }
            None if (0..p).any(|q| {
                q != r && !waiting[q] && ranks[q].free_at <= t && ranks[q].order.len() < total
            }) =>
            {
                // Another rank acts at this same time first.
                waiting[r] = true;
            }
            None => {
                // Wait for the next event: an input of ours arriving, or
                // another rank finishing a pass.
                let mut next = f64::INFINITY;
                let fixed_at = fixed.map(|a| match a.pass {
                    Pass::F => f_ready(&f_done, glob(a.chunk), a.micro_batch),
                    _ => b_ready(&f_done, &b_done, glob(a.chunk), a.micro_batch),
                });
                let candidates = f_next
                    .iter()
                    .filter(|_| f_allowed && fixed.is_none())
                    .chain(b_next.iter().filter(|_| fixed.is_none()))
                    .map(|x| x.2)
                    .chain(fixed_at);
                for at in candidates {
                    if at > t {
                        next = next.min(at);
                    }
                }
                for (q, o) in ranks.iter().enumerate() {
                    if q != r && o.free_at > t && o.order.len() < total {
                        next = next.min(o.free_at);
                    }
                }
                if !next.is_finite() {
                    return Err(Error::Usage(format!(
                        "pipeline schedule {schedule}: no rank can go on ({p} ranks, {m} \
                         micro-batches, {v} chunks per rank); this is a bug"
                    )));
                }
                ranks[r].free_at = next;
                waiting[r] = false;
            }
        }
    }
    let timeline = Timeline {
        makespan,
        busy: ranks.iter().map(|s| s.busy).collect(),
        peak_held: ranks.iter().map(|s| s.peak).collect(),
    };
    Ok((ranks.into_iter().map(|s| s.order).collect(), timeline))
}
