//! The `shardnet` command as a careless user meets it: every rank count the
//! self-test claims, bad flags and environment refused up front with a
//! message that says what to do, outputs checked before the first step and
//! written atomically, an interrupted run that keeps its finished epochs.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

mod common;
use common::{fault_injection, shardnet, shardnet_env};

/// The self-test on every thread-rank count from 1 to 16, on the kernels
/// `kernels` names.
fn selftest_on_1_to_16(kernels: &str) {
    for n in 1..=16 {
        // A rank that never arrives ends at SHARDNET_TIMEOUT, in an error.
        let (out, text) = shardnet_env(
            &["selftest", "--ranks", &n.to_string()],
            &[("SHARDNET_TIMEOUT", "20"), ("SHARDNET_KERNELS", kernels)],
        );
        assert!(out.status.success(), "{kernels}, {n} ranks: {text}");
        assert!(
            text.contains(&format!("local backend, {n} ranks:")) && text.contains(" 0 failed"),
            "{kernels}, {n} ranks: {text}"
        );
    }
}

/// A reader that closes stdout early (`shardnet … | head -1`) ends the
/// command quietly with status 141, as a shell reports SIGPIPE, not with a
/// panic and its backtrace.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::process::Stdio;
    // The pipe's reading end is closed before the command starts, so its
    // first line to stdout meets a closed pipe whatever the timing.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(common::bin())
        .args(["selftest", "--ranks", "1"])
        .env("SHARDNET_DATA", common::data_dir())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("the shardnet binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// An unknown SHARDNET_KERNELS is refused, naming the variable (it used to
/// mean the fast kernels, silently).
#[test]
fn unknown_kernels_are_refused() {
    let (out, text) = shardnet_env(
        &["selftest", "--ranks", "1"],
        &[("SHARDNET_KERNELS", "gneric")],
    );
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("SHARDNET_KERNELS=\"gneric\""), "{text}");
}

/// SHARDNET_AMX takes 0 or 1; anything else is refused, naming it.
#[test]
fn unknown_amx_values_are_refused() {
    let (out, text) = shardnet_env(&["selftest", "--ranks", "1"], &[("SHARDNET_AMX", "off")]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("SHARDNET_AMX=\"off\""), "{text}");
    let (out, text) = shardnet_env(&["selftest", "--ranks", "1"], &[("SHARDNET_AMX", "0")]);
    assert!(out.status.success(), "{text}");
}

/// SHARDNET_WINOGRAD takes 0 or 1; anything else is refused, naming it.
#[test]
fn unknown_winograd_values_are_refused() {
    let run = |v: &str| shardnet_env(&["selftest", "--ranks", "1"], &[("SHARDNET_WINOGRAD", v)]);
    let (out, text) = run("yes");
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("SHARDNET_WINOGRAD=\"yes\""), "{text}");
    for ok in ["0", "1"] {
        let (out, text) = run(ok);
        assert!(out.status.success(), "{text}");
    }
}

/// The self-test on every thread-rank count from 1 to 16 (9 used to hang,
/// 10–16 to fail on u8 sums that overflowed).
#[test]
fn selftest_passes_on_1_to_16_thread_ranks() {
    selftest_on_1_to_16("fast");
}

/// The same on the device-generic path (12–16 used to stop out of step: a
/// rank holding no classes of the head got no weight gradient, returned
/// early and left the others inside a collective).
#[test]
fn selftest_passes_on_1_to_16_thread_ranks_on_the_generic_path() {
    selftest_on_1_to_16("generic");
}

