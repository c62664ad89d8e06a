//! The small commands: each rank's share of the cores, `shardnet demo` and
//! `shardnet selftest`'s report.

use super::args::RankArgs;
use shardnet::comm::{self, Communicator, ReduceOp};
use shardnet::Result;

/// Give each rank its share of the cores (candle reads RAYON_NUM_THREADS).
pub(crate) fn share_cores(a: &RankArgs) {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Ranks sharing this machine: processes on this node under a launcher,
    // threads otherwise.
    let ranks_here = comm::launcher_local_size().unwrap_or(a.ranks).max(1);
    let share = (cores / ranks_here).max(1);
    // Set before any thread pool starts.
    std::env::set_var("RAYON_NUM_THREADS", share.to_string());
}

pub(crate) fn demo(c: Communicator) -> Result<()> {
    use candle_core::Tensor;
    let (r, n) = (c.rank(), c.size());
    let say = |what: String| println!("[{} rank {r}/{n}] {what}", c.backend());
    let x = Tensor::new(&[r as f32 + 1.0, 10.0 * (r as f32 + 1.0)], c.device())?;
    say(format!("my tensor {:?}", x.to_vec1::<f32>()?));
    let s = c.allreduce(&x, ReduceOp::Sum)?;
    say(format!("allreduce(sum) = {:?}", s.to_vec1::<f32>()?));
    let rows = Tensor::full(r as f32, (r + 1, 2), c.device())?;
    let g = c.allgather(&rows)?;
    say(format!(
        "allgather of {} rows each -> shape {:?}",
        r + 1,
        g.dims()
    ));
    let b: String = c.bcast_obj((r == 0).then_some(&"hello from rank 0".to_string()), 0)?;
    say(format!("bcast_obj: {b}"));
    if n > 1 {
        c.send(&x, (r + 1) % n)?;
        let got = c.recv((r + n - 1) % n)?;
        say(format!(
            "recv from rank {}: {:?}",
            (r + n - 1) % n,
            got.to_vec1::<f32>()?
        ));
    }
    c.barrier()
}

pub(crate) fn selftest(c: &Communicator) -> Result<usize> {
    let tally = shardnet_conformance::run_all(c)?;
    // Every rank holds the same outcome (the ranks agree after each case):
    // rank 0 reports it.
    if c.rank() == 0 {
        for (name, msg) in &tally.failed {
            eprintln!("FAILED {name}: {msg}");
        }
        if c.size() > shardnet_conformance::MAX_RANKS {
            println!(
                "note: u8 sums are checked on up to {} ranks only (a larger sum does not fit in u8)",
                shardnet_conformance::MAX_RANKS
            );
        }
        println!(
            "{} backend, {} ranks: {} passed, {} failed",
            c.backend(),
            c.size(),
            tally.passed,
            tally.failed.len()
        );
    }
    c.barrier()?;
    Ok(tally.failed.len())
}
