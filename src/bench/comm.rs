//! The communication benchmarks: `shardnet bench comm` measures, on 2
//! (or more) ranks, the bandwidth of send/recv (ping-pong, one way),
//! allgather, allreduce and alltoall for messages from 4 KB up, next to a
//! memcpy of the same size measured in the same run (the physical limit of
//! moving bytes in memory) and, under MPI, the same operations called
//! directly on MPICH with preallocated buffers; `shardnet bench functions`
//! what a differentiable collective's graph adds to the communication.
//!
//! Bandwidth is message bytes / time, where the message is: the tensor sent
//! (send/recv); the gathered result (allgather: each rank gives 1/n of it);
//! the reduced tensor (allreduce); everything one rank sends (alltoall).

use candle_core::{DType, Tensor};
use shardnet::comm::{self, Communicator, ReduceOp};
use shardnet::Result;
use std::time::Instant;

/// The operations measured, in table order.
pub const COMM_OPS: [&str; 4] = ["send/recv", "allgather", "allreduce", "alltoall"];

/// Run `f` on every rank, each on its device and communicator of
/// `setup`, and print the table rank 0 returns.
fn print_table(
    backend: &str,
    ranks: usize,
    setup: &comm::Setup,
    f: impl Fn(&Communicator) -> Result<Option<String>> + Sync,
) -> Result<()> {
    let rows = comm::run(backend, ranks, |c| f(&setup.apply(c)?))?;
    if let Some(Some(table)) = rows.into_iter().next() {
        println!("{table}");
    }
    Ok(())
}

/// Run the communication benchmark and print a markdown table on rank 0.
pub fn comm(
    backend: &str,
    ranks: usize,
    setup: &comm::Setup,
    max_bytes: usize,
    seconds: f64,
) -> Result<()> {
    print_table(backend, ranks, setup, |c| comm_rank(c, max_bytes, seconds))
}

fn sizes(max_bytes: usize) -> Vec<usize> {
    std::iter::successors(Some(4096usize), |s| Some(s * 4))
        .take_while(|s| *s <= max_bytes.max(4096))
        .collect()
}

/// Seconds per call of `f`, after a warm-up: the best of three windows of
/// about `seconds` / 3 each (the repetition count is rank 0's, so that
/// every rank calls `f` equally). On a shared machine the best window is
/// the one least disturbed; microsecond calls get enough repetitions.
fn time(c: &Communicator, seconds: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    c.barrier()?;
    let t = Instant::now();
    f()?;
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let reps = c.bcast_obj(
        Some(&((seconds / 3.0 / once) as usize).clamp(3, 1_000_000)),
        0,
    )?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        c.barrier()?;
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        c.barrier()?;
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    // Every rank reports rank 0's window.
    c.bcast_obj(Some(&best), 0)
}

/// Seconds per copy of `bytes` bytes with memcpy, best of a few runs.
pub fn memcpy_seconds(bytes: usize, seconds: f64) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let reps = ((seconds * 2e9 / bytes as f64) as usize).clamp(3, 5000);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn comm_rank(c: &Communicator, max_bytes: usize, seconds: f64) -> Result<Option<String>> {
    let (r, n) = (c.rank(), c.size());
    let mpi = c.backend() == "mpi";
    let mut out = vec![
        format!(
            "{} backend, {n} ranks, f32 tensors; GB/s = message bytes / time (see src/bench.rs)",
            c.backend()
        ),
        String::new(),
        format!(
            "| op | bytes | shardnet GB/s | memcpy GB/s | {}shardnet / {} |",
            if mpi { "raw MPI GB/s | " } else { "" },
            if mpi { "raw MPI" } else { "memcpy" }
        ),
        format!(
            "|---|---:|---:|---:|{}---:|",
            if mpi { "---:|" } else { "" }
        ),
    ];
    for op in COMM_OPS {
        for bytes in sizes(max_bytes) {
            let el = bytes / 4;
            let secs = match op {
                "send/recv" => {
                    let x = Tensor::ones(el, DType::F32, c.device())?;
                    time(c, seconds, || {
                        if r == 0 {
                            c.send(&x, 1)?;
                            c.recv(1)?;
                        } else if r == 1 {
                            let y = c.recv(0)?;
                            c.send(&y, 0)?;
                        }
                        Ok(())
                    })? / 2.0
                }
                "allgather" => {
                    let x = Tensor::ones(el / n, DType::F32, c.device())?;
                    time(c, seconds, || c.allgather(&x).map(|_| ()))?
                }
                "allreduce" => {
                    let x = Tensor::ones(el, DType::F32, c.device())?;
                    time(c, seconds, || c.allreduce(&x, ReduceOp::Sum).map(|_| ()))?
                }
                _ => {
                    let x = Tensor::ones(el / n * n, DType::F32, c.device())?;
                    let parts = x.chunk(n, 0)?;
                    time(c, seconds, || c.alltoall(&parts).map(|_| ()))?
                }
            };
            let raw = raw_seconds(c, op, bytes, seconds)?;
            if r == 0 {
                let ours = gbps(bytes, secs);
                let mem = gbps(bytes, memcpy_seconds(bytes, seconds / 3.0));
                let row = match raw {
                    Some(raw) => {
                        let raw = gbps(bytes, raw);
                        format!(
                            "| {op} | {} | {ours:.2} | {mem:.2} | {raw:.2} | {:.0}% |",
                            human(bytes),
                            100.0 * ours / raw
                        )
                    }
                    None => format!(
                        "| {op} | {} | {ours:.2} | {mem:.2} | {:.0}% |",
                        human(bytes),
                        100.0 * ours / mem
                    ),
                };
                eprintln!("{row}");
                out.push(row);
            }
        }
    }
    Ok((r == 0).then(|| out.join("\n")))
}