/// Each bad value is a one-line usage error naming the flag, before any
/// rank starts (it used to panic, be clamped, or be accepted).
#[test]
fn bad_values_are_refused_up_front_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["train", "face-head", "--dim", "0"], "--dim 0"),
        (&["train", "mnist-mlp", "--units", "0"], "--units 0"),
        (&["train", "face-head", "--epochs", "0"], "--epochs 0"),
        (&["train", "mnist-mlp", "--max-steps", "0"], "--max-steps 0"),
        (
            &["train", "face-head", "--steps-per-epoch", "0"],
            "--steps-per-epoch 0",
        ),
        (
            &["train", "mnist-mlp", "--micro-batches", "0"],
            "--micro-batches 0",
        ),
        (
            &["train", "mnist-mlp", "--micro-batches", "101"],
            "--micro-batches 101",
        ),
        (
            &["train", "mnist-mlp", "--virtual-stages", "2"],
            "--virtual-stages 2 gives each rank 2 chunks of layers: it belongs to --schedule interleaved",
        ),
        (
            &["train", "mnist-mlp", "--schedule", "interleaved", "--virtual-stages", "0"],
            "--virtual-stages 0",
        ),
        (
            &["train", "mnist-mlp", "--schedule", "interleaved", "--ranks", "2", "--stages", "3"],
            "2 ranks with 2 chunks each need at least 4 stages (--stages 3)",
        ),
        (
            &["train", "mnist-mlp", "--schedule", "2f2b"],
            "invalid value '2f2b' for '--schedule",
        ),
        (
            &["train", "mnist-mlp", "--parallel", "tensor", "--schedule", "1f1b"],
            "--balance and --data-parallel belong to --parallel pipeline",
        ),
        (
            &["train", "mnist-mlp", "--ranks", "3", "--data-parallel", "2"],
            "--data-parallel 2 does not divide the 3 ranks",
        ),
        (
            &["train", "mnist-mlp", "--data-parallel", "2", "--batch-size", "1"],
            "--batch-size 1 is smaller than --data-parallel 2",
        ),
        (
            &["train", "mnist-mlp", "--data-parallel", "2", "--micro-batches", "60"],
            "--micro-batches 60: give 1 to 50",
        ),
        (
            &["train", "mnist-mlp", "--ranks", "4", "--data-parallel", "4", "--batch-size", "7"],
            "an epoch's last batch has 3 examples (60000 % --batch-size 7), fewer than the 4",
        ),
        (&["train", "mnist-mlp", "--shard-state", "all"], "--shard-state"),
        (
            &["train", "face-head", "--shard-state", "optimizer"],
            "invalid value 'optimizer' for '--shard-state",
        ),
        (
            &["train", "mnist-mlp", "--data-parallel", "2", "--gather-block-mib", "1"],
            "--gather-block-mib 1: only the shared-out weights of --data-parallel 2 or more \
             with --shard-state parameters",
        ),
        (
            &["train", "mnist-mlp", "--gather-block-mib", "-1"],
            "give a number of MiB, 0 or more",
        ),
        (&["train", "face-head", "--scale", "0"], "--scale 0"),
        (&["train", "face-head", "--scale", "-1"], "--scale -1"),
        (&["train", "mnist-arcface", "--lr", "nan"], "--lr NaN"),
        (&["train", "mnist-arcface", "--lr", "-0.1"], "--lr -0.1"),
        (
            &["train", "face-head", "--sample-rate", "1.5"],
            "--sample-rate 1.5",
        ),
        (
            &["train", "face-head", "--batch-size", "0"],
            "--batch-size 0",
        ),
        (&["train", "face-head", "--classes", "0"], "--classes 0"),
        (
            &["selftest", "--ranks", "0"],
            "'--ranks <RANKS>': give a whole number of at least 1",
        ),
        (
            &["demo", "--comm", "bogus"],
            "invalid value 'bogus' for '--comm <COMM>'",
        ),
    ];
    for (args, want) in cases {
        let (out, text) = shardnet(args);
        assert!(!out.status.success(), "{args:?} succeeded: {text}");
        assert!(text.contains(want), "{args:?}: want '{want}' in: {text}");
        assert!(!text.contains("panicked"), "{args:?}: {text}");
        assert!(text.lines().count() <= 6, "{args:?}: {text}");
    }
}

