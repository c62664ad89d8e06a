//! The data-parallel step with the optimizer's state sharded over the
//! replicas (`Optimizer::shard_state` and `optim::sharded_step`, ZeRO
//! stage one) against the plain one (`allreduce_grads`, then every rank
//! steps every element): the parameters must come out the same bits on every
//! rank after every step, and each rank's state must be the same bits as
//! the plain optimizer's state at its rows, laid out as a shard of the
//! global state. Shared by `tests/optim.rs` (CPU kernels) and
//! `tests/generic.rs` (the generic path).

use candle_core::{Device, Tensor};
use shardnet::comm::{chunk_range, launch_with_timeout, ReduceOp};
use shardnet::nn::{Param, Shard};
use shardnet::optim::{allreduce_grads, sharded_step, Optimizer, OptimizerConfig};
use std::time::Duration;

/// One comparison.
#[derive(Clone, Debug)]
pub struct Case {
    /// Data-parallel replicas (thread ranks).
    pub ranks: usize,
    /// Each parameter's shape, and the dimension along which it is a shard
    /// of a global tensor (starting at row 2 of it), if it is one.
    pub params: Vec<(Vec<usize>, Option<usize>)>,
    /// The optimizer (learning rate 0.01).
    pub optimizer: OptimizerConfig,
    /// How the gradients combine.
    pub op: ReduceOp,
    /// Steps taken.
    pub steps: usize,
    /// Seeds the values and the gradients.
    pub seed: u64,
}

/// Values in [-1, 1) from `seed` (the same on every rank for one seed).
fn values(seed: u64, n: usize) -> Vec<f32> {
    super::uniform(seed, n)
        .into_iter()
        .map(|u| (2.0 * u - 1.0) as f32)
        .collect()
}