#[cfg(feature = "mpi")]
fn raw_seconds(c: &Communicator, op: &str, bytes: usize, seconds: f64) -> Result<Option<f64>> {
    if c.backend() != "mpi" {
        return Ok(None);
    }
    let mut raw = comm::raw_mpi(op, bytes)?;
    let secs = time(c, seconds, || {
        raw();
        Ok(())
    })?;
    // send/recv is timed as a round trip on both sides: one way is half.
    Ok(Some(if op == "send/recv" { secs / 2.0 } else { secs }))
}

#[cfg(not(feature = "mpi"))]
fn raw_seconds(_c: &Communicator, _op: &str, _bytes: usize, _seconds: f64) -> Result<Option<f64>> {
    Ok(None)
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MB", bytes >> 20)
    } else {
        format!("{} KB", bytes >> 10)
    }
}

/// `shardnet bench functions`: a differentiable collective's forward and
/// backward (`functions::allgather`, `functions::allreduce`, seeded backward
/// through `(y ⊙ g).sum()`) next to the same communication and arithmetic
/// called directly (forward op, then the mirrored op on g). The difference is
/// what the graph costs: the node's output copy, the token link, candle's
/// backward bookkeeping. Prints a markdown table on rank 0.
pub fn functions(
    backend: &str,
    ranks: usize,
    setup: &comm::Setup,
    max_bytes: usize,
    seconds: f64,
) -> Result<()> {
    print_table(backend, ranks, setup, |c| {
        functions_rank(c, max_bytes, seconds)
    })
}

fn functions_rank(c: &Communicator, max_bytes: usize, seconds: f64) -> Result<Option<String>> {
    use shardnet::functions as f;
    let n = c.size();
    let mut out = vec![
        format!("{} backend, {n} ranks", c.backend()),
        String::new(),
        "| op | bytes per rank | direct (ms) | in autograd (ms) | autograd / direct | same graph, no communication (ms) |".into(),
        "|---|---|---|---|---|---|".into(),
    ];
    for bytes in sizes(max_bytes).into_iter().filter(|b| *b >= 65536) {
        let cols = 256;
        let rows = (bytes / 4 / cols).max(1);
        let x = candle_core::Var::ones((rows, cols), DType::F32, c.device())?;
        for op in ["allgather", "allreduce"] {
            let out_rows = if op == "allgather" { rows * n } else { rows };
            let g = Tensor::ones((out_rows, cols), DType::F32, c.device())?;
            let direct = time(c, seconds, || {
                let y = match op {
                    "allgather" => c.allgather(x.as_tensor())?,
                    _ => c.allreduce(x.as_tensor(), ReduceOp::Sum)?,
                };
                std::hint::black_box(y.mul(&g)?.sum_all()?);
                let gx = match op {
                    "allgather" => c.reduce_scatter(&g, ReduceOp::Sum)?,
                    _ => c.allreduce(&g, ReduceOp::Sum)?,
                };
                std::hint::black_box(gx);
                Ok(())
            })?;
            let ctx = &f::Context::new(c);
            let graph = time(c, seconds, || {
                let y = match op {
                    "allgather" => f::allgather(ctx, x.as_tensor(), 0)?,
                    _ => f::allreduce(ctx, x.as_tensor(), ReduceOp::Sum)?,
                };
                std::hint::black_box(y.mul(&g)?.sum_all()?.backward()?);
                Ok(())
            })?;
            // The same graph with a local stand-in for the communication:
            // what candle's backward costs on these shapes by itself.
            let alone = time(c, seconds, || {
                let y = match op {
                    "allgather" => Tensor::cat(&vec![x.as_tensor(); n], 0)?,
                    _ => x.as_tensor().affine(1.0, 0.0)?,
                };
                std::hint::black_box(y.mul(&g)?.sum_all()?.backward()?);
                Ok(())
            })?;
            out.push(format!(
                "| {op} | {} | {:.3} | {:.3} | {:.2} | {:.3} |",
                human(bytes),
                direct * 1e3,
                graph * 1e3,
                graph / direct,
                alone * 1e3
            ));
        }
    }
    Ok((c.rank() == 0).then(|| out.join("\n")))
}
