//! The list scheduler as first written: each free rank, when it finds
//! nothing to do, wakes again at every other rank's next event (O(p) wakes
//! per pass, O(p) work per wake). Kept only as the oracle the event-driven
//! [`super::simulate`] is checked against: the same orders and timeline.

use super::*;

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
                asleep: false,
                slept_at: 0.0,
                waiting: false,
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
