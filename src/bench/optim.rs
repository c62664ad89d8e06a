//! `shardnet bench optim`: one optimizer step over a large parameter
//! against the memory's speed. Each step is one pass over memory (the
//! value, its gradient and the state read once, written in place), so its
//! bound is the bytes it moves at the rate of the simplest such pass,
//! a ← a + s·b in place (STREAM's triad without a third array: no write
//! of a line that was not read first), on the same threads in the same
//! run. `memcpy` is no bound here: its destination lines are fetched
//! before they are written, a third of its traffic unseen in its bytes.

use candle_core::Tensor;
use shardnet::nn::Param;
use shardnet::optim::{Adam, Optimizer, Sgd};
use shardnet::Result;
use std::time::Instant;

/// Median seconds of `reps` optimizer steps over a parameter of `n` f32
/// (the gradient set before each step, untimed).
fn step_seconds(
    n: usize,
    reps: usize,
    make: impl Fn(Vec<Param>) -> Result<Optimizer>,
) -> Result<f64> {
    let dev = &shardnet::comm::HOST;
    let theta: Vec<f32> = (0..n).map(|i| ((i % 1013) as f32 - 506.0) * 1e-4).collect();
    let g = Tensor::from_vec(
        (0..n)
            .map(|i| ((i % 997) as f32 - 498.0) * 1e-3)
            .collect::<Vec<f32>>(),
        n,
        dev,
    )?;
    let p = Param::new("w", &Tensor::from_vec(theta, n, dev)?)?;
    let mut opt = make(vec![p.clone()])?;
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 2 {
        p.set_grad(&g)?;
        let t = Instant::now();
        opt.step()?;
        if rep >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `shardnet bench optim`: SGD (without and with momentum) and Adam, one
/// step over `n` f32 on the kernels in use (`SHARDNET_KERNELS`), median of
/// `reps`; milliseconds, GB/s moved and the share of the in-place pass's
/// rate, as a markdown table (or one JSON object: `{"elements",
/// "in_place_gbps", "optimizers": {name: {"ms", "gbps"}}}`).
pub fn optim(n: usize, reps: usize, json: bool) -> Result<()> {
    let pass_gbps = in_place_gbps(n, reps)?;
    // (name, f32 values moved per element: read and written, optimizer)
    type Make = Box<dyn Fn(Vec<Param>) -> Result<Optimizer>>;
    let cases: [(&str, usize, Make); 3] = [
        (
            "sgd",
            3,
            Box::new(|p| Ok(Optimizer::Sgd(Sgd::new(p, 0.01, 0.0, 0.0)?))),
        ),
        (
            "sgd_momentum",
            5,
            Box::new(|p| Ok(Optimizer::Sgd(Sgd::new(p, 0.01, 0.9, 5e-4)?))),
        ),
        (
            "adam",
            7,
            Box::new(|p| Ok(Optimizer::Adam(Adam::new(p, 1e-3)?))),
        ),
    ];
    let mut rows = Vec::new();
    for (name, words, make) in cases {
        let s = step_seconds(n, reps, make)?;
        rows.push((name, s * 1e3, (4 * words * n) as f64 / s / 1e9));
    }
    if json {
        let optimizers: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(name, ms, gbps)| {
                (
                    name.to_string(),
                    serde_json::json!({"ms": ms, "gbps": gbps}),
                )
            })
            .collect();
        let v = serde_json::json!({
            "elements": n,
            "in_place_gbps": pass_gbps,
            "optimizers": optimizers,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "one step over {n} f32, {} thread(s), {:?} kernels; a ← a + s·b in place moves \
         {pass_gbps:.1} GB/s",
        shardnet::kernels::threads(),
        shardnet::kernels::kernels()
    );
    println!("| optimizer | ms | GB/s moved | of the in-place pass's rate |");
    println!("|---|---|---|---|");
    for (name, ms, gbps) in rows {
        println!(
            "| {name} | {ms:.2} | {gbps:.1} | {:.0}% |",
            100.0 * gbps / pass_gbps
        );
    }
    Ok(())
}

/// GB/s moved by a ← a + s·b over `n` f32 (two read, one written in
/// place), split over the threads as the optimizers split their pass:
/// median of `reps`.
fn in_place_gbps(n: usize, reps: usize) -> Result<f64> {
    use rayon::prelude::*;
    let mut a = vec![1f32; n];
    let b = vec![0.5f32; n];
    let part = n.div_ceil(shardnet::kernels::threads()).max(1 << 14);
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 2 {
        let t = Instant::now();
        a.par_chunks_mut(part)
            .zip(b.par_chunks(part))
            .for_each(|(a, b)| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += 1e-7 * y;
                }
            });
        std::hint::black_box(&a);
        if rep >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((12 * n) as f64 / times[times.len() / 2] / 1e9)
}
