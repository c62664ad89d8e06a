//! Helpers shared by the integration tests: where the data are, running the
//! `shardnet` command and the fault-injection program.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// `SHARDNET_DATA`, else `../shared/data` (CI's layout).
pub fn data_dir() -> PathBuf {
    std::env::var_os("SHARDNET_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/data"))
}

/// A finished process's stdout then stderr, as text.
pub fn output_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `shardnet <args>` with `env` set; (output, stdout + stderr).
pub fn shardnet_env(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shardnet"))
        .args(args)
        .env("SHARDNET_DATA", data_dir())
        .envs(env.iter().copied())
        .output()
        .expect("the shardnet binary runs");
    let text = output_text(&out);
    (out, text)
}

/// `shardnet <args>`; (output, stdout + stderr).
pub fn shardnet(args: &[&str]) -> (Output, String) {
    shardnet_env(args, &[])
}

/// The fault-injection program (`examples/fault_injection.rs`), which a
/// whole `cargo test` builds.
pub fn fault_injection() -> PathBuf {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_shardnet"))
        .with_file_name("examples")
        .join("fault_injection");
    assert!(
        bin.exists(),
        "{} is missing: a whole `cargo test` builds it (or `cargo build --release --features mpi --example fault_injection`)",
        bin.display()
    );
    bin
}
