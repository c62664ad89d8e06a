//! `scripts/gpu-check.sh run`, the one command for a lent GPU, tested here
//! with a fake device list (`--fake-gpus`) and this build's `shardnet`
//! (`--binary`): every check is reported whatever happens to it, a check
//! that outlives its timeout is killed and reported, the report is written
//! in both forms, and the exit status tells the truth. With `--device cpu`
//! the same checks run on the CPU, so their flags and the parsing of their
//! figures are tested too.

mod common;

use common::{bin, data_dir, scratch};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

const FAKE: &str = "NVIDIA H200,143771,580.159.03,9.0";

/// `gpu-check.sh run --out <dir> <args>`: (exit code, report.json, report.md, output).
fn run(dir: &Path, args: &[&str]) -> (Option<i32>, Value, String, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("scripts/gpu-check.sh"))
        .args(["run", "--out"])
        .arg(dir)
        .arg("--binary")
        .arg(bin())
        .arg("--prepared")
        .arg(dir.join("nothing-prepared"))
        .args(["--fake-gpus", FAKE])
        .args(args)
        .env("SHARDNET_DATA", data_dir())
        .output()
        .expect("bash and python3 run");
    let text = common::output_text(&out);
    let json = std::fs::read_to_string(dir.join("report.json"))
        .unwrap_or_else(|e| panic!("report.json: {e}\n{text}"));
    let md = std::fs::read_to_string(dir.join("report.md"))
        .unwrap_or_else(|e| panic!("report.md: {e}\n{text}"));
    let report: Value = serde_json::from_str(&json).expect("report.json is JSON");
    (out.status.code(), report, md, text)
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report:#}"))
}

/// A build without the `cuda` feature on a "GPU machine": every shardnet
/// check fails fast with the reason, none is left out, and the run says
/// failures with status 1.
#[test]
fn every_check_is_reported_with_its_reason() {
    let dir = scratch("gpu-check", "all");
    let (code, report, md, text) = run(&dir, &["--budget", "300"]);
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(report["status"], "failures", "{report:#}");
    assert_eq!(report["gpus"][0]["name"], "NVIDIA H200");
    assert!(report["finished"].is_string(), "{report:#}");
    let names = [
        "versions",
        "selftest-1",
        "mnist-mlp",
        "face-head",
        "face-head-torch",
        "vgg16",
        "vgg16-torch",
        "selftest-nccl-1",
        "nccl-refused-2",
        "selftest-2",
        "selftest-4",
        "mnist-mlp-2",
        "gpt",
        "gpt-torch",
    ];
    let checks = report["checks"].as_array().expect("checks");
    assert_eq!(
        checks.iter().map(|c| c["name"].clone()).collect::<Vec<_>>(),
        names,
        "{report:#}"
    );
    for c in checks {
        let status = c["status"].as_str().unwrap_or_default();
        assert!(["pass", "fail"].contains(&status), "{c:#}");
        assert!(
            md.contains(&format!("| {}: ", c["name"].as_str().unwrap_or_default())),
            "{md}"
        );
        if c["command"]
            .as_str()
            .unwrap_or_default()
            .contains(" selftest ")
            || c["command"]
                .as_str()
                .unwrap_or_default()
                .contains(" train ")
        {
            assert_eq!(status, "fail", "{c:#}");
            let reason = c["reason"].as_str().unwrap_or_default();
            assert!(reason.contains("without the `cuda` feature"), "{c:#}");
        }
    }
    // Not refused for the right reason: the refusal check does not pass.
    assert_eq!(check(&report, "nccl-refused-2")["status"], "fail");
    assert!(md.contains("(fake)"), "{md}");
}

/// On the CPU the checks' commands run as written: the conformance suite
/// passes, the MLP trains to its accuracy and its figures are read; the
/// long VGG16 is killed at its timeout and the run still ends, reported.
#[test]
fn checks_run_on_the_cpu_and_a_slow_one_is_killed() {
    let dir = scratch("gpu-check", "cpu");
    let (code, report, md, text) = run(
        &dir,
        &[
            "--device",
            "cpu",
            "--only",
            "selftest-1,mnist-mlp,vgg16",
            "--timeout",
            "60,vgg16=2",
        ],
    );
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(check(&report, "selftest-1")["status"], "pass", "{text}");
    let mlp = check(&report, "mnist-mlp");
    assert_eq!(mlp["status"], "pass", "{mlp:#}");
    assert!(
        mlp["figures"]["test_accuracy"].as_f64().unwrap_or(0.0) >= 0.9,
        "{mlp:#}"
    );
    assert!(mlp["figures"]["samples_per_s"].as_f64().unwrap_or(0.0) > 0.0);
    assert!(mlp["figures"]["ms_per_step"].as_f64().unwrap_or(0.0) > 0.0);
    // VGG16 at batch 128 on the CPU: 25 steps take far more than 2 s.
    let vgg = check(&report, "vgg16");
    assert_eq!(vgg["status"], "timeout", "{vgg:#}");
    assert_eq!(vgg["reason"], "killed after 2 s (its timeout)", "{vgg:#}");
    assert!(md.contains("| vgg16: VGG16"), "{md}");
    assert_eq!(report["summary"], "2 pass, 1 timeout", "{report:#}");
}

/// A run that cannot start a check within its budget skips it (reported),
/// and an unknown check name is refused with the list of checks.
#[test]
fn budget_skips_and_unknown_names_are_refused() {
    let dir = scratch("gpu-check", "budget");
    let (code, report, _, text) = run(
        &dir,
        &["--device", "cpu", "--only", "selftest-1", "--budget", "6"],
    );
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(
        check(&report, "selftest-1")["status"],
        "skipped",
        "{report:#}"
    );
    let (code, report, _, text) = run(&dir, &["--only", "selftest-9"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        report["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("selftest-1"),
        "{report:#}"
    );
}
