//! Helpers shared by the integration tests: where the data are, running the
//! `shardnet` command and the fault-injection program.
#![allow(dead_code)]

pub mod conv_ref;
pub mod optim_ref;
pub mod sharded_step;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `shardnet train` flags of a VGG16 of 1/16 the width (4 to 32 channels)
/// on 48 seeded synthetic images, 4 steps an epoch, without dropout.
pub const TINY_VGG16: [&str; 11] = [
    "vgg16",
    "--dataset",
    "synthetic",
    "--synthetic-examples",
    "48",
    "--batch-size",
    "12",
    "--width",
    "0.0625",
    "--dropout",
    "0",
];

/// n uniform values in [0, 1) from `seed` (xorshift; the same on every
/// rank and run for one seed).
pub fn uniform(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        })
        .collect()
}

/// A directory holding `mnist/`, found the way the CLI finds MNIST:
/// `SHARDNET_DATA` (made absolute), else the cache
/// (`$XDG_CACHE_HOME/shardnet`, or `~/.cache/shardnet`), where
/// `shardnet::data::mnist_dir` downloads the four files and checks their
/// SHA-256 when they are missing. So `cargo test` runs from any clone;
/// CI sets `SHARDNET_DATA=../shared/data`. Found once per test binary.
pub fn data_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("SHARDNET_DATA") {
            let d = PathBuf::from(d);
            return std::path::absolute(&d).unwrap_or(d);
        }
        let mnist =
            shardnet::data::mnist_dir(None).unwrap_or_else(|e| panic!("MNIST for the tests: {e}"));
        mnist
            .parent()
            .map(PathBuf::from)
            .expect("the cache's mnist directory has a parent")
    })
    .clone()
}

/// Whether this run takes the device-generic path
/// (`SHARDNET_KERNELS=generic`, CI's second run), where a test of a feature
/// of the CPU kernels alone says so and passes: `what` names the feature.
/// (Its math is tested on the CPU kernels in the first run.)
pub fn cpu_kernels_only(what: &str) -> bool {
    let generic = shardnet::kernels::kernels() == shardnet::kernels::Kernels::Generic;
    if generic {
        eprintln!("not on the generic path: {what} is a feature of the CPU kernels");
    }
    generic
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
    let out = Command::new(bin())
        .args(args)
        .env("SHARDNET_DATA", data_dir())
        .envs(env.iter().copied())
        .output()
        .expect("the shardnet binary runs");
    let text = output_text(&out);
    (out, text)
}

/// The `shardnet` binary: `SHARDNET_BIN` when set (the copied test
/// binaries of scripts/build-cuda.sh's bundle, whose `run` sets it), else
/// the one cargo built beside this test.
pub fn bin() -> PathBuf {
    std::env::var_os("SHARDNET_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_shardnet")))
}

/// `shardnet <args>`; (output, stdout + stderr).
pub fn shardnet(args: &[&str]) -> (Output, String) {
    shardnet_env(args, &[])
}

/// The fault-injection program (`examples/fault_injection.rs`), which a
/// whole `cargo test` builds.
pub fn fault_injection() -> PathBuf {
    let bin = bin().with_file_name("examples").join("fault_injection");
    assert!(
        bin.exists(),
        "{} is missing: a whole `cargo test` builds it (or `cargo build --release --features mpi --example fault_injection`)",
        bin.display()
    );
    bin
}

/// The largest relative difference (max |got − want| / max |want|) over
/// same-named tensors, and the name where it is: the two maps must hold the
/// same names and shapes.
pub fn worst(
    got: &std::collections::BTreeMap<String, candle_core::Tensor>,
    want: &std::collections::BTreeMap<String, candle_core::Tensor>,
) -> (f64, String) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    got.iter()
        .map(|(k, g)| {
            assert_eq!(g.dims(), want[k].dims(), "{k}");
            (
                shardnet_conformance::max_rel(g, &want[k]).unwrap(),
                k.clone(),
            )
        })
        .fold((0.0, String::new()), |a, b| if b.0 > a.0 { b } else { a })
}

