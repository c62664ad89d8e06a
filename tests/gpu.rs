//! What runs where a GPU is: the conformance suites on `cuda:0` (thread
//! ranks sharing one GPU: values through host memory), the NCCL and
//! hierarchical communicators with one GPU per rank, and a model trained
//! with `--device cuda`.
//!
//! Where this build has no `cuda` feature the tests are ignored with that
//! reason (cargo lists them as ignored); where it has one but the machine
//! has no GPU, each test prints `SKIPPED <test>: <reason>` to stderr and
//! returns. None passes silently,
//! and with `SHARDNET_REQUIRE_GPU=1` (what the bundle's `run` script of
//! scripts/build-cuda.sh sets) a missing GPU fails the test instead.
//!
//! Status: built here (no GPU); not yet run on a GPU.

mod common;

/// Print why a test does not run here (or fail, under SHARDNET_REQUIRE_GPU=1).
fn skip(test: &str, why: &str) {
    if std::env::var("SHARDNET_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("{test}: SHARDNET_REQUIRE_GPU=1 but {why}");
    }
    // Straight to stderr: the test harness captures print!/eprint!, and a
    // skip must show in an ordinary `cargo test`.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// `Some(devices)` with `n` GPUs, or `None` after saying why not.
fn gpus(test: &str, n: usize) -> Option<Vec<candle_core::Device>> {
    if !cfg!(feature = "cuda") {
        skip(
            test,
            "this build has no `cuda` feature (scripts/build-cuda.sh --tests builds one)",
        );
        return None;
    }
    match (0..n)
        .map(candle_core::Device::new_cuda)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(d) => Some(d),
        Err(e) => {
            skip(test, &format!("needs {n} GPU(s): {e}"));
            None
        }
    }
}

/// The whole conformance suite (what `shardnet selftest` runs) with every
/// thread rank computing on cuda:0: the generic path on CUDA tensors.
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a GPU and a cuda build: scripts/build-cuda.sh --tests"
)]
fn conformance_suites_on_cuda0() {
    let Some(dev) = gpus("conformance_suites_on_cuda0", 1) else {
        return;
    };
    for n in 1..=4 {
        let devices = vec![dev[0].clone(); n];
        let tallies = shardnet::comm::launch_on(&devices, |c| shardnet_conformance::run_all(&c))
            .expect("ranks");
        let t = &tallies[0];
        assert!(
            t.failed.is_empty(),
            "{n} ranks on cuda:0: {} passed, failed: {:?}",
            t.passed,
            t.failed
        );
    }
}

/// The conformance suite through NCCL, one GPU per rank (as many ranks as
/// GPUs, up to 4), and through the hierarchical communicator with two
/// made-up nodes.
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a GPU and a cuda build: scripts/build-cuda.sh --tests"
)]
fn conformance_suites_over_nccl() {
    if !cfg!(feature = "nccl") {
        skip(
            "conformance_suites_over_nccl",
            "this build has no `nccl` feature",
        );
        return;
    }
    let Some(first) = gpus("conformance_suites_over_nccl", 2) else {
        return;
    };
    let count = (2..=4)
        .take_while(|n| candle_core::Device::new_cuda(n - 1).is_ok())
        .last()
        .unwrap_or(2);
    drop(first);
    for n in 2..=count {
        let devices: Vec<_> = (0..n)
            .map(|i| candle_core::Device::new_cuda(i).expect("GPU"))
            .collect();
        for communicator in ["nccl", "hierarchical"] {
            let setup = shardnet::comm::Setup::new("cuda", communicator).expect("setup");
            let tallies = shardnet::comm::launch_on(&devices, |c| {
                let c = match setup.communicator {
                    shardnet::comm::CommKind::Hierarchical => {
                        c.hierarchical_on((c.rank() / 2) as u32)?
                    }
                    _ => setup.apply(c)?,
                };
                assert_eq!(c.backend(), communicator);
                shardnet_conformance::run_all(&c)
            })
            .expect("ranks");
            assert!(
                tallies[0].failed.is_empty(),
                "{communicator} on {n} GPUs: failed {:?}",
                tallies[0].failed
            );
        }
    }
}