fn tensor(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n), shape, &Device::Cpu).expect("tensor")
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("values")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// `Err` with the first difference, naming the rank, step and parameter.
pub fn check(case: &Case) -> Result<(), String> {
    let c = case.clone();
    let out = launch_with_timeout(case.ranks, Duration::from_secs(20), move |comm| {
        let (n, me) = (comm.size(), comm.rank());
        let make =
            |k: usize, (shape, dim): &(Vec<usize>, Option<usize>)| -> shardnet::Result<Param> {
                let p = Param::new(format!("p{k}"), &tensor(c.seed ^ k as u64, shape))?;
                Ok(match dim {
                    Some(d) => p.with_shard(Shard {
                        dim: *d,
                        offset: 2,
                        global: shape[*d] + 5,
                    }),
                    None => p,
                })
            };
        let sharded: Vec<Param> = c
            .params
            .iter()
            .enumerate()
            .map(|(k, s)| make(k, s))
            .collect::<shardnet::Result<_>>()?;
        let plain: Vec<Param> = c
            .params
            .iter()
            .enumerate()
            .map(|(k, s)| make(k, s))
            .collect::<shardnet::Result<_>>()?;
        let mut a = Optimizer::new(&c.optimizer, sharded.clone(), 0.01)?;
        a.shard_state(n, me)?;
        let mut b = Optimizer::new(&c.optimizer, plain.clone(), 0.01)?;
        let mut problems = Vec::new();
        for step in 0..c.steps {
            for (k, (pa, pb)) in sharded.iter().zip(&plain).enumerate() {
                let g = tensor(
                    c.seed ^ (1000 * (step as u64 + 1) + 100 * me as u64 + k as u64),
                    pa.value().dims(),
                );
                pa.set_grad(&g)?;
                pb.set_grad(&g)?;
            }
            sharded_step(&comm, &mut a, c.op)?;
            allreduce_grads(&comm, &plain, c.op)?;
            b.step()?;
            for (pa, pb) in sharded.iter().zip(&plain) {
                if bits(pa.value()) != bits(pb.value()) {
                    problems.push(format!("rank {me}, step {step}: {} differs", pa.name()));
                }
            }
        }
        // The state: this rank's rows of the plain optimizer's, as a shard.
        let plain_state = b.state();
        for (s, share) in a.state().iter().zip(a.shares().iter().flat_map(|sh| {
            // Adam has two state tensors per parameter, SGD one (none
            // without momentum): pair each with its parameter's share.
            std::iter::repeat_n(sh.clone(), c.optimizer.slots())
        })) {
            let k: usize = s
                .name
                .rsplit('/')
                .next()
                .and_then(|p| p[1..].parse().ok())
                .expect("name");
            let (shape, dim) = &c.params[k];
            let whole = plain_state
                .iter()
                .find(|t| t.name == s.name)
                .expect("plain state");
            let mine = s.with_values(|v| Ok(v.to_vec()))?;
            let full = whole.with_values(|v| Ok(v.to_vec()))?;
            let rows = shape[0];
            let unit: usize = shape[1..].iter().product();
            let expect_rows = match share {
                Some(r) => {
                    if r != chunk_range(rows, n, me) {
                        problems.push(format!("rank {me}: {} holds rows {r:?}", s.name));
                    }
                    let offset = if *dim == Some(0) { 2 } else { 0 };
                    let global = if *dim == Some(0) { rows + 5 } else { rows };
                    let want = Some(Shard {
                        dim: 0,
                        offset: offset + r.start,
                        global,
                    });
                    if s.shard != want || s.shape[0] != r.len() {
                        problems.push(format!(
                            "rank {me}: {} laid out as {:?} {:?}",
                            s.name, s.shard, s.shape
                        ));
                    }
                    r
                }
                None => {
                    let sharded_here = n > 1 && rows >= n && dim.is_none_or(|d| d == 0);
                    if sharded_here {
                        problems.push(format!("rank {me}: {} was left whole", s.name));
                    }
                    0..rows
                }
            };
            let want = &full[expect_rows.start * unit..expect_rows.end * unit];
            if mine
                .iter()
                .map(|v| v.to_bits())
                .ne(want.iter().map(|v| v.to_bits()))
            {
                problems.push(format!("rank {me}: state {} differs", s.name));
            }
        }
        Ok(problems)
    })
    .map_err(|e| e.to_string())?;
    let problems: Vec<String> = out.into_iter().flatten().collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// A few hand-picked cases over 1–4 ranks: uneven rows, fewer rows than
/// ranks, shards along dimensions 0 and 1, SGD with and without momentum,
/// Adam, sums and means (what `tests/generic.rs` runs; `tests/optim.rs`
/// adds random ones).
pub fn cases() -> Vec<Case> {
    use shardnet::optim::OptimizerKind;
    let adam = OptimizerConfig {
        kind: OptimizerKind::Adam,
        momentum: 0.0,
        weight_decay: 0.01,
    };
    let sgd = |momentum| OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum,
        weight_decay: 0.001,
    };
    let params = vec![
        (vec![7, 3, 2], None),
        (vec![5], None),
        (vec![1, 4], None),
        (vec![6, 4], Some(1)),
        (vec![9, 2], Some(0)),
    ];
    // One parameter alone (on the generic path its gradient went to the
    // other ranks as a view of its own buffer, overwritten by the rank that
    // finished first: a wrong sum, found by the random cases).
    let mut out = vec![Case {
        ranks: 2,
        params: vec![(vec![1], None)],
        optimizer: adam,
        op: ReduceOp::Sum,
        steps: 2,
        seed: 3,
    }];
    for ranks in 1..=4 {
        for (i, optimizer) in [adam, sgd(0.9), sgd(0.0)].into_iter().enumerate() {
            out.push(Case {
                ranks,
                params: params.clone(),
                optimizer,
                op: if i == 1 {
                    ReduceOp::Mean
                } else {
                    ReduceOp::Sum
                },
                steps: 3,
                seed: 17 + ranks as u64,
            });
        }
    }
    out
}