/// A narrow VGG16 (4 to 32 channels) on synthetic images, batch 8,
/// dropout and batch normalisation on, `steps` steps.
pub fn vgg16_config(
    split: shardnet::links::ChannelSplit,
    groups: usize,
    steps: usize,
) -> shardnet::models::vgg16::Config {
    let mut cfg = shardnet::models::vgg16::Config::new(split);
    cfg.width = 1.0 / 16.0;
    cfg.batch_size = 8;
    cfg.data_parallel = groups;
    cfg.dataset = shardnet::models::vgg16::ImageSet::Synthetic;
    cfg.synthetic_examples = 160;
    cfg.train = shardnet::train::Options {
        max_steps: Some(steps),
        evaluate: false,
        progress: false,
        ..cfg.train
    };
    cfg
}

/// The gradients of the first step of [`vgg16_config`], whole.
pub fn vgg16_first_gradients(
    split: shardnet::links::ChannelSplit,
    ranks: usize,
    groups: usize,
) -> std::collections::BTreeMap<String, candle_core::Tensor> {
    let cfg = vgg16_config(split, groups, 1);
    let grads =
        shardnet::comm::launch_with_timeout(ranks, std::time::Duration::from_secs(60), |c| {
            shardnet::models::vgg16::Vgg16Training::new(&c, &cfg)?.gradients(0)
        })
        .unwrap();
    grads.into_iter().flatten().next().unwrap()
}

/// Send signal `sig` (2: SIGINT, 15: SIGTERM) to a child process.
pub fn signal(child: &std::process::Child, sig: i32) {
    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { kill(child.id() as i32, sig) }, 0);
}

/// One case of `tests/fixtures/torch_optim.json`: what PyTorch's optimizer
/// made of the fixture's parameter after each of its five gradients.
pub struct TorchOptimCase {
    pub name: String,
    pub optimizer: String,
    pub settings: serde_json::Value,
    pub after_each_step: Vec<Vec<f32>>,
}

/// The fixture: (θ0, its shape, the five gradients, the cases).
pub fn torch_optim_fixture() -> (Vec<f32>, Vec<usize>, Vec<Vec<f32>>, Vec<TorchOptimCase>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch_optim.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    };
    let shape = v["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|x| x.as_u64().expect("dim") as usize)
        .collect();
    let grads = v["grads"]
        .as_array()
        .expect("grads")
        .iter()
        .map(floats)
        .collect();
    let cases = v["cases"]
        .as_object()
        .expect("cases")
        .iter()
        .map(|(name, c)| TorchOptimCase {
            name: name.clone(),
            optimizer: c["optimizer"].as_str().expect("name").to_string(),
            settings: c["settings"].clone(),
            after_each_step: c["after_each_step"]
                .as_array()
                .expect("steps")
                .iter()
                .map(floats)
                .collect(),
        })
        .collect();
    (floats(&v["theta0"]), shape, grads, cases)
}

/// The shardnet optimizer of a fixture case, over `params`.
pub fn optimizer_of(
    case: &TorchOptimCase,
    params: Vec<shardnet::nn::Param>,
) -> shardnet::optim::Optimizer {
    use shardnet::optim::{Optimizer, OptimizerConfig, OptimizerKind};
    let get = |k: &str| case.settings[k].as_f64().unwrap_or(0.0);
    let kind = if case.optimizer == "SGD" {
        OptimizerKind::Sgd
    } else {
        OptimizerKind::Adam
    };
    let cfg = OptimizerConfig {
        kind,
        momentum: get("momentum"),
        weight_decay: get("weight_decay"),
    };
    Optimizer::new(&cfg, params, get("lr")).expect("optimizer")
}

/// Largest |a − b| / max(1, |b|) over two equal-length slices.
pub fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs() / f64::from(y.abs()).max(1.0))
        .fold(0.0, f64::max)
}

