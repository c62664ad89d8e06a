//! The `shardnet` command as a careless user meets it: every rank count the
//! self-test claims, bad flags and environment refused up front with a
//! message that says what to do, outputs checked before the first step and
//! written atomically, an interrupted run that keeps its finished epochs.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn data_dir() -> PathBuf {
    std::env::var_os("SHARDNET_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/data"))
}

/// `shardnet <args>` with `env` set; (output, stdout + stderr).
fn shardnet_env(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shardnet"))
        .args(args)
        .env("SHARDNET_DATA", data_dir())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

fn shardnet(args: &[&str]) -> (Output, String) {
    shardnet_env(args, &[])
}

/// The self-test on every thread-rank count from 1 to 16 (9 used to hang,
/// 10–16 to fail on u8 sums that overflowed).
#[test]
fn selftest_passes_on_1_to_16_thread_ranks() {
    for n in 1..=16 {
        let t = Instant::now();
        let (out, text) = shardnet_env(
            &["selftest", "--ranks", &n.to_string()],
            &[("SHARDNET_TIMEOUT", "20")],
        );
        assert!(out.status.success(), "{n} ranks: {text}");
        assert!(
            text.contains(&format!("local backend, {n} ranks:")) && text.contains(" 0 failed"),
            "{n} ranks: {text}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{n} ranks took {:?}",
            t.elapsed()
        );
    }
}