/// `shardnet train mnist-mlp --device cuda` learns (the command, with the
/// real MNIST of SHARDNET_DATA).
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a GPU and a cuda build: scripts/build-cuda.sh --tests"
)]
fn mnist_mlp_trains_on_cuda() {
    if gpus("mnist_mlp_trains_on_cuda", 1).is_none() {
        return;
    }
    let out = std::process::Command::new(common::bin())
        .args([
            "train",
            "mnist-mlp",
            "--ranks",
            "1",
            "--device",
            "cuda",
            "--epochs",
            "1",
            "--max-steps",
            "200",
            "--batch-size",
            "100",
        ])
        .output()
        .expect("run shardnet");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
}

/// Ranks share GPUs (runs anywhere: the choice is arithmetic on the node's
/// rank and GPU counts): rank r of a node with g GPUs on `cuda:(r mod g)`,
/// every GPU used and none holding two ranks more than another; the
/// start-up line says so; NCCL is refused exactly where two ranks would
/// share a GPU, with NCCL's own reason and what to do.
#[test]
fn ranks_share_gpus_and_nccl_refuses_a_shared_gpu() {
    use shardnet::comm::{gpu_of, gpu_placement, nccl_fits};
    for gpus in 1..=4 {
        for ranks in 1..=9 {
            let mut load = vec![0usize; gpus];
            for r in 0..ranks {
                let g = gpu_of(r, gpus);
                assert!(g < gpus, "rank {r} of {ranks} on cuda:{g} of {gpus}");
                load[g] += 1;
            }
            if ranks <= gpus {
                assert!(
                    (0..ranks).all(|r| gpu_of(r, gpus) == r),
                    "{ranks} ranks, {gpus} GPUs: rank r on cuda:r"
                );
            }
            let used: Vec<_> = load.iter().copied().filter(|&n| n > 0).collect();
            assert_eq!(used.len(), ranks.min(gpus), "{ranks} ranks, {gpus} GPUs");
            assert!(
                used.iter().max().unwrap() - used.iter().min().unwrap() <= 1,
                "{ranks} ranks on {gpus} GPUs: {load:?}"
            );
            let line = gpu_placement(ranks, gpus);
            assert_eq!(line.contains("share"), ranks > gpus, "{line}");
            assert!(
                line.contains(&format!("rank {} → cuda:{}", ranks - 1, (ranks - 1) % gpus)),
                "{line}"
            );
            match nccl_fits(ranks, gpus) {
                Ok(()) => assert!(ranks <= gpus, "{ranks} ranks on {gpus} GPUs passed"),
                Err(e) => {
                    let msg = e.to_string();
                    assert!(ranks > gpus, "{ranks} ranks on {gpus} GPUs refused: {msg}");
                    assert!(
                        msg.contains("Duplicate GPU detected")
                            && msg.contains("--communicator host"),
                        "{msg}"
                    );
                }
            }
        }
    }
}

/// Two thread ranks on one GPU through NCCL: refused on both ranks before
/// NCCL is called (no hang, no NCCL error), and the same two ranks through
/// the host communicator run the conformance suite.
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a GPU and a cuda build: scripts/build-cuda.sh --tests"
)]
fn two_ranks_share_one_gpu() {
    if gpus("two_ranks_share_one_gpu", 1).is_none() {
        return;
    }
    let count = (1..=8)
        .take_while(|n| candle_core::Device::new_cuda(n - 1).is_ok())
        .last()
        .unwrap_or(1);
    let ranks = count + 1;
    if cfg!(feature = "nccl") {
        let setup = shardnet::comm::Setup::new("cuda", "nccl").expect("setup");
        let errors =
            shardnet::comm::launch(ranks, |c| Ok(setup.apply(c).err().map(|e| e.to_string())))
                .expect("ranks");
        for (r, e) in errors.iter().enumerate() {
            let e = e.as_deref().unwrap_or("accepted");
            assert!(e.contains("Duplicate GPU detected"), "rank {r}: {e}");
        }
    }
    let setup = shardnet::comm::Setup::new("cuda", "host").expect("setup");
    let tallies = shardnet::comm::launch(ranks, |c| {
        let c = setup.apply(c)?;
        shardnet_conformance::run_all(&c)
    })
    .expect("ranks");
    assert!(
        tallies[0].failed.is_empty(),
        "{ranks} ranks on {count} GPU(s): failed {:?}",
        tallies[0].failed
    );
}