/// A checkpoint rank file without its run's id (two runs write the same
/// values under their own ids): the header as JSON, and the bytes after it.
pub fn without_run_id(f: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = 8 + u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&f[8..n]).unwrap();
    h["__metadata__"].as_object_mut().unwrap().remove("run");
    (h, f[n..].to_vec())
}

/// The names in `dir` of its checkpoints (`step-…`), sorted.
pub fn step_dirs(dir: &Path) -> Vec<String> {
    let mut steps: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    steps
}

/// Words as owned strings (a command line).
pub fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A fresh scratch directory for test file `kind`'s case `name`.
pub fn scratch(kind: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardnet-{kind}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small MLP run on 2 thread ranks, 20 steps per epoch (unless `extra`
/// gives its own `--batch-size`), checkpoints in `ck`.
pub fn tiny_mlp(ck: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = strings(&["train", "mnist-mlp", "--ranks", "2", "--no-eval"]);
    v.extend(strings(&["--checkpoint-dir", &ck.display().to_string()]));
    if !extra.contains(&"--batch-size") {
        v.extend(strings(&["--batch-size", "3000"]));
    }
    v.extend(strings(extra));
    v
}

/// Checkpoint `step`'s rank files (of a 2-rank run) in `a` and `b` hold the
/// same bytes, but for the run id.
pub fn same_checkpoint(a: &Path, b: &Path, step: usize) {
    let name = format!("step-{step:09}");
    for r in 0..2 {
        let f = format!("rank-{r:05}-of-00002.safetensors");
        let x = std::fs::read(a.join(&name).join(&f)).unwrap();
        let y = std::fs::read(b.join(&name).join(&f)).unwrap();
        assert!(
            without_run_id(&x) == without_run_id(&y),
            "{name}/{f} differs between {a:?} and {b:?}"
        );
    }
}

/// How long a test waits for what should end at once before it calls it a
/// hang: far past any bound the test stands for, so that a loaded machine
/// never trips it.
pub const HANG: std::time::Duration = std::time::Duration::from_secs(120);

/// `child`'s output once it ends by itself; a child still running after
/// [`HANG`] is killed and the test fails, naming `what` should have ended
/// it.
pub fn ended(child: std::process::Child, what: &str) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(HANG) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{what} did not end the process: a hang");
        }
    }
}

/// Run a conformance suite as a test binary of its own (`harness = false`):
/// one test per case and rank count (1 to `max_ranks`), named
/// `<case>/<n>_ranks`, so that one can be run by name
/// (`cargo test --test chains -- <case>/2_ranks`) and each reports alone;
/// `others` are the file's other tests, by name (a panic fails one).
pub fn conformance_suite(
    cases: fn() -> Vec<shardnet_conformance::autograd::Case>,
    max_ranks: usize,
    others: &[(&str, fn())],
) -> ! {
    use libtest_mimic::{Arguments, Failed, Trial};
    let names: Vec<String> = cases().into_iter().map(|(name, _)| name).collect();
    let mut trials = Vec::new();
    for (i, name) in names.iter().enumerate() {
        for n in 1..=max_ranks {
            let name = name.clone();
            trials.push(Trial::test(format!("{name}/{n}_ranks"), move || {
                let all = cases();
                let body = &all[i].1;
                let failures = shardnet_conformance::run_case_local(
                    &name,
                    &**body,
                    n,
                    std::time::Duration::from_secs(20),
                );
                match failures.is_empty() {
                    true => Ok(()),
                    false => Err(Failed::from(failures.join("\n"))),
                }
            }));
        }
    }
    for &(name, test) in others {
        trials.push(Trial::test(name, move || {
            test();
            Ok(())
        }));
    }
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

/// `n` values of a fixed xorshift sequence from `seed`: the pseudo-random
/// moments (and ranks) the kill -9 loops pick, the same on every run.
pub fn xorshift(seed: u64, n: u64) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}
