//! Runs that can be left alone: a checkpoint or log directory belongs to
//! one run at a time, a killed run's lock and temporaries are taken over
//! by the next, a damaged or edited checkpoint is refused with the way on,
//! `--keep` removes only what checkpoints wrote, a resume repeats no log
//! line, and `kill -9` at any moment, then a resume, gives the straight
//! run's parameters bit for bit.

mod common;
use common::{bin, data_dir, same_checkpoint, shardnet, step_dirs, strings, tiny_mlp};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A fresh scratch directory for `name`.
fn scratch(name: &str) -> PathBuf {
    common::scratch("durable", name)
}

/// `shardnet <args>`: (success, output).
fn run(args: &[String]) -> (bool, String) {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (out, text) = shardnet(&a);
    (out.status.success(), text)
}

fn ok(args: &[String]) -> String {
    let (done, text) = run(args);
    assert!(done, "shardnet {}:\n{text}", args.join(" "));
    text
}

fn refused(args: &[String]) -> String {
    let (done, text) = run(args);
    assert!(!done, "shardnet {} succeeded:\n{text}", args.join(" "));
    text
}

/// `shardnet <args>` started in the background.
fn start(args: &[String]) -> Child {
    Command::new(bin())
        .args(args)
        .env("SHARDNET_DATA", data_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait until `dir`'s lock names a run (its holder has started).
fn wait_for_lock(dir: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(".lock")) {
            if !s.trim().is_empty() {
                return s;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no lock in {dir:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Item 3: two runs into one `--checkpoint-dir`: the second is refused
/// while the first runs, naming it; the first finishes untouched; once it
/// has ended, the directory is free for its resume.
#[test]
fn two_runs_cannot_share_a_checkpoint_directory() {
    let dir = scratch("two");
    let ck = dir.join("ck");
    let long = tiny_mlp(&ck, &["--epochs", "200", "--checkpoint-every", "10"]);
    let first = start(&long);
    let holder = wait_for_lock(&ck);
    let run_id = serde_json::from_str::<serde_json::Value>(&holder).unwrap()["run"]
        .as_str()
        .unwrap()
        .to_string();
    let text = refused(&tiny_mlp(&ck, &["--max-steps", "30", "--units", "50"]));
    assert!(
        text.contains(&format!("run {run_id}")) && text.contains("is writing to it"),
        "{text}"
    );
    // A resume of it while it runs: refused the same way.
    let text = refused(&tiny_mlp(
        &ck,
        &["--epochs", "200", "--resume", &ck.display().to_string()],
    ));
    assert!(text.contains("is writing to it"), "{text}");
    common::signal(&first, 2);
    let out = first.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let after: usize = err
        .split("after step ")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {err}"));
    // Ended: the lock is free, the run resumes.
    let mut resume = long.clone();
    let more = (after + 5).to_string();
    resume.extend(strings(&[
        "--max-steps",
        &more,
        "--resume",
        &ck.display().to_string(),
    ]));
    let text = ok(&resume);
    assert!(text.contains("resumed from"), "{text}");
    assert!(!text.contains("takes it over"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 3: a run killed with -9 holds nothing: the next takes its
/// directory over, saying whose it was, and removes the temporaries it
/// left in a kept checkpoint.
#[test]
fn a_killed_runs_directory_is_taken_over() {
    let dir = scratch("killed");
    let ck = dir.join("ck");
    let args = tiny_mlp(&ck, &["--epochs", "50", "--checkpoint-every", "5"]);
    let mut first = start(&args);
    let holder = wait_for_lock(&ck);
    let t = Instant::now();
    while step_dirs(&ck).len() < 2 {
        assert!(t.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let pid: serde_json::Value = serde_json::from_str(&holder).unwrap();
    // What a second signal during a write leaves: a temporary.
    let kept = ck.join(&step_dirs(&ck)[0]);
    let tmp = kept.join(".rank-00001-of-00002.safetensors.tmp-1-0");
    std::fs::write(&tmp, b"half").unwrap();
    let mut resume = args.clone();
    resume.extend(strings(&["--resume", &ck.display().to_string()]));
    let at = resume.iter().position(|a| a == "--epochs").unwrap();
    resume[at + 1] = "1".into();
    let (done, text) = run(&resume);
    // The run may have been killed past epoch 1's end.
    assert!(done || text.contains("nothing is left to train"), "{text}");
    assert!(
        text.contains(&format!("process {}", pid["pid"])) && text.contains("takes it over"),
        "{text}"
    );
    assert!(!tmp.exists(), "the temporary was left");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 9: a `--log-dir` holds one run's log: another run is refused, the
/// run's own resume appends, and no epoch appears twice.
#[test]
fn a_log_dir_belongs_to_one_run() {
    let dir = scratch("log");
    let (ck, log) = (dir.join("ck"), dir.join("log"));
    let l = log.display().to_string();
    // Stopped exactly at the end of epoch 1 (20 steps).
    ok(&tiny_mlp(
        &ck,
        &["--epochs", "2", "--stop-after", "20", "--log-dir", &l],
    ));
    let text = refused(&strings(&[
        "train",
        "mnist-arcface",
        "--max-steps",
        "2",
        "--no-eval",
        "--log-dir",
        &l,
    ]));
    assert!(text.contains("holds the log of another run"), "{text}");
    // A run of another checkpoint directory, resuming: refused too.
    let other = dir.join("other");
    ok(&tiny_mlp(&other, &["--max-steps", "3"]));
    let text = refused(&tiny_mlp(
        &other,
        &[
            "--max-steps",
            "6",
            "--resume",
            &other.display().to_string(),
            "--log-dir",
            &l,
        ],
    ));
    assert!(text.contains("holds the log of another run"), "{text}");
    let metrics = dir.join("m.json");
    ok(&tiny_mlp(
        &ck,
        &[
            "--epochs",
            "2",
            "--resume",
            &ck.display().to_string(),
            "--log-dir",
            &l,
            "--metrics",
            &metrics.display().to_string(),
        ],
    ));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(log.join("epochs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let epochs: Vec<u64> = lines.iter().map(|l| l["epoch"].as_u64().unwrap()).collect();
    assert_eq!(epochs, [1, 2], "{lines:?}");
    for l in &lines {
        assert!(l["samples_per_s"].as_f64().unwrap() > 0.0, "{l}");
    }
    let steps: Vec<u64> = std::fs::read_to_string(log.join("steps.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, (1..=40).collect::<Vec<u64>>());
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    let e = m["epochs"].as_array().unwrap();
    assert_eq!(e.len(), 2, "{m}");
    assert!(
        e.iter().all(|e| e["samples_per_s"].as_f64().unwrap() > 0.0),
        "{m}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 10: intents that cannot be met are refused before training.
#[test]
fn flags_that_would_keep_nothing_are_refused_up_front() {
    let dir = scratch("intent");
    let ck = dir.join("ck");
    let text = refused(&strings(&[
        "train",
        "mnist-mlp",
        "--max-steps",
        "30",
        "--stop-after",
        "10",
    ]));
    assert!(
        text.contains("--stop-after 10") && text.contains("--checkpoint-dir"),
        "{text}"
    );
    assert!(!text.contains("epoch 1"), "it trained first: {text}");
    ok(&tiny_mlp(&ck, &["--max-steps", "5"]));
    let text = refused(&tiny_mlp(
        &ck,
        &["--max-steps", "5", "--resume", &ck.display().to_string()],
    ));
    assert!(text.contains("nothing is left to train"), "{text}");
    // Without --checkpoint-dir a resume goes on in the directory it
    // resumed from.
    let c = ck.display().to_string();
    ok(&strings(&[
        "train",
        "mnist-mlp",
        "--ranks",
        "2",
        "--batch-size",
        "3000",
        "--no-eval",
        "--max-steps",
        "7",
        "--resume",
        &c,
    ]));
    assert_eq!(step_dirs(&ck).last().unwrap(), "step-000000007");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 4: a manifest whose loop position was edited (its SHA-256 made
/// to match) is refused naming what is impossible; one edited without
/// is refused as edited.
#[test]
fn an_impossible_loop_position_is_refused() {
    let dir = scratch("progress");
    let ck = dir.join("ck");
    ok(&tiny_mlp(&ck, &["--max-steps", "25"]));
    let step = ck.join("step-000000025");
    let manifest = step.join("manifest.json");
    let orig = std::fs::read(&manifest).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&orig).unwrap();
    let edits: [(&str, serde_json::Value); 6] = [
        ("/progress/epoch", 0.into()),
        ("/progress/step", 1_000_000_000u64.into()),
        ("/progress/in_epoch", 30.into()),
        ("/progress/correct", 1_000_000.into()),
        ("/progress/finished", serde_json::json!([])),
        ("/step", 1_000_000_000u64.into()),
    ];
    for (at, value) in edits {
        let mut e = v.clone();
        *e.pointer_mut(at).unwrap() = value.clone();
        let mut e = e.as_object().unwrap().clone();
        e.remove("manifest_sha256");
        let text = serde_json::to_vec_pretty(&e).unwrap();
        std::fs::write(&manifest, shardnet::train::checkpoint::seal_manifest(&text)).unwrap();
        let t = refused(&tiny_mlp(
            &dir.join(format!("x{}", at.len())),
            &["--max-steps", "40", "--resume", &step.display().to_string()],
        ));
        assert!(
            t.contains("not one a run can reach") || t.contains("says step"),
            "{at} = {value}: {t}"
        );
        // Unsealed: refused as edited.
        std::fs::write(&manifest, &text).unwrap();
        let t = refused(&tiny_mlp(
            &dir.join("y"),
            &["--max-steps", "40", "--resume", &step.display().to_string()],
        ));
        assert!(t.contains("edited or damaged"), "{at}: {t}");
    }
    std::fs::write(&manifest, &orig).unwrap();
    ok(&tiny_mlp(
        &dir.join("z"),
        &["--max-steps", "40", "--resume", &step.display().to_string()],
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 11: a damaged newest checkpoint names the newest intact one and
/// the command; that command then works in the same directory.
#[test]
fn a_damaged_newest_checkpoint_points_at_the_intact_one() {
    let dir = scratch("damaged");
    let ck = dir.join("ck");
    ok(&tiny_mlp(
        &ck,
        &["--max-steps", "30", "--checkpoint-every", "10"],
    ));
    let f = ck.join("step-000000030/rank-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    let c = ck.display().to_string();
    let text = refused(&tiny_mlp(&ck, &["--max-steps", "40", "--resume", &c]));
    let intact = ck.join("step-000000020").display().to_string();
    assert!(
        text.contains("corrupt") && text.contains(&format!("--resume {intact}")),
        "{text}"
    );
    let text = ok(&tiny_mlp(&ck, &["--max-steps", "40", "--resume", &intact]));
    assert!(text.contains("at step 20"), "{text}");
    assert!(ck.join("step-000000030.damaged").is_dir());
    assert_eq!(step_dirs(&ck).last().unwrap(), "step-000000040");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 11: `--keep` removes a checkpoint's own files only: a user's file
/// in a step directory stays, with the directory.
#[test]
fn keep_leaves_a_users_own_files() {
    let dir = scratch("keep");
    let ck = dir.join("ck");
    ok(&tiny_mlp(
        &ck,
        &["--max-steps", "2", "--checkpoint-every", "1"],
    ));
    let notes = ck.join("step-000000001/notes.txt");
    std::fs::write(&notes, b"mine").unwrap();
    ok(&tiny_mlp(
        &ck,
        &[
            "--max-steps",
            "4",
            "--checkpoint-every",
            "1",
            "--keep",
            "1",
            "--resume",
            &ck.display().to_string(),
        ],
    ));
    assert_eq!(std::fs::read(&notes).unwrap(), b"mine");
    let left: Vec<_> = std::fs::read_dir(ck.join("step-000000001"))
        .unwrap()
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kill -9 the run (every thread rank) after `delay`, then resume it
/// (afresh if no checkpoint was finished) to step 60: the last
/// checkpoint must equal `straight`'s.
fn killed_and_resumed(dir: &Path, straight: &Path, delay: Duration) {
    let ck = dir.join("ck");
    let _ = std::fs::remove_dir_all(&ck);
    let args = tiny_mlp(
        &ck,
        &[
            "--max-steps",
            "60",
            "--checkpoint-every",
            "1",
            "--keep",
            "2",
            "--batch-size",
            "1000",
        ],
    );
    let mut child = start(&args);
    std::thread::sleep(delay);
    let _ = child.kill();
    child.wait().unwrap();
    let mut resume = args.clone();
    if ck.is_dir()
        && !step_dirs(&ck)
            .iter()
            .all(|d| !ck.join(d).join("manifest.json").is_file())
    {
        resume.extend(strings(&["--resume", &ck.display().to_string()]));
    }
    let (done, text) = run(&resume);
    assert!(
        done || text.contains("nothing is left to train"),
        "after a kill at {delay:?}: {text}"
    );
    same_checkpoint(straight, &ck, 60);
}

/// Kill -9 at `n` moments spread over a run (before the first checkpoint,
/// during checkpoint and manifest writes, near the end), each resumed:
/// bit for bit the straight run.
fn kill_loop(name: &str, n: u64) {
    let dir = scratch(name);
    let straight = dir.join("straight");
    let t = Instant::now();
    ok(&tiny_mlp(
        &straight,
        &[
            "--max-steps",
            "60",
            "--checkpoint-every",
            "1",
            "--keep",
            "2",
            "--batch-size",
            "1000",
        ],
    ));
    let took = t.elapsed().as_millis() as u64;
    // A fixed pseudo-random sequence of moments over the run's length.
    for x in common::xorshift(0x9e37_79b9_7f4a_7c15, n) {
        let delay = Duration::from_millis(100 + x % took.max(200));
        killed_and_resumed(&dir, &straight, delay);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kill_9_at_a_few_moments_then_resume_is_bit_for_bit() {
    kill_loop("kill-few", 3);
}

/// The long form: `cargo test --release --test durable -- --ignored`.
#[test]
#[ignore]
fn kill_9_at_20_moments_then_resume_is_bit_for_bit() {
    kill_loop("kill-many", 20);
}

/// Item 6: a signal while the run starts (data, plan, a model of 100,000
/// layers being built) ends it at once with 128 + the signal; and a model
/// that deep trains (each rank's stack holds autograd's walk of it).
#[test]
fn a_signal_during_start_up_ends_the_run_at_once() {
    let args = strings(&[
        "train",
        "mnist-mlp",
        "--stages",
        "100000",
        "--units",
        "10",
        "--max-steps",
        "2",
        "--no-eval",
    ]);
    let child = start(&args);
    std::thread::sleep(Duration::from_millis(500));
    common::signal(&child, 15);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    // Ended before training: no step finished, nothing stopped after one.
    assert!(
        !err.contains("stopped by") && !err.contains("epoch 1"),
        "{err}"
    );
    let deep = strings(&[
        "train",
        "mnist-mlp",
        "--stages",
        "12000",
        "--units",
        "4",
        "--max-steps",
        "1",
        "--batch-size",
        "10",
        "--no-eval",
    ]);
    ok(&deep);
}

/// Item 11: a file where a directory belongs, a count that is not one, an
/// option of the other optimizer, an environment value that is not on or
/// off: each said in words, naming the flag, before anything runs.
#[test]
fn bad_paths_and_values_are_said_in_words() {
    let dir = scratch("words");
    let file = dir.join("afile");
    std::fs::write(&file, b"x").unwrap();
    let f = file.display().to_string();
    let sub = format!("{f}/sub");
    let metrics = format!("{f}/m.json");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--checkpoint-dir", &f], "is a file, not a directory"),
        (vec!["--checkpoint-dir", &sub], "is a file, not a directory"),
        (vec!["--log-dir", &f], "is a file, not a directory"),
        (vec!["--metrics", &metrics], "is a file, not a directory"),
        (vec!["--resume", &f], "a file, not a checkpoint's directory"),
        (vec!["--max-steps", "-1"], "cannot be negative"),
        (vec!["--max-steps", "1x"], "give a whole number"),
        (
            vec!["--max-steps", "99999999999999999999999"],
            "too large: at most",
        ),
        (
            vec!["--momentum", "0.5"],
            "--momentum 0.5 applies to --optimizer sgd",
        ),
        (
            vec!["--batch-size", "70000"],
            "more than the 60000 training examples",
        ),
        (
            vec!["--warmup-steps", "3", "--max-steps", "3"],
            "--warmup-steps 3 leaves no step",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["train", "mnist-mlp", "--no-eval"];
        args.extend(&extra);
        let (out, text) = shardnet(&args);
        // 2: a value the flag's parser refuses (clap's usage error).
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{extra:?}: {text}"
        );
        assert!(text.contains(want), "{extra:?}: {text}");
        assert!(!text.contains("os error"), "{extra:?}: {text}");
    }
    let (out, text) =
        common::shardnet_env(&["plan", "mnist-mlp"], &[("SHARDNET_MEMORY_CHECK", "nope")]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("SHARDNET_MEMORY_CHECK=\"nope\""), "{text}");
    let (out, text) = shardnet(&[
        "consolidate",
        &f,
        &dir.join("o.safetensors").display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("CHECKPOINT") && !text.contains("--resume"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
