//! The conformance suite on the local backend (1–4 thread ranks), and the
//! failure modes: a rank that errors, panics, returns early or never arrives
//! makes every other rank fail with an error naming it, in bounded time.

use candle_core::{DType, Device, Tensor};
use shardnet::comm::{launch, launch_with_timeout, ReduceOp};
use shardnet::Error;
use shardnet_conformance::{cases, check, data, expect_eq, run_case};
use std::time::Duration;

#[test]
fn every_case_on_one_to_sixteen_ranks() {
    let mut failures = Vec::new();
    for n in 1..=16 {
        for (name, f) in cases() {
            let res = launch_with_timeout(n, Duration::from_secs(20), |c| run_case(&c, || f(&c)));
            match res {
                Err(e) => failures.push(format!("{name} on {n} ranks: {e}")),
                Ok(outcomes) => {
                    for (r, m) in outcomes.into_iter().next().unwrap_or_default() {
                        failures.push(format!("{name} on {n} ranks: rank {r}: {m}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A rank whose result is wrong goes on making the same calls: every rank
/// reports the failure, naming the rank, and the next case runs in step.
#[test]
fn a_failed_expectation_keeps_the_ranks_in_step() {
    let outcomes = bounded(4, 20.0, |c| {
        let first = run_case(&c, || {
            for k in 0..3 {
                let x = Tensor::ones(2, DType::F32, &Device::Cpu)?;
                let s = c.allreduce(&x, ReduceOp::Sum)?;
                // Rank 2 finds something wrong in the middle of the case.
                check(!(c.rank() == 2 && k == 1), || "wrong on purpose".into())?;
                expect_eq("sum", &s, &(x * 4.0)?)?;
            }
            Ok(())
        })?;
        let second = run_case(&c, || c.barrier())?;
        Ok((first, second))
    })
    .unwrap();
    for (first, second) in outcomes {
        assert_eq!(first, vec![(2, "wrong on purpose".to_string())]);
        assert!(second.is_empty(), "{second:?}");
    }
}

/// The u8 inputs are small enough that a sum over 16 ranks is exact; with
/// the old inputs (0..50) it wrapped, and the suite failed on 10+ ranks.
#[test]
fn u8_inputs_sum_in_range_on_sixteen_ranks() {
    let max: u32 = (0..16)
        .map(|r| {
            data(r, 5, 3, DType::U8, 3)
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<u8>()
                .unwrap() as u32
        })
        .sum();
    assert!(max <= 255, "{max}");
}

/// Runs `body` on `n` ranks with waits limited to `limit` seconds. A
/// launch that never returns (a hang, not a slow machine: four times the
/// limit and a minute more) ends the test process, saying so.
fn bounded<T: Send>(
    n: usize,
    limit: f64,
    body: impl Fn(shardnet::Communicator) -> shardnet::Result<T> + Sync,
) -> shardnet::Result<Vec<T>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let done = Arc::new(AtomicBool::new(false));
    let watched = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs_f64(limit * 4.0 + 60.0));
        if !watched.load(Ordering::SeqCst) {
            eprintln!("a launch with waits limited to {limit} s never returned: a hang");
            std::process::abort();
        }
    });
    let r = launch_with_timeout(n, Duration::from_secs_f64(limit), body);
    done.store(true, Ordering::SeqCst);
    r
}

#[test]
fn a_rank_error_fails_the_others_pending_calls() {
    let r = bounded(3, 20.0, |c| {
        if c.rank() == 2 {
            return Err(Error::Usage("bad batch".into()));
        }
        let x = Tensor::ones(2, DType::F32, &Device::Cpu)?;
        match c.allreduce(&x, ReduceOp::Sum) {
            Err(Error::PeerFailed {
                rank: 2, message, ..
            }) if message.contains("bad batch") => Ok(()),
            other => panic!("rank {} got {other:?}", c.rank()),
        }
    });
    match r {
        Err(Error::PeerFailed {
            rank: 2, message, ..
        }) => assert!(message.contains("bad batch")),
        other => panic!("launch returned {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_rank_panic_fails_the_others_pending_recv() {
    let r = bounded(2, 20.0, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            panic!("out of memory on purpose");
        }
        match c.recv(1) {
            Err(e @ Error::PeerFailed { rank: 1, .. }) => {
                assert!(e.to_string().contains("out of memory on purpose"), "{e}");
                Ok(())
            }
            other => panic!("got {other:?}"),
        }
    });
    let e = r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("rank 1") && e.contains("panicked"), "{e}");
}

#[test]
fn later_calls_fail_too_after_a_rank_failed() {
    let r = bounded(2, 20.0, |c| {
        if c.rank() == 0 {
            return Err(Error::Usage("stop".into()));
        }
        std::thread::sleep(Duration::from_millis(100));
        let x = Tensor::ones(1, DType::F32, &Device::Cpu)?;
        assert!(matches!(
            c.send(&x, 0),
            Err(Error::PeerFailed { rank: 0, .. })
        ));
        assert!(matches!(
            c.barrier(),
            Err(Error::PeerFailed { rank: 0, .. })
        ));
        Ok(())
    });
    assert!(matches!(r, Err(Error::PeerFailed { rank: 0, .. })));
}

#[test]
fn a_rank_that_returns_early_is_named() {
    let r = bounded(3, 20.0, |c| {
        if c.rank() == 1 {
            return Ok(());
        }
        match c.barrier() {
            Err(Error::PeerFailed {
                rank: 1, message, ..
            }) => {
                assert!(
                    message.contains("returned without calling barrier"),
                    "{message}"
                );
                Ok(())
            }
            other => panic!("got {other:?}"),
        }
    });
    assert!(r.is_ok(), "{:?}", r.err());
}

#[test]
fn timeout_lists_the_ranks_that_never_arrived() {
    // Ranks 1 and 2 stay alive (busy, not in a call) well past the 1 s timeout,
    // so the waits end by the timeout, not because a rank returned.
    let busy = || std::thread::sleep(Duration::from_secs(3));
    let r = bounded(3, 1.0, |c| {
        match c.rank() {
            0 => match c.allreduce(&Tensor::ones(1, DType::F32, &Device::Cpu)?, ReduceOp::Sum) {
                Err(Error::Timeout { missing, op, .. }) => {
                    assert_eq!(missing, vec![1, 2]);
                    assert!(op.contains("allreduce"), "{op}");
                }
                other => panic!("got {other:?}"),
            },
            1 => busy(),
            _ => {
                match c.recv(1) {
                    Err(Error::Timeout { missing, .. }) => assert_eq!(missing, vec![1]),
                    other => panic!("got {other:?}"),
                }
                busy();
            }
        }
        Ok(())
    });
    assert!(r.is_ok(), "{:?}", r.err());
}

#[test]
fn launch_returns_results_in_rank_order() {
    let r = launch(4, |c| Ok(c.rank() * 10)).unwrap();
    assert_eq!(r, vec![0, 10, 20, 30]);
    let x = data(0, 1, 1, DType::F32, 0).unwrap();
    assert_eq!(x.dims(), &[1, 1]);
}

#[test]
fn sub_communicators_of_data_and_model_parallel_groups_coexist() {
    // 4 ranks as a 2 x 2 grid: model-parallel pairs {0,1},{2,3}; data-parallel pairs {0,2},{1,3}.
    launch(4, |c| {
        let mp = c
            .split(Some((c.rank() / 2) as u32), c.rank() as i64)?
            .expect("member");
        let dp = c
            .split(Some((c.rank() % 2) as u32), c.rank() as i64)?
            .expect("member");
        let x = Tensor::new(&[c.rank() as f32], &Device::Cpu)?;
        let a = mp.allreduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        let b = dp.allreduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        let base = (c.rank() / 2 * 2) as f32;
        assert_eq!(a, base + base + 1.0);
        assert_eq!(b, (c.rank() % 2) as f32 * 2.0 + 2.0);
        Ok(())
    })
    .unwrap();
}

/// Ranks with different settings: `agree` fails on every rank, in bounded
/// time, naming each setting that differs and the ranks on each side.
#[test]
fn agree_names_the_setting_and_the_ranks_on_every_rank() {
    let errors = bounded(3, 20.0, |c| {
        let steps = if c.rank() == 2 { "10" } else { "20" };
        let res = c.agree(
            "arguments",
            &[
                ("--lr".into(), "0.001".into()),
                ("--max-steps".into(), steps.into()),
            ],
        );
        Ok(res.err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in errors {
        let e = e.expect("agree passed on differing settings");
        assert!(
            e.contains("--max-steps: 20 on rank(s) [0, 1], 10 on rank(s) [2]"),
            "{e}"
        );
        assert!(!e.contains("--lr"), "{e}");
    }
    let same = bounded(3, 20.0, |c| {
        c.agree("arguments", &[("--lr".into(), "0.001".into())])
    });
    assert!(same.is_ok());
}

/// A rank that gives up on `allreduce_slices` (its wait ran out) takes its
/// buffers back with it: a rank arriving later never completes the call
/// with them (it would write into memory the first rank has left), it
/// fails, and its own buffer keeps its values.
#[test]
fn a_rank_that_gives_up_on_allreduce_slices_takes_its_buffers_back() {
    let results = std::sync::Mutex::new(Vec::new());
    let r = launch_with_timeout(2, Duration::from_millis(300), |c| {
        let mut buf = vec![c.rank() as f32 + 1.0; 1000];
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(900));
        }
        let res = c.allreduce_slices(&mut [&mut buf[..]], ReduceOp::Sum);
        let untouched = buf.iter().all(|v| *v == c.rank() as f32 + 1.0);
        results
            .lock()
            .unwrap()
            .push((c.rank(), res.is_err(), untouched));
        res
    });
    assert!(r.is_err(), "the launch succeeded");
    let mut got = results.into_inner().unwrap();
    got.sort_by_key(|g| g.0);
    assert_eq!(got, vec![(0, true, true), (1, true, true)]);
}
