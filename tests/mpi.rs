//! The MPI backend, for real: the conformance suites (communicators and
//! differentiable communication) under `mpiexec -n 1` to `-n 8`, and the
//! failure modes (a panic, an error, an unconsumed delegate, a rank that
//! never arrives, the wrong launcher), each ending by itself.
//!
//! Needs MPICH's `mpiexec` (`.ci/run` installs it); the test fails, rather
//! than skips, when it is missing, so CI cannot pass without running it.
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn mpiexec() -> &'static str {
    if Command::new("mpiexec.mpich")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok()
    {
        "mpiexec.mpich"
    } else {
        "mpiexec"
    }
}

/// Run `shardnet <args>` under `mpiexec -n <n>`, killed after `limit` seconds.
fn run(n: usize, args: &[&str], timeout_env: &str, limit: u64) -> (Output, Duration) {
    run_program(
        &common::bin().to_string_lossy(),
        n,
        args,
        timeout_env,
        limit,
    )
}

/// Run the fault-injection program (`examples/fault_injection.rs`, built by
/// `cargo test`) with `fault` under `mpiexec -n 2`.
fn inject(fault: &str, timeout_env: &str, limit: u64) -> (Output, Duration) {
    let bin = common::fault_injection().to_string_lossy().into_owned();
    run_program(&bin, 2, &[fault], timeout_env, limit)
}

fn run_program(
    program: &str,
    n: usize,
    args: &[&str],
    timeout_env: &str,
    limit: u64,
) -> (Output, Duration) {
    let mut line = vec!["-n".to_string(), n.to_string(), program.to_string()];
    line.extend(args.iter().map(|a| a.to_string()));
    run_line(&line, timeout_env, limit)
}

/// Run `mpiexec <line>` (an MPMD line may hold several `:`-separated
/// programs), killed after `limit` seconds.
fn run_line(line: &[String], timeout_env: &str, limit: u64) -> (Output, Duration) {
    let _guard = ONE_MPI_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let t = Instant::now();
    let out = Command::new("timeout")
        .arg(limit.to_string())
        .arg(mpiexec())
        .args(line)
        .env("SHARDNET_TIMEOUT", timeout_env)
        .env("SHARDNET_DATA", data_env())
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("mpiexec (MPICH) must be installed: apt-get install mpich libmpich-dev");
    (out, t.elapsed())
}

/// One MPI job at a time: jobs poll actively, and the machine has 2 cores.
static ONE_MPI_JOB: Mutex<()> = Mutex::new(());

/// The job ended by itself, not at run_line's limit (timeout's 124): no
/// rank was left waiting.
fn ended_itself(o: &Output) {
    assert_ne!(o.status.code(), Some(124), "the job hung: {}", text(o));
}

fn text(o: &Output) -> String {
    common::output_text(o)
}

#[test]
fn conformance_suites_under_mpiexec_1_to_8() {
    for n in 1..=8 {
        let (out, _) = run(n, &["selftest", "--comm", "mpi"], "60", 120);
        let s = text(&out);
        assert!(out.status.success(), "mpiexec -n {n}: {s}");
        assert!(
            s.contains(&format!("mpi backend, {n} ranks:")) && s.contains(" 0 failed"),
            "{s}"
        );
    }
}

/// ChainerMN's hierarchical communicator over MPI processes (one node: the
/// in-node level is MPI too on the CPU): the conformance suites pass
/// through it.
#[test]
fn conformance_suites_through_the_hierarchical_communicator_under_mpiexec() {
    for n in [2, 3] {
        let args = [
            "selftest",
            "--comm",
            "mpi",
            "--communicator",
            "hierarchical",
        ];
        let (out, _) = run(n, &args, "60", 120);
        let s = text(&out);
        assert!(out.status.success(), "mpiexec -n {n}: {s}");
        assert!(
            s.contains(&format!("hierarchical backend, {n} ranks:")) && s.contains(" 0 failed"),
            "{s}"
        );
    }
}