#[test]
fn a_bad_shardnet_timeout_is_refused_not_replaced() {
    for value in ["inf", "abc", "0", "-1", "nan", ""] {
        let (out, text) = shardnet_env(&["demo", "--ranks", "1"], &[("SHARDNET_TIMEOUT", value)]);
        assert!(!out.status.success(), "SHARDNET_TIMEOUT={value:?}: {text}");
        assert!(
            text.contains("SHARDNET_TIMEOUT") && text.contains("number of seconds"),
            "{value:?}: {text}"
        );
    }
    let (out, text) = shardnet_env(&["demo", "--ranks", "1"], &[("SHARDNET_TIMEOUT", "7.5")]);
    assert!(out.status.success(), "{text}");
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardnet-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A short mnist-mlp run's flags (one rank, a few steps, no evaluation).
const SHORT: &[&str] = &[
    "train",
    "mnist-mlp",
    "--ranks",
    "1",
    "--max-steps",
    "3",
    "--no-eval",
];

/// Outputs that cannot be written are refused before the first step (they
/// used to fail only after the whole run).
#[test]
fn unwritable_outputs_are_refused_before_the_first_step() {
    let dir = scratch("outputs");
    let missing = dir.join("no-such-dir").join("m.json");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--metrics".into(), missing.display().to_string()],
            "does not exist",
        ),
        (
            vec!["--metrics".into(), dir.display().to_string()],
            "is a directory",
        ),
        (
            vec!["--metrics".into(), "/proc/shardnet-m.json".into()],
            "cannot create files",
        ),
        (
            vec!["--save-params".into(), missing.display().to_string()],
            "does not exist",
        ),
        (
            vec![
                "--metrics".into(),
                dir.join("same").display().to_string(),
                "--save-params".into(),
                dir.join(".").join("same").display().to_string(),
            ],
            "give each output its own file",
        ),
    ];
    for (extra, want) in cases {
        let mut args: Vec<&str> = SHORT.to_vec();
        args.extend(extra.iter().map(String::as_str));
        args[5] = "1000000"; // --max-steps: a run that is never started
        let (out, text) = shardnet(&args);
        assert!(!out.status.success(), "{extra:?}: {text}");
        assert!(text.contains(want), "{extra:?}: want '{want}' in {text}");
        assert!(!text.contains("epoch 1"), "{extra:?} trained first: {text}");
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "left files behind"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Outputs replace the previous file whole, keep its mode, and leave no
/// temporary behind.
#[test]
fn outputs_are_written_atomically_and_keep_their_mode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("atomic");
    let metrics = dir.join("m.json");
    let params = dir.join("p.safetensors");
    std::fs::write(&metrics, "old").unwrap();
    std::fs::set_permissions(&metrics, std::fs::Permissions::from_mode(0o640)).unwrap();
    let mut args: Vec<&str> = SHORT.to_vec();
    let (m, p) = (metrics.display().to_string(), params.display().to_string());
    args.extend(["--metrics", &m, "--save-params", &p]);
    let (out, text) = shardnet(&args);
    assert!(out.status.success(), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(json["model"], "mnist-mlp");
    let mode = std::fs::metadata(&metrics).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640, "mode {mode:o}");
    assert!(candle_core::safetensors::load(&params, &candle_core::Device::Cpu).is_ok());
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A write that fails part-way leaves the previous file as it was.
#[test]
fn a_failed_write_keeps_the_previous_file() {
    let dir = scratch("failed-write");
    let path = dir.join("m.json");
    std::fs::write(&path, "previous").unwrap();
    let r = shardnet::output::write_atomic_with(&path, |tmp| {
        std::fs::write(tmp, "half of the new").map_err(|e| shardnet::Error::Io(e.to_string()))?;
        Err(shardnet::Error::Io("No space left on device".into()))
    });
    assert!(r.is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "previous");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny face-head run: many short epochs, fast.
fn tiny_head(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "face-head",
        "--classes",
        "1000",
        "--dim",
        "64",
        "--steps-per-epoch",
        "5",
        "--ranks",
        "2",
        "--no-eval",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// SIGINT or SIGTERM during training: every rank stops after the same step,
/// the finished epochs' metrics are written (marked `interrupted`), and the
/// exit status is 128 + the signal.
#[test]
fn a_signal_keeps_the_finished_epochs() {
    for (name, signal, status) in [("SIGINT", 2, 130), ("SIGTERM", 15, 143)] {
        let dir = scratch(&format!("signal-{name}"));
        let metrics = dir.join("m.json");
        let m = metrics.display().to_string();
        let child = Command::new(common::bin())
            .args(tiny_head(&["--epochs", "100000", "--metrics", &m]))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        common::signal(&child, signal);
        let out = common::ended(child, name);
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "{text}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
        let epochs = json["epochs"].as_array().unwrap().len();
        assert!(epochs >= 1, "{json}");
        assert_eq!(json["interrupted"]["signal"], name);
        assert!(json["interrupted"]["after_step"].as_u64().unwrap() >= 5 * epochs as u64);
        assert!(text.contains("finished epoch(s) kept"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A non-finite loss stops training with an error naming the step; a loss
/// scale that collapses (every step skipped) is an error too. Both used to
/// exit 0.
#[test]
fn divergence_is_an_error_naming_the_step() {
    let args = tiny_head(&["--margin", "none", "--lr", "1e30"]);
    let (out, text) = shardnet(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("step 2 (epoch 1): the loss is NaN"), "{text}");
    let args = tiny_head(&["--precision", "f16", "--lr", "1e30", "--epochs", "10"]);
    let (out, text) = shardnet(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("skipped the last 25 steps in a row"),
        "{text}"
    );
}

/// Local backend: a rank that times out ends the launch at the timeout
/// plus the grace, though another rank's thread is busy outside
/// communication: the process ends before that thread does (it says so
/// when it wakes, after 5 timeouts; a launch that waited for it would
/// print that line).
#[test]
fn a_timeout_ends_the_local_launch_though_a_rank_is_busy() {
    let bin = fault_injection();
    let out = Command::new(&bin)
        .args(["hang", "--local", "3"])
        .env("SHARDNET_TIMEOUT", "3")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("timed out after 3.0 s"), "{text}");
    assert!(text.contains("still busy"), "{text}");
    assert!(!text.contains("busy rank woke"), "{text}");
}

/// `--device cuda` on a build without the `cuda` feature is refused before
/// any rank starts, saying how to build one; `--communicator nccl` needs
/// `--device cuda`.
#[test]
fn gpu_flags_are_checked_against_the_build() {
    if cfg!(feature = "cuda") {
        return;
    }
    for args in [
        &["train", "mnist-mlp", "--device", "cuda", "--max-steps", "1"][..],
        &["selftest", "--ranks", "1", "--device", "cuda"][..],
        &["demo", "--ranks", "2", "--device", "cuda"][..],
    ] {
        let (out, text) = shardnet(args);
        assert!(!out.status.success(), "{args:?}: {text}");
        assert!(text.contains("scripts/build-cuda.sh"), "{args:?}: {text}");
        assert!(!text.contains("epoch"), "{args:?} started training: {text}");
    }
    let (out, text) = shardnet(&["selftest", "--ranks", "1", "--communicator", "nccl"]);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--communicator nccl needs every rank on a GPU"),
        "{text}"
    );
}

/// The hierarchical communicator on the CPU (the world's backend in and
/// between nodes): the self-test passes through it.
#[test]
fn selftest_passes_through_the_hierarchical_communicator() {
    let (out, text) = shardnet_env(
        &["selftest", "--ranks", "3", "--communicator", "hierarchical"],
        &[("SHARDNET_TIMEOUT", "20")],
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("hierarchical backend, 3 ranks:") && text.contains(" 0 failed"),
        "{text}"
    );
}

/// `--save-params` on every model: the whole parameters (shards joined) on
/// 2 ranks are the 1-rank run's, name for name and shape for shape, and
/// their values within f32 rounding of the split's sums (the grouped
/// VGG16, whose groups are not one tensor's shards, saves each group's own
/// weights by name).
#[test]
fn save_params_works_on_every_model() {
    let dir = scratch("save-params-every-model");
    let vgg = [&common::TINY_VGG16[..], &["--optimizer", "sgd"]].concat();
    let head = [
        "face-head",
        "--classes",
        "37",
        "--dim",
        "8",
        "--batch-size",
        "16",
    ];
    let arcface = ["mnist-arcface", "--dim", "8", "--batch-size", "32"];
    let mlp = ["mnist-mlp-parallel", "--units", "40"];
    let models: [(&str, &[&str]); 4] = [
        ("vgg16", &vgg),
        ("face-head", &head),
        ("mnist-arcface", &arcface),
        ("mnist-mlp-parallel", &mlp),
    ];
    let load = |p: &PathBuf| candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
    for (name, flags) in models {
        let run = |ranks: &str, extra: &[&str]| {
            let file = dir.join(format!("{name}-{ranks}{}.safetensors", extra.len()));
            let f = file.display().to_string();
            let mut args = vec!["train"];
            args.extend(flags);
            args.extend(["--ranks", ranks, "--max-steps", "2", "--no-eval"]);
            args.extend(["--save-params", &f]);
            args.extend(extra);
            let (out, text) = shardnet(&args);
            assert!(out.status.success(), "{name} on {ranks}: {text}");
            load(&file)
        };
        let one = run("1", &[]);
        let two = run("2", &[]);
        assert!(!one.is_empty(), "{name}: nothing saved");
        let names = |m: &std::collections::HashMap<String, candle_core::Tensor>| {
            m.keys().cloned().collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(
            names(&one),
            names(&two),
            "{name}: other parameters on 2 ranks"
        );
        for (k, a) in &one {
            let b = &two[k];
            assert_eq!(a.dims(), b.dims(), "{name}: {k}");
            let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            let diff = diff.to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4, "{name}: {k} differs by {diff} on 2 ranks");
        }
        if name == "face-head" {
            assert_eq!(one["head.weight"].dims(), [37, 8]);
        }
        if name == "vgg16" {
            let grouped = run("2", &["--parallel-conv", "grouped"]);
            assert!(
                grouped.contains_key("conv1.group0of2.weight"),
                "{:?}",
                grouped.keys()
            );
            assert!(grouped.contains_key("conv1.group1of2.weight"));
            assert!(grouped.contains_key("fc1.weight"));
            assert_eq!(one["bn13.running_var"].dims(), [32]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// No output may lie inside a checkpoint: `consolidate`'s OUT, and a run's
/// `--save-params`, `--metrics` and `--log-dir`, naming a checkpoint's
/// own files or a path below it, are refused before anything is written,
/// naming the checkpoint (they used to overwrite it, exit 0); the
/// checkpoint is left as it was, and a path beside it is fine.
#[test]
fn outputs_inside_a_checkpoint_are_refused() {
    let dir = scratch("inside-checkpoint");
    let ck = dir.join("ck");
    let c = ck.display().to_string();
    // SHORT on 2 ranks.
    let two: Vec<&str> = SHORT
        .iter()
        .map(|a| if *a == "1" { "2" } else { *a })
        .collect();
    let mut args = two.clone();
    args.extend(["--checkpoint-dir", &c]);
    let (out, text) = shardnet(&args);
    assert!(out.status.success(), "{text}");
    let step = ck.join("step-000000003");
    let bytes = |p: &std::path::Path| std::fs::read(p).unwrap();
    let files = ["manifest.json", "rank-00000-of-00002.safetensors"];
    let before: Vec<Vec<u8>> = files.iter().map(|f| bytes(&step.join(f))).collect();
    let s = step.display().to_string();
    for f in files {
        let target = step.join(f).display().to_string();
        let (out, text) = shardnet(&["consolidate", &s, &target]);
        assert_eq!(out.status.code(), Some(1), "{text}");
        assert!(text.contains("lies inside the checkpoint"), "{text}");
        for flag in ["--save-params", "--metrics"] {
            let mut a = two.clone();
            a.extend(["--resume", &c, flag, &target]);
            let (out, text) = shardnet(&a);
            assert_eq!(out.status.code(), Some(1), "{flag}: {text}");
            assert!(
                text.contains(&format!("{flag} {target}: lies inside")),
                "{text}"
            );
        }
    }
    let logs = step.join("logs").display().to_string();
    let mut a = two.clone();
    a.extend(["--log-dir", &logs]);
    let (out, text) = shardnet(&a);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        !step.join("logs").exists(),
        "the refused log dir was created"
    );
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(&bytes(&step.join(f)), b, "{f} changed");
    }
    // Beside the checkpoints, in the checkpoint directory: written.
    let beside = ck.join("whole.safetensors").display().to_string();
    let (out, text) = shardnet(&["consolidate", &c, &beside]);
    assert!(out.status.success(), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