/// Ranks started with different arguments fail at once with an error naming
/// the flag and the ranks (they used to hit an unrelated shape error or
/// wait for the timeout).
#[test]
fn ranks_started_with_different_arguments_are_refused() {
    let bin = common::bin();
    let bin = bin.to_string_lossy();
    let part = |steps: &str| -> Vec<String> {
        [
            "-n",
            "1",
            &bin,
            "train",
            "mnist-mlp",
            "--no-eval",
            "--max-steps",
            steps,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut line = part("20");
    line.push(":".into());
    line.extend(part("10"));
    let (out, _) = run_line(&line, "60", 60);
    let s = text(&out);
    ended_itself(&out);
    assert!(!out.status.success(), "{s}");
    assert!(
        s.contains("different arguments")
            && s.contains("--max-steps: 20 on rank(s) [0], 10 on rank(s) [1]"),
        "{s}"
    );
}

/// A rank whose flags do not parse (or fail their checks) before it joins
/// MPI still ends the job with its error, at once: the others, waiting in
/// `MPI_Init`, are not left to wait for ever.
#[test]
fn an_mpmd_rank_whose_flags_fail_ends_the_job() {
    let bin = common::bin();
    let bin = bin.to_string_lossy();
    for bad in ["--bogus", "--checkpoint-every=3"] {
        let mut line: Vec<String> = ["-n", "1", &bin, "train", "mnist-mlp", "--comm", "mpi"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        line.push(bad.into());
        line.push(":".into());
        line.extend(
            [
                "-n",
                "1",
                &bin,
                "train",
                "mnist-mlp",
                "--comm",
                "mpi",
                "--no-eval",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        let (out, _) = run_line(&line, "600", 60);
        let s = text(&out);
        assert_eq!(out.status.code(), Some(1), "{bad}: {s}");
        let why = match bad {
            "--bogus" => "unexpected argument '--bogus'",
            _ => "--checkpoint-every needs --checkpoint-dir",
        };
        // A hang would end at run_line's limit with timeout's 124, not 1.
        assert!(s.contains(why) && s.contains("MPI_Abort"), "{bad}: {s}");
    }
}

#[test]
fn a_panic_aborts_every_rank_with_its_name() {
    let (out, _) = inject("panic", "60", 60);
    let s = text(&out);
    ended_itself(&out);
    assert!(!out.status.success(), "{s}");
    assert!(
        s.contains("rank 1 panicked") && s.contains("MPI_Abort"),
        "{s}"
    );
}

#[test]
fn an_error_aborts_every_rank_with_its_name() {
    let (out, _) = inject("error", "60", 60);
    let s = text(&out);
    assert!(!out.status.success());
    assert!(s.contains("rank 1 failed: injected error"), "{s}");
}

#[test]
fn an_unconsumed_delegate_aborts_with_the_send_named() {
    let (out, _) = inject("unconsumed", "60", 60);
    let s = text(&out);
    ended_itself(&out);
    assert!(!out.status.success());
    assert!(
        s.contains("rank 1 failed: backward began at recv #0 on rank 1")
            && s.contains("send #1 on rank 1"),
        "{s}"
    );
}

#[test]
fn a_rank_that_never_arrives_ends_at_the_timeout() {
    let (out, _) = inject("hang", "3", 60);
    let s = text(&out);
    ended_itself(&out);
    assert!(!out.status.success());
    assert!(s.contains("recv(from rank 1) timed out after 3.0 s"), "{s}");
    // Rank 1 is busy for 5 timeouts: the job ended without waiting for it.
    assert!(!s.contains("busy rank woke"), "{s}");
}

#[test]
fn a_foreign_launcher_is_refused() {
    // Another MPI's mpiexec sets its own variables; MPICH then sees a world of 1.
    let out = Command::new(common::bin())
        .args(["demo", "--comm", "mpi"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .unwrap();
    let s = text(&out);
    assert!(!out.status.success());
    assert!(
        s.contains("MPI sees a world of 1") && s.contains("mpiexec.mpich"),
        "{s}"
    );
}

/// `shardnet train mnist-mlp` for 50 steps, saving the parameters.
fn train_args(stages: usize, m: usize, out: &std::path::Path) -> Vec<String> {
    [
        "train",
        "mnist-mlp",
        "--max-steps",
        "50",
        "--epochs",
        "1",
        "--no-eval",
        "--stages",
        &stages.to_string(),
        "--micro-batches",
        &m.to_string(),
        "--save-params",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

fn data_env() -> String {
    common::data_dir().display().to_string()
}

#[test]
fn mpi_training_over_2_and_3_ranks_equals_one_rank() {
    let dir = std::env::temp_dir().join(format!("shardnet-mpi-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fsdp = ["--data-parallel", "2", "--shard-state", "parameters"];
    let zero2 = ["--data-parallel", "2", "--shard-state", "gradients"];
    // layer1 (100 × 100) gathered 7 rows at a time (2,800 bytes).
    let blocks = [
        "--data-parallel",
        "2",
        "--shard-state",
        "parameters",
        "--gather-block-mib",
        "0.00267",
    ];
    for (n, stages, m, extra) in [
        (2, 2, 1, &[][..]),
        (2, 2, 4, &[]),
        (3, 3, 1, &[]),
        (3, 3, 2, &[]),
        // Data-parallel pipelines, sharded over the 2 groups.
        (4, 2, 2, &fsdp),
        (2, 3, 2, &zero2),
        (4, 2, 2, &blocks),
    ] {
        let one = dir.join(format!("one-{stages}-{m}.safetensors"));
        let out = Command::new(common::bin())
            .args(train_args(stages, 1, &one))
            .args(["--ranks", "1", "--comm", "local"])
            .env("SHARDNET_DATA", data_env())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let many = dir.join(format!("mpi-{n}-{stages}-{m}-{}.safetensors", extra.len()));
        let args = train_args(stages, m, &many);
        let mut args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        args.extend(["--comm", "mpi"]);
        args.extend(extra);
        let (out, _) = run(n, &args, "60", 120);
        assert!(out.status.success(), "mpiexec -n {n}: {}", text(&out));
        let a = candle_core::safetensors::load(&one, &candle_core::Device::Cpu).unwrap();
        let b = candle_core::safetensors::load(&many, &candle_core::Device::Cpu).unwrap();
        assert_eq!(a.len(), b.len());
        for (name, w) in &a {
            let g = &b[name];
            let diff = (g - w).unwrap().abs().unwrap().max_all().unwrap();
            let scale = w.abs().unwrap().max_all().unwrap();
            let rel = diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap();
            assert!(
                rel <= 1e-5,
                "n={n} M={m} {extra:?}: {name} relative error {rel:e}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_command_has_no_fault_injection() {
    let out = Command::new(common::bin())
        .args(["selftest", "--inject", "panic"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("unexpected argument '--inject'"),
        "{}",
        text(&out)
    );
}

/// VGG16 (narrow) under mpiexec: a 2 × 2 grid (output-channel parallel in a
/// group, data parallel across), ChainerMN's grouped split, and 2 replicas
/// with `--local-batch-norm` over an epoch whose last batch (1 image) leaves
/// the second without images, train what the same ranks train as threads.
#[test]
fn vgg16_under_mpiexec_equals_thread_ranks() {
    let dir = std::env::temp_dir().join(format!("shardnet-mpi-vgg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (n, kind, groups, extra) in [
        (4, "output", "2", &["--synthetic-examples", "64"][..]),
        (2, "grouped", "1", &["--synthetic-examples", "64"][..]),
        (
            2,
            "none",
            "2",
            &["--synthetic-examples", "41", "--local-batch-norm"][..],
        ),
    ] {
        let loss = |comm: &str| -> f64 {
            let m = dir.join(format!("{comm}-{kind}-{groups}.json"));
            let args: Vec<String> = [
                "train",
                "vgg16",
                "--width",
                "0.0625",
                "--batch-size",
                "8",
                "--max-steps",
                "6",
                "--no-eval",
                "--dataset",
                "synthetic",
                "--parallel-conv",
                kind,
                "--data-parallel",
                groups,
                "--comm",
                comm,
            ]
            .iter()
            .chain(extra)
            .chain(&["--metrics"])
            .map(|s| s.to_string())
            .chain([m.display().to_string()])
            .collect();
            let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
            let out = if comm == "mpi" {
                run(n, &args, "60", 120).0
            } else {
                Command::new(common::bin())
                    .args(&args)
                    .args(["--ranks", &n.to_string()])
                    .output()
                    .unwrap()
            };
            assert!(out.status.success(), "{comm} {kind}: {}", text(&out));
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
            v["epochs"][0]["train_loss"].as_f64().unwrap()
        };
        let (local, mpi) = (loss("local"), loss("mpi"));
        assert!(
            (local - mpi).abs() <= 1e-6 * local.abs(),
            "{kind} on {n}: local {local}, mpi {mpi}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tiny_head(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "face-head",
        "--classes",
        "1000",
        "--dim",
        "64",
        "--steps-per-epoch",
        "5",
        "--no-eval",
        "--comm",
        "mpi",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Under mpiexec: a stop and a resume give the uninterrupted run's
/// checkpoint byte for byte; a checkpoint of 3 thread ranks resumes under
/// `mpiexec -n 2`, equal to resuming it on 2 thread ranks.
#[test]
fn checkpoints_resume_exactly_under_mpiexec_and_across_backends() {
    let dir = std::env::temp_dir().join(format!("shardnet-mpi-ck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = |n: &str| dir.join(n).display().to_string();
    // 2 epochs of 5 steps.
    let run_mpi = |extra: &[&str]| {
        let args = tiny_head(&[extra, &["--epochs", "2"][..]].concat());
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (out, _) = run(2, &args, "60", 120);
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    run_mpi(&["--max-steps", "8", "--checkpoint-dir", &d("a")]);
    run_mpi(&[
        "--max-steps",
        "8",
        "--stop-after",
        "4",
        "--checkpoint-dir",
        &d("b"),
    ]);
    let t = run_mpi(&[
        "--max-steps",
        "8",
        "--checkpoint-dir",
        &d("b"),
        "--resume",
        &d("b"),
    ]);
    assert!(t.contains("at step 4"), "{t}");
    for r in 0..2 {
        let f = format!("step-000000008/rank-{r:05}-of-00002.safetensors");
        let (x, y) = (
            std::fs::read(dir.join("a").join(&f)),
            std::fs::read(dir.join("b").join(&f)),
        );
        let (x, y) = (x.unwrap(), y.unwrap());
        assert!(
            common::without_run_id(&x) == common::without_run_id(&y),
            "{f} differs"
        );
    }
    // 3 thread ranks write; 2 MPI ranks and 2 thread ranks resume.
    let local = |extra: &[&str]| {
        let mut args = tiny_head(&[extra, &["--epochs", "2"][..]].concat());
        args.retain(|a| a != "--comm" && a != "mpi");
        let out = Command::new(common::bin())
            .args(&args)
            .args(["--comm", "local"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
    };
    local(&[
        "--ranks",
        "3",
        "--max-steps",
        "4",
        "--checkpoint-dir",
        &d("c"),
    ]);
    run_mpi(&[
        "--max-steps",
        "8",
        "--checkpoint-dir",
        &d("mpi"),
        "--resume",
        &d("c"),
    ]);
    local(&[
        "--ranks",
        "2",
        "--max-steps",
        "8",
        "--checkpoint-dir",
        &d("thr"),
        "--resume",
        &d("c"),
    ]);
    let load = |n: &str| {
        let out = dir.join(format!("{n}.safetensors"));
        let o = Command::new(common::bin())
            .args(["consolidate", &d(n), &out.display().to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        candle_core::safetensors::load(&out, &candle_core::Device::Cpu).unwrap()
    };
    let (a, b) = (load("mpi"), load("thr"));
    assert_eq!(a.len(), b.len());
    for (name, w) in &a {
        let diff = (&b[name] - w).unwrap().abs().unwrap().max_all().unwrap();
        let diff = diff.to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-6, "{name}: {diff:e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pid of rank `rank`'s process among those whose command line holds
/// `marker` (MPICH gives each its rank in `PMI_RANK`).
fn pid_of_rank(marker: &str, rank: usize) -> Option<i32> {
    let want = format!("PMI_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        let has = |b: &[u8], s: &str| b.split(|&c| c == 0).any(|w| w == s.as_bytes());
        let cmd = String::from_utf8_lossy(&cmd);
        (cmd.contains(marker) && cmd.contains("shardnet") && has(&env, &want)).then_some(pid)
    })
}

/// A signal to mpiexec (`to_rank` None) or to one rank's process: it
/// reaches every rank (mpiexec passes it on; a rank's own is agreed on
/// after its step), every rank finishes its step, the checkpoint is
/// written, the message says how to resume, and every rank exits 128 +
/// the signal, which mpiexec reports where a rank's process was signalled
/// (a job script must not take the run as complete). Signalled itself,
/// MPICH 4.0's mpiexec reports 0 in about 3 runs of 10 though its ranks
/// exit 130 (its exit-status race, pmodels/mpich#7057): not asserted
/// there.
fn signalled_run(sig: i32, to_rank: Option<usize>) {
    let name = if sig == 2 { "SIGINT" } else { "SIGTERM" };
    let dir = std::env::temp_dir().join(format!(
        "shardnet-mpi-sig-{}-{sig}-{to_rank:?}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let ck = dir.join("ck").display().to_string();
    // One long epoch, so that the ranks print nothing while the signal
    // arrives: MPICH's mpiexec, signalled in the middle of passing on a
    // rank's output line, fails its write (EINTR) and aborts instead of
    // forwarding the signal (seen in 2 of 6 runs with an epoch line every
    // few milliseconds).
    let mut args = tiny_head(&["--epochs", "1", "--checkpoint-dir", &ck]);
    let at = args.iter().position(|a| a == "--steps-per-epoch").unwrap();
    args[at + 1] = "10000000".into();
    let child = Command::new(mpiexec())
        .args(["-n", "2", env!("CARGO_BIN_EXE_shardnet")])
        .args(&args)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    match to_rank {
        None => common::signal(&child, sig),
        Some(r) => {
            let pid = pid_of_rank(&ck, r).expect("the rank's process");
            extern "C" {
                fn kill(pid: i32, sig: i32) -> i32;
            }
            // SAFETY: kill(2) on a process this test started (through mpiexec).
            assert_eq!(unsafe { kill(pid, sig) }, 0);
        }
    }
    let out = common::ended(child, name);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("stopped by {name}")), "{err}");
    assert!(err.contains("mpiexec -n 2 "), "{err}");
    assert!(err.contains(&format!("--resume {ck}")), "{err}");
    if to_rank.is_some() {
        let code = out.status.code();
        assert_eq!(code, Some(128 + sig), "{name} to {to_rank:?}: {err}");
    }
    let steps: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .collect();
    assert_eq!(steps.len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGINT to mpiexec (Ctrl-C).
#[test]
fn sigint_to_mpiexec_writes_a_checkpoint() {
    signalled_run(2, None);
}

/// SIGINT to rank 0's process alone: mpiexec exits 130.
#[test]
fn sigint_to_rank_0_exits_130() {
    signalled_run(2, Some(0));
}

/// SIGTERM to rank 1 alone (a scheduler or a user killing one process):
/// every rank stops after the same step, and mpiexec exits 143.
#[test]
fn sigterm_to_one_rank_stops_every_rank_and_exits_143() {
    signalled_run(15, Some(1));
}

#[test]
fn every_schedule_under_mpiexec_equals_threads_bit_for_bit() {
    // 5 stages over 2 and 3 processes (uneven), 4 micro-batches; the same
    // run as thread ranks is the reference: the same sums in the same order.
    let dir = std::env::temp_dir().join(format!("shardnet-mpi-sched-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = dir.join("threads.safetensors");
    let out = Command::new(common::bin())
        .args(train_args(5, 4, &one))
        .args(["--ranks", "2", "--comm", "local", "--schedule", "gpipe"])
        .env("SHARDNET_DATA", data_env())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let a = candle_core::safetensors::load(&one, &candle_core::Device::Cpu).unwrap();
    for n in [2, 3] {
        for s in ["gpipe", "1f1b", "interleaved", "zero-bubble"] {
            if s == "interleaved" && n == 3 {
                continue; // 3 ranks × 2 chunks need 6 stages
            }
            let many = dir.join(format!("mpi-{n}-{s}.safetensors"));
            let args = train_args(5, 4, &many);
            let mut args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
            args.extend(["--comm", "mpi", "--schedule", s]);
            let (out, _) = run(n, &args, "60", 120);
            assert!(out.status.success(), "mpiexec -n {n} {s}: {}", text(&out));
            let b = candle_core::safetensors::load(&many, &candle_core::Device::Cpu).unwrap();
            assert_eq!(a.len(), b.len());
            for (name, w) in &a {
                let d = (&b[name] - w).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "n={n} {s}: {name}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kill -9 one rank's process (`rank`) of a `mpiexec -n 2` run after
/// `delay`: the job ends by itself (mpiexec takes the other rank down);
/// then its resume under mpiexec (afresh if no checkpoint was
/// finished) to step 40 ends with `straight`'s last checkpoint, byte for
/// byte but for the run id.
fn mpi_killed_and_resumed(
    dir: &std::path::Path,
    straight: &std::path::Path,
    delay: Duration,
    rank: usize,
) {
    let ck = dir.join("ck");
    let _ = std::fs::remove_dir_all(&ck);
    let args = mpi_mlp(&ck);
    {
        let _guard = ONE_MPI_JOB.lock().unwrap_or_else(|e| e.into_inner());
        let mut child = Command::new(mpiexec())
            .args(["-n", "2", env!("CARGO_BIN_EXE_shardnet")])
            .args(&args)
            .env("SHARDNET_DATA", data_env())
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let marker = ck.display().to_string();
        let pid = pid_of_rank(&marker, rank);
        eprintln!("after {delay:?}: kill -9 of rank {rank} ({pid:?})");
        match pid {
            Some(pid) => {
                extern "C" {
                    fn kill(pid: i32, sig: i32) -> i32;
                }
                // SAFETY: kill(2) on a process this test started (through
                // mpiexec); it may have ended meanwhile (ESRCH, ignored).
                unsafe { kill(pid, 9) };
            }
            // Not started yet, or already finished: end the job instead.
            None => {
                let _ = child.kill();
            }
        }
        common::ended(child, "kill -9 of one rank");
    }
    let has_checkpoint = ck.is_dir()
        && common::step_dirs(&ck)
            .iter()
            .any(|d| ck.join(d).join("manifest.json").is_file());
    eprintln!(
        "  checkpoints left: {:?}",
        ck.is_dir().then(|| common::step_dirs(&ck))
    );
    let mut resume = args.clone();
    if has_checkpoint {
        resume.extend(["--resume".to_string(), ck.display().to_string()]);
    }
    let resume: Vec<&str> = resume.iter().map(|s| s.as_str()).collect();
    let (out, _) = run(2, &resume, "60", 120);
    let t = text(&out);
    assert!(
        out.status.success() || t.contains("nothing is left to train"),
        "after killing rank {rank} at {delay:?}: {t}"
    );
    common::same_checkpoint(straight, &ck, 40);
}

/// The MLP split over 2 MPI ranks, 40 steps, a checkpoint after each.
fn mpi_mlp(ck: &std::path::Path) -> Vec<String> {
    [
        "train",
        "mnist-mlp",
        "--comm",
        "mpi",
        "--no-eval",
        "--batch-size",
        "1000",
        "--max-steps",
        "40",
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
        "--checkpoint-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([ck.display().to_string()])
    .collect()
}

/// Kill -9 of a pseudo-random rank at `n` pseudo-random moments over a
/// run (before its first checkpoint, inside checkpoint and manifest
/// writes, near its end), each resumed: bit for bit the straight run.
fn mpi_kill_loop(name: &str, n: u64) {
    let dir = std::env::temp_dir().join(format!("shardnet-mpi-kill-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let straight = dir.join("straight");
    let args = mpi_mlp(&straight);
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (out, took) = run(2, &args, "60", 120);
    assert!(out.status.success(), "{}", text(&out));
    let took = took.as_millis() as u64;
    for x in common::xorshift(0x2545_f491_4f6c_dd1d, n) {
        let delay = Duration::from_millis(200 + x % took.max(400));
        mpi_killed_and_resumed(&dir, &straight, delay, (x >> 32) as usize % 2);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kill_9_of_a_rank_under_mpiexec_then_resume_is_bit_for_bit() {
    mpi_kill_loop("few", 3);
}

/// The long form: `cargo test --release --features mpi --test mpi -- --ignored`.
#[test]
#[ignore]
fn kill_9_of_a_rank_under_mpiexec_at_20_moments_then_resume_is_bit_for_bit() {
    mpi_kill_loop("many", 20);
}
