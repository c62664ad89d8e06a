//! Checkpoints (`--checkpoint-dir`, `--resume`, `shardnet consolidate`):
//! a resumed run is bit for bit the uninterrupted one for every model; a
//! checkpoint resumes on another number of ranks; a consolidated model is
//! the trained one; what does not match is refused, naming what differs.

mod common;
use candle_core::{Device, Tensor};
use common::{data_dir, shardnet, step_dirs, strings, tiny_mlp, without_run_id, TINY_VGG16};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A fresh scratch directory for `name`.
fn scratch(name: &str) -> PathBuf {
    common::scratch("ck", name)
}

/// `shardnet train <args>`, which must succeed; its output.
fn train(args: &[String]) -> String {
    train_env(args, &[])
}

/// [`train`] with `env` set.
fn train_env(args: &[String], env: &[(&str, &str)]) -> String {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (out, text) = common::shardnet_env(&a, env);
    assert!(out.status.success(), "shardnet {}:\n{text}", a.join(" "));
    text
}

/// The epochs of a metrics file without what depends on timing.
fn epochs(metrics: &Path) -> Vec<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(metrics).unwrap()).unwrap();
    v["epochs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.as_object_mut().unwrap().remove("samples_per_s");
            e
        })
        .collect()
}

/// Every rank file of checkpoint `step` in `a` and `b`, byte for byte but
/// for the run's id.
fn same_files(a: &Path, b: &Path, step: usize) {
    let name = format!("step-{step:09}");
    let (a, b) = (a.join(&name), b.join(&name));
    let mut files: Vec<_> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".safetensors"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}", a.display());
    for f in files {
        let (x, y) = (
            std::fs::read(a.join(&f)).unwrap(),
            std::fs::read(b.join(&f)).unwrap(),
        );
        assert!(
            without_run_id(&x) == without_run_id(&y),
            "{} differs from {}",
            a.join(&f).display(),
            b.display()
        );
    }
}

/// 2K steps straight equal K steps, a stop, and a resume for K more: the
/// same parameters, optimizer state and statistics (the checkpoint files
/// of step 2K, byte for byte) and the same metrics.
fn resume_is_exact(name: &str, args: &[&str], k: usize) {
    resume_is_exact_env(name, args, k, &[]);
}

/// [`resume_is_exact`] with `env` set for every run.
fn resume_is_exact_env(name: &str, args: &[&str], k: usize, env: &[(&str, &str)]) {
    let train = |a: &[String]| train_env(a, env);
    let dir = scratch(name);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let base = |d: &Path, steps: usize, m: &str| {
        let mut v = strings(&["train"]);
        v.extend(strings(args));
        v.extend(strings(&["--checkpoint-dir", &d.display().to_string()]));
        v.extend(strings(&["--max-steps", &steps.to_string()]));
        v.extend(strings(&["--metrics", &dir.join(m).display().to_string()]));
        v
    };
    train(&base(&a, 2 * k, "a.json"));
    let mut first = base(&b, 2 * k, "first.json");
    first.extend(strings(&["--stop-after", &k.to_string()]));
    let text = train(&first);
    assert!(text.contains("--resume"), "{text}");
    let mut resume = base(&b, 2 * k, "b.json");
    resume.extend(strings(&["--resume", &b.display().to_string()]));
    let text = train(&resume);
    assert!(text.contains(&format!("at step {k}")), "{text}");
    same_files(&a, &b, 2 * k);
    assert_eq!(
        epochs(&dir.join("a.json")),
        epochs(&dir.join("b.json")),
        "{name}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_is_bit_for_bit_for_the_mlps() {
    // 20 steps per epoch: the resume lands mid-epoch, the run crosses an
    // epoch (evaluated).
    let mlp = ["--ranks", "2", "--batch-size", "3000", "--epochs", "2"];
    resume_is_exact("mnist-mlp", &[&["mnist-mlp"], &mlp[..]].concat(), 15);
    resume_is_exact(
        "mnist-mlp-tensor",
        &[&["mnist-mlp", "--parallel", "tensor"], &mlp[..]].concat(),
        15,
    );
    resume_is_exact(
        "mnist-mlp-parallel",
        &[&["mnist-mlp-parallel"], &mlp[..]].concat(),
        15,
    );
}

/// The generic path (what a GPU runs): moments as device tensors, no
/// in-place kernels.
#[test]
fn resume_is_bit_for_bit_on_the_generic_path() {
    let args = [
        "vgg16",
        "--ranks",
        "2",
        "--dataset",
        "synthetic",
        "--synthetic-examples",
        "16",
        "--batch-size",
        "8",
        "--width",
        "0.0625",
        "--epochs",
        "3",
    ];
    resume_is_exact_env(
        "vgg16-generic",
        &args,
        3,
        &[("SHARDNET_KERNELS", "generic")],
    );
}

#[test]
fn resume_is_bit_for_bit_for_the_sharded_head() {
    // bf16: the loss scaler's state travels too.
    resume_is_exact(
        "face-head",
        &[
            "face-head",
            "--ranks",
            "3",
            "--classes",
            "1000",
            "--dim",
            "64",
            "--batch-size",
            "64",
            "--steps-per-epoch",
            "4",
            "--epochs",
            "3",
            "--precision",
            "bf16",
        ],
        5,
    );
    // Partial FC: the sample of each step follows the run's step; SGD's
    // momentum (`sgd.momentum/…`, updated lazily by the fused step) travels
    // too; more classes than one class block.
    resume_is_exact(
        "partial-fc",
        &[
            "face-head",
            "--optimizer",
            "sgd",
            "--ranks",
            "2",
            "--classes",
            "3000",
            "--dim",
            "64",
            "--batch-size",
            "64",
            "--steps-per-epoch",
            "4",
            "--epochs",
            "2",
            "--sample-rate",
            "0.3",
        ],
        3,
    );
    resume_is_exact(
        "mnist-arcface",
        &[
            "mnist-arcface",
            "--ranks",
            "2",
            "--batch-size",
            "3000",
            "--epochs",
            "2",
        ],
        15,
    );
}

#[test]
fn resume_is_bit_for_bit_for_vgg16() {
    // Batch norm's running statistics and dropout's masks; 4 steps per
    // epoch, on a 2 × 2 grid.
    resume_is_exact(
        "vgg16",
        &[
            "vgg16",
            "--ranks",
            "4",
            "--data-parallel",
            "2",
            "--dataset",
            "synthetic",
            "--synthetic-examples",
            "32",
            "--batch-size",
            "8",
            "--width",
            "0.0625",
            "--epochs",
            "2",
        ],
        3,
    );
}

/// A consolidated checkpoint, by name.
fn consolidated(ck: &Path, dir: &Path, name: &str) -> BTreeMap<String, Tensor> {
    let out = dir.join(format!("{name}.safetensors"));
    let (o, text) = shardnet(&[
        "consolidate",
        &ck.display().to_string(),
        &out.display().to_string(),
    ]);
    assert!(o.status.success(), "{text}");
    candle_core::safetensors::load(&out, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

/// Train on 4 ranks, then continue on 4, on 2 and on 3: every sharded
/// tensor is re-split from the checkpoint, and the three continuations
/// agree (to rounding: the reductions add in another order).
fn reshards(name: &str, args: &[&str], k: usize, tol: f64) {
    let dir = scratch(name);
    let run = |ranks: usize, ck: &Path, steps: usize, resume: Option<&Path>| {
        let mut v = strings(&["train"]);
        v.extend(strings(args));
        v.extend(strings(&[
            "--ranks",
            &ranks.to_string(),
            "--checkpoint-dir",
            &ck.display().to_string(),
            "--max-steps",
            &steps.to_string(),
            "--no-eval",
        ]));
        if let Some(r) = resume {
            v.extend(strings(&["--resume", &r.display().to_string()]));
        }
        train(&v)
    };
    let first = dir.join("first");
    run(4, &first, k, None);
    let mut results = Vec::new();
    for ranks in [4, 2, 3] {
        let ck = dir.join(format!("on{ranks}"));
        let text = run(ranks, &ck, 2 * k, Some(&first));
        assert!(text.contains("(4 ranks wrote it;"), "{text}");
        results.push((ranks, consolidated(&ck, &dir, &format!("on{ranks}"))));
    }
    let want = &results[0].1;
    for (ranks, got) in &results[1..] {
        let (w, at) = common::worst(got, want);
        assert!(w < tol, "{name}: 4 → {ranks} ranks: {w:e} at {at}");
    }
    // The parameters really moved after the resume.
    let start = consolidated(&first, &dir, "start");
    assert!(common::worst(&start, want).0 > 1e-3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`TINY_VGG16`] on `ranks` data-parallel replicas for `steps` steps with
/// `extra` flags, checkpointed into `ck`, resumed from `resume`: its output.
fn data_parallel_vgg16(
    ranks: usize,
    ck: &Path,
    steps: usize,
    resume: Option<&Path>,
    extra: &[&str],
) -> String {
    let groups = ranks.to_string();
    let mut model = TINY_VGG16.to_vec();
    model.extend([
        "--parallel-conv",
        "none",
        "--no-eval",
        "--data-parallel",
        &groups,
    ]);
    model.extend(extra);
    checkpointed(&model, ranks, ck, steps, resume)
}

/// `shardnet train <model>` on `ranks` ranks for `steps` steps,
/// checkpointed into `ck`, resumed from `resume`: its output.
fn checkpointed(
    model: &[&str],
    ranks: usize,
    ck: &Path,
    steps: usize,
    resume: Option<&Path>,
) -> String {
    let mut v = strings(&["train"]);
    v.extend(strings(model));
    v.extend(strings(&[
        "--ranks",
        &ranks.to_string(),
        "--checkpoint-dir",
        &ck.display().to_string(),
        "--max-steps",
        &steps.to_string(),
    ]));
    if let Some(r) = resume {
        v.extend(strings(&["--resume", &r.display().to_string()]));
    }
    train(&v)
}

/// Tensor `name` of `ck`'s step-2 checkpoint: its global shape, and each
/// piece's (dimension, offset) along which it is sharded.
fn pieces_of(ck: &Path, name: &str) -> (serde_json::Value, Vec<(u64, u64)>) {
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("step-000000002/manifest.json")).unwrap(),
    )
    .unwrap();
    let t = &manifest["tensors"][name];
    let pieces = t["pieces"]
        .as_array()
        .unwrap_or_else(|| panic!("{name}: {t}"))
        .iter()
        .map(|p| {
            let at = |k: &str| {
                p["shard"][k]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{name}: {t}"))
            };
            (at("dim"), at("offset"))
        })
        .collect();
    (t["shape"].clone(), pieces)
}

/// Tensor `name` of `ck`'s step-2 checkpoint is written as 2 replicas'
/// halves of conv1's (4, 3, 3, 3): rows 0..2 and 2..4 of one global tensor.
fn assert_halves_of_conv1(ck: &Path, name: &str) {
    let (shape, pieces) = pieces_of(ck, name);
    assert_eq!(shape, serde_json::json!([4, 3, 3, 3]), "{name}");
    assert_eq!(pieces, [(0, 0), (0, 2)], "{name}");
}

/// Data-parallel VGG16 keeps each replica's rows of Adam's moments
/// (`Optimizer::shard_state`): a checkpoint of 2 replicas holds them as
/// shards, and continues on 1 rank and on 3 replicas (the rows re-split
/// unevenly) as one rank's run does without a stop (to rounding: the
/// replicas' gradients add in another order). The consolidated moments
/// are whole tensors.
#[test]
fn a_data_parallel_checkpoint_with_sharded_moments_resumes_on_other_ranks() {
    let dir = scratch("dp-moments");
    let run = |ranks, ck: &Path, steps, resume| data_parallel_vgg16(ranks, ck, steps, resume, &[]);
    let first = dir.join("first");
    run(2, &first, 2, None);
    let start = consolidated(&first, &dir, "start");
    // Each replica wrote its rows of the moments: conv1's 4 output
    // channels as rows 0..2 and 2..4 of one global tensor.
    assert_halves_of_conv1(&first, "adam.m/conv1.weight");
    let straight = dir.join("straight");
    run(1, &straight, 4, None);
    let want = consolidated(&straight, &dir, "straight");
    for ranks in [1, 3] {
        let ck = dir.join(format!("on{ranks}"));
        let text = run(ranks, &ck, 4, Some(&first));
        assert!(text.contains("(2 ranks wrote it;"), "{text}");
        let got = consolidated(&ck, &dir, &format!("on{ranks}"));
        let (w, at) = common::worst(&got, &want);
        assert!(w < 1e-3, "2 → {ranks} ranks: {w:e} at {at}");
    }
    assert!(common::worst(&start, &want).0 > 1e-3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fully sharded checkpoint (`--shard-state parameters`: each replica
/// wrote its share of every convolution's weight and moments) continues
/// on 1 rank and on 3 replicas fully sharded (the shares re-split
/// unevenly) as one rank's run does without a stop; a checkpoint with the
/// weights whole (ZeRO stage 1) continues fully sharded, and a fully
/// sharded one with the gradients alone sharded (ZeRO stage 2).
#[test]
fn a_fully_sharded_vgg16_checkpoint_resumes_on_other_ranks() {
    let dir = scratch("dp-fsdp");
    let flags = |ranks: usize, fsdp: bool| -> &'static [&'static str] {
        if ranks > 1 && fsdp {
            &["--shard-state", "parameters"]
        } else {
            &[]
        }
    };
    let first = dir.join("first");
    data_parallel_vgg16(2, &first, 2, None, flags(2, true));
    for name in ["param/conv1.weight", "adam.m/conv1.weight"] {
        assert_halves_of_conv1(&first, name);
    }
    let zero1 = dir.join("zero1");
    data_parallel_vgg16(2, &zero1, 2, None, flags(2, false));
    let straight = dir.join("straight");
    data_parallel_vgg16(1, &straight, 4, None, &[]);
    let want = consolidated(&straight, &dir, "straight");
    let zero2: &[&str] = &["--shard-state", "gradients"];
    for (case, (from, ranks, flags)) in [
        (&first, 1, flags(1, true)),
        (&first, 3, flags(3, true)),
        (&zero1, 2, flags(2, true)),
        (&first, 2, zero2),
    ]
    .into_iter()
    .enumerate()
    {
        let ck = dir.join(format!("case{case}"));
        let text = data_parallel_vgg16(ranks, &ck, 4, Some(from), flags);
        assert!(text.contains("(2 ranks wrote it;"), "{text}");
        let got = consolidated(&ck, &dir, &format!("case{case}"));
        let (w, at) = common::worst(&got, &want);
        assert!(w < 1e-3, "2 → {ranks} ranks {flags:?}: {w:e} at {at}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The MLP as 2 data-parallel pipelines of 2 stages, fully sharded
/// (`--shard-state parameters`), 2 micro-batches each under 1F1B: its
/// checkpoint holds each weight and its moments as the 2 replicas' halves
/// along the weight's larger dimension, and continues on one rank, on 2
/// fully sharded replicas of one rank each, on 2 pipelines with the
/// gradients alone sharded and on 1 pipeline of 2 ranks as one rank's run
/// does without a stop (to rounding: the replicas' gradients add in
/// another order).
#[test]
fn a_fully_sharded_mlp_checkpoint_resumes_on_other_grids() {
    let dir = scratch("mlp-fsdp");
    let run = |ranks: usize, ck: &Path, steps: usize, resume: Option<&Path>, extra: &[&str]| {
        let mut model = vec![
            "mnist-mlp",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--no-eval",
        ];
        model.extend(extra);
        checkpointed(&model, ranks, ck, steps, resume)
    };
    let fsdp = ["--data-parallel", "2", "--shard-state", "parameters"];
    let first = dir.join("first");
    let mut flags = fsdp.to_vec();
    flags.extend(["--schedule", "1f1b"]);
    run(4, &first, 2, None, &flags);
    for name in ["param/layer0.weight", "adam.m/layer0.weight"] {
        let (shape, pieces) = pieces_of(&first, name);
        assert_eq!(shape, serde_json::json!([100, 784]), "{name}");
        assert_eq!(pieces, [(1, 0), (1, 392)], "{name}");
    }
    let straight = dir.join("straight");
    run(1, &straight, 4, None, &[]);
    let want = consolidated(&straight, &dir, "straight");
    let zero2 = ["--data-parallel", "2", "--shard-state", "gradients"];
    for (case, (ranks, flags)) in [(1, &[][..]), (2, &fsdp[..]), (4, &zero2[..]), (2, &[][..])]
        .into_iter()
        .enumerate()
    {
        let ck = dir.join(format!("case{case}"));
        let text = run(ranks, &ck, 4, Some(&first), flags);
        assert!(text.contains("(4 ranks wrote it;"), "{text}");
        let got = consolidated(&ck, &dir, &format!("case{case}"));
        let (w, at) = common::worst(&got, &want);
        assert!(w < 1e-3, "4 → {ranks} ranks {flags:?}: {w:e} at {at}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The face head with its backbone fully sharded over 2 ranks
/// (`--shard-state parameters`): its checkpoint holds each backbone weight
/// as the 2 ranks' halves (beside the head's class shards), and continues
/// on 1 rank, on 3 ranks fully sharded (the shares re-split unevenly) and
/// on 2 with the gradients alone sharded as the unsharded run of 1 rank
/// does without a stop (to rounding: the ranks' gradients add in another
/// order).
#[test]
fn a_face_head_checkpoint_with_its_backbone_shared_out_resumes_on_other_ranks() {
    let dir = scratch("head-fsdp");
    let run = |ranks: usize, ck: &Path, resume: Option<&Path>, extra: &[&str]| {
        let mut model = vec![
            "face-head",
            "--classes",
            "40",
            "--dim",
            "16",
            "--batch-size",
            "24",
            "--no-eval",
        ];
        model.extend(extra);
        checkpointed(&model, ranks, ck, 4, resume)
    };
    let fsdp = ["--shard-state", "parameters"];
    let first = dir.join("first");
    run(
        2,
        &first,
        None,
        &["--shard-state", "parameters", "--stop-after", "2"],
    );
    for name in ["param/backbone0.weight", "adam.m/backbone1.weight"] {
        let (shape, pieces) = pieces_of(&first, name);
        assert_eq!(shape, serde_json::json!([16, 16]), "{name}");
        assert_eq!(pieces, [(0, 0), (0, 8)], "{name}");
    }
    let straight = dir.join("straight");
    run(1, &straight, None, &[]);
    let want = consolidated(&straight, &dir, "straight");
    let zero2 = ["--shard-state", "gradients"];
    for (case, (ranks, flags)) in [(1, &[][..]), (3, &fsdp[..]), (2, &zero2[..])]
        .into_iter()
        .enumerate()
    {
        let ck = dir.join(format!("case{case}"));
        let text = run(ranks, &ck, Some(&first), flags);
        assert!(text.contains("(2 ranks wrote it;"), "{text}");
        let got = consolidated(&ck, &dir, &format!("case{case}"));
        let (w, at) = common::worst(&got, &want);
        assert!(w < 1e-3, "2 → {ranks} ranks {flags:?}: {w:e} at {at}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--local-batch-norm` checkpoint of 2 replicas (each normalising its
/// own images) continues on 1 rank, where the flag has nothing to do and is
/// left out, and on 2 replicas with it. (Its running statistics, the
/// replicas' mean, are tested in `tests/vgg16.rs`.)
#[test]
fn a_local_batch_norm_checkpoint_resumes_on_one_rank_without_the_flag() {
    let dir = scratch("local-bn");
    let run = |ranks: usize, ck: &Path, steps, resume| {
        let flag: &[&str] = if ranks > 1 {
            &["--local-batch-norm"]
        } else {
            &[]
        };
        data_parallel_vgg16(ranks, ck, steps, resume, flag)
    };
    let first = dir.join("first");
    run(2, &first, 2, None);
    let start = consolidated(&first, &dir, "start");
    let manifest = std::fs::read_to_string(first.join("step-000000002/manifest.json")).unwrap();
    assert!(manifest.contains("buffer/bn1.running_mean"), "{manifest}");
    for ranks in [1, 2] {
        let ck = dir.join(format!("on{ranks}"));
        let text = run(ranks, &ck, 4, Some(&first));
        assert!(text.contains("(2 ranks wrote it;"), "{text}");
        let got = consolidated(&ck, &dir, &format!("on{ranks}"));
        assert!(common::worst(&got, &start).0 > 0.0, "{ranks}: no step ran");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_resumes_on_another_number_of_ranks() {
    // The head's classes: 1000 split 4 ways, then 2 and 3.
    reshards(
        "head",
        &[
            "face-head",
            "--classes",
            "1000",
            "--dim",
            "64",
            "--batch-size",
            "60",
            "--steps-per-epoch",
            "10",
            "--margin",
            "none",
        ],
        3,
        1e-4,
    );
    // Pipeline stages: 4 stages on 4 ranks, then 2 per rank, then 2-1-1.
    reshards(
        "pipeline",
        &["mnist-mlp", "--stages", "4", "--batch-size", "500"],
        3,
        1e-4,
    );
    // Channel shards (output split) and tensor-parallel shards.
    reshards("vgg16", &TINY_VGG16, 2, 1e-3);
    reshards(
        "tensor",
        &[
            "mnist-mlp",
            "--parallel",
            "tensor",
            "--batch-size",
            "500",
            "--units",
            "30",
        ],
        3,
        1e-4,
    );
}

#[test]
fn a_consolidated_model_gives_the_same_test_accuracy_on_one_rank() {
    use shardnet::models::mnist_mlp::{Config, MlpTraining};
    use shardnet::train::TrainModel;
    let dir = scratch("consolidate");
    let ck = dir.join("ck");
    let m = dir.join("m.json");
    train(&strings(&[
        "train",
        "mnist-mlp",
        "--ranks",
        "3",
        "--stages",
        "3",
        "--batch-size",
        "500",
        "--max-steps",
        "30",
        "--checkpoint-dir",
        &ck.display().to_string(),
        "--metrics",
        &m.display().to_string(),
    ]));
    let want = epochs(&m)[0]["test_accuracy"].as_f64().unwrap();
    let params = consolidated(&ck, &dir, "model");
    let cfg = Config {
        stages: Some(3),
        data: Some(data_dir()),
        ..Config::default()
    };
    let got = shardnet::comm::launch(1, |c| {
        let mut model = MlpTraining::new(&c, &cfg)?;
        for s in model.state() {
            if let Some(name) = s.name.strip_prefix("param/") {
                let v = params[name].flatten_all()?.to_vec1::<f32>()?;
                s.set_values(v)?;
            }
        }
        model.evaluate()
    })
    .unwrap()[0];
    assert!(want > 0.5, "{want}");
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(&dir);
}

fn fails(args: &[String]) -> String {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (out, text) = shardnet(&a);
    assert!(
        !out.status.success(),
        "shardnet {} succeeded:\n{text}",
        a.join(" ")
    );
    text
}

#[test]
fn a_checkpoint_of_another_model_or_setting_is_refused_naming_what_differs() {
    let dir = scratch("foreign");
    let ck = dir.join("ck");
    let c = ck.display().to_string();
    train(&tiny_mlp(&ck, &["--max-steps", "2"]));
    // Another learning rate and width.
    let text = fails(&tiny_mlp(
        &dir.join("x"),
        &[
            "--max-steps",
            "4",
            "--resume",
            &c,
            "--lr",
            "0.01",
            "--units",
            "50",
        ],
    ));
    assert!(
        text.contains("--lr: checkpoint 0.001, this run 0.01"),
        "{text}"
    );
    assert!(
        text.contains("--units: checkpoint 100, this run 50"),
        "{text}"
    );
    // Another model.
    let (out, text) = shardnet(&[
        "train",
        "face-head",
        "--classes",
        "100",
        "--dim",
        "8",
        "--max-steps",
        "2",
        "--resume",
        &c,
        "--checkpoint-dir",
        &dir.join("z").display().to_string(),
    ]);
    assert!(!out.status.success());
    assert!(
        text.contains("a checkpoint of mnist-mlp, not face-head"),
        "{text}"
    );
    // More epochs and steps, other outputs: fine.
    train(&tiny_mlp(
        &dir.join("y"),
        &[
            "--max-steps",
            "3",
            "--resume",
            &c,
            "--epochs",
            "9",
            "--keep",
            "1",
        ],
    ));
    // Another number of ranks where the model would change with it.
    let (out, text) = shardnet(&[
        "train",
        "mnist-mlp",
        "--ranks",
        "3",
        "--batch-size",
        "3000",
        "--max-steps",
        "3",
        "--no-eval",
        "--resume",
        &c,
    ]);
    assert!(!out.status.success());
    assert!(
        text.contains("written by 2 ranks, this run has 3"),
        "{text}"
    );
    assert!(text.contains("--stages"), "{text}");
    let g = dir.join("grouped").display().to_string();
    let vgg = |ranks: &str, extra: &[&str]| {
        let mut v = vec![
            "train",
            "vgg16",
            "--ranks",
            ranks,
            "--parallel-conv",
            "grouped",
            "--dataset",
            "synthetic",
            "--synthetic-examples",
            "16",
            "--batch-size",
            "8",
            "--width",
            "0.0625",
            "--no-eval",
            "--checkpoint-dir",
            &g,
        ];
        v.extend(extra);
        shardnet(&v)
    };
    assert!(vgg("2", &["--max-steps", "1"]).0.status.success());
    let (out, text) = vgg("3", &["--max-steps", "2", "--resume", &g]);
    assert!(!out.status.success());
    assert!(text.contains("grouped convolution"), "{text}");
    // A fresh run into a directory that holds another run's checkpoints.
    let text = fails(&tiny_mlp(&ck, &["--max-steps", "2"]));
    assert!(text.contains("holds checkpoints of another run"), "{text}");
    assert!(text.contains(&format!("--resume {c}")), "{text}");
    // Resuming an older checkpoint into the directory that holds later ones.
    train(&tiny_mlp(&ck, &["--max-steps", "4", "--resume", &c]));
    let older = ck.join("step-000000002").display().to_string();
    let text = fails(&tiny_mlp(&ck, &["--max-steps", "5", "--resume", &older]));
    assert!(text.contains("later checkpoints"), "{text}");
    train(&tiny_mlp(
        &dir.join("w"),
        &["--max-steps", "5", "--resume", &older],
    ));
    // No checkpoint there.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let text = fails(&tiny_mlp(
        &dir.join("z"),
        &["--resume", &empty.display().to_string()],
    ));
    assert!(text.contains("no checkpoint there"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_or_truncated_checkpoint_files_are_named() {
    let dir = scratch("corrupt");
    let ck = dir.join("ck");
    let c = ck.display().to_string();
    train(&tiny_mlp(&ck, &["--max-steps", "2"]));
    let step = ck.join("step-000000002");
    let file = step.join("rank-00001-of-00002.safetensors");
    let good = std::fs::read(&file).unwrap();
    let resume = tiny_mlp(&dir.join("out"), &["--max-steps", "3", "--resume", &c]);
    // One flipped bit in the data.
    let mut bad = good.clone();
    let at = bad.len() - 100;
    bad[at] ^= 1;
    std::fs::write(&file, &bad).unwrap();
    let text = fails(&resume);
    assert!(text.contains("rank-00001-of-00002.safetensors"), "{text}");
    assert!(text.contains("SHA-256"), "{text}");
    // Truncated.
    std::fs::write(&file, &good[..good.len() / 2]).unwrap();
    let text = fails(&resume);
    assert!(text.contains("truncated"), "{text}");
    // A header that is not JSON (same size).
    let mut bad = good.clone();
    bad[9] = b'#';
    std::fs::write(&file, &bad).unwrap();
    let text = fails(&resume);
    assert!(text.contains("rank-00001-of-00002.safetensors"), "{text}");
    std::fs::write(&file, &good).unwrap();
    // A manifest that is not one.
    let manifest = step.join("manifest.json");
    let m = std::fs::read(&manifest).unwrap();
    std::fs::write(&manifest, &m[..m.len() / 2]).unwrap();
    let text = fails(&resume);
    assert!(text.contains("manifest.json"), "{text}");
    assert!(
        text.contains("not a shardnet checkpoint manifest"),
        "{text}"
    );
    std::fs::write(&manifest, &m).unwrap();
    train(&resume);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unfinished_checkpoint_is_ignored_and_only_the_newest_are_kept() {
    let dir = scratch("keep");
    let ck = dir.join("ck");
    train(&tiny_mlp(
        &ck,
        &["--max-steps", "7", "--checkpoint-every", "2", "--keep", "2"],
    ));
    assert_eq!(step_dirs(&ck), ["step-000000006", "step-000000007"]);
    // A crash while writing step 9: its files but no manifest.
    let partial = ck.join("step-000000009");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("rank-00000-of-00002.safetensors"), b"half").unwrap();
    let text = train(&tiny_mlp(
        &dir.join("next"),
        &["--max-steps", "8", "--resume", &ck.display().to_string()],
    ));
    assert!(text.contains("step-000000007 at step 7"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGINT (or SIGTERM) during a run with `--checkpoint-dir`: every rank
/// finishes its step, the checkpoint is written, the message says how to
/// resume, and the resumed run goes on from there.
#[test]
fn a_signal_writes_a_checkpoint_and_says_how_to_resume() {
    use std::process::{Command, Stdio};
    use std::time::Duration;
    for (name, signal, status) in [("SIGINT", 2, 130), ("SIGTERM", 15, 143)] {
        let dir = scratch(&format!("signal-{name}"));
        let ck = dir.join("ck");
        let args = strings(&[
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
            "--epochs",
            "100000",
            "--checkpoint-dir",
            &ck.display().to_string(),
        ]);
        let child = Command::new(common::bin())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        common::signal(&child, signal);
        let out = common::ended(child, "the signal");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "{text}");
        assert!(
            text.contains(&format!("--resume {}", ck.display())),
            "{text}"
        );
        let steps = step_dirs(&ck);
        assert_eq!(steps.len(), 1, "{steps:?}");
        let step: usize = steps[0].trim_start_matches("step-").parse().unwrap();
        assert!(step >= 1);
        // It goes on from there.
        let mut resume = args.clone();
        let at = resume.iter().position(|a| a == "--epochs").unwrap();
        resume[at + 1] = ((step + 10) / 5).to_string();
        resume.extend(strings(&["--resume", &ck.display().to_string()]));
        let text = train(&resume);
        assert!(text.contains(&format!("at step {step}")), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `--log-dir`: a JSON line per step and per epoch (each rank's memory on
/// the steps where the ranks agree), `run.json`; a resumed run appends.
#[test]
fn the_log_has_a_line_per_step_and_per_epoch() {
    let dir = scratch("log");
    let log = dir.join("log");
    let l = log.display().to_string();
    let ck = dir.join("ck");
    let args = tiny_mlp(
        &ck,
        &["--log-dir", &l, "--max-steps", "30", "--epochs", "2"],
    );
    let mut first = args.clone();
    first.extend(strings(&["--stop-after", "25"]));
    train(&first);
    let mut resume = args.clone();
    resume.extend(strings(&["--resume", &ck.display().to_string()]));
    train(&resume);
    let lines = |f: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(log.join(f))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let steps = lines("steps.jsonl");
    let numbers: Vec<u64> = steps.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    let want: Vec<u64> = (1..=25).chain(26..=30).collect();
    assert_eq!(numbers, want);
    for s in &steps {
        for key in ["loss", "lr", "bytes_received", "time_s", "epoch"] {
            assert!(s[key].is_number(), "{key} in {s}");
        }
    }
    // Memory of both ranks at step 16 and at the end of epoch 1 (step 20).
    for at in [16, 20] {
        let m = steps[at - 1]["memory_bytes"].as_array().unwrap();
        assert_eq!(m.len(), 2);
        assert!(m.iter().all(|v| v.as_u64().unwrap() > 1 << 20));
    }
    let epochs = lines("epochs.jsonl");
    assert_eq!(epochs.len(), 2, "{epochs:?}");
    assert_eq!(epochs[0]["step"], 20);
    assert_eq!(epochs[1]["step"], 30);
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(log.join("run.json")).unwrap()).unwrap();
    assert_eq!(run["model"], "mnist-mlp");
    assert_eq!(run["ranks"], 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A flipped bit in the middle of a large tensor (a block read wholly,
/// hashed from memory) is found as surely as one in a block read in part.
#[test]
fn a_flipped_bit_inside_a_large_tensor_is_found() {
    let dir = scratch("large");
    let ck = dir.join("ck");
    let c = ck.display().to_string();
    let args = |extra: &[&str]| {
        let mut v = strings(&[
            "train",
            "face-head",
            "--ranks",
            "2",
            "--classes",
            "40000",
            "--dim",
            "512",
            "--batch-size",
            "32",
            "--steps-per-epoch",
            "4",
            "--no-eval",
            "--checkpoint-dir",
            &c,
        ]);
        v.extend(strings(extra));
        v
    };
    train(&args(&["--max-steps", "1"]));
    let file = ck.join("step-000000001/rank-00001-of-00002.safetensors");
    let good = std::fs::read(&file).unwrap();
    assert!(good.len() > 100 << 20, "{}", good.len());
    // 20 MiB in: inside the head's shard (41 MB), in a block read whole.
    let mut bad = good.clone();
    bad[20 << 20] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    let text = fails(&args(&["--max-steps", "2", "--resume", &c]));
    assert!(text.contains("bytes 16777216..33554432 differ"), "{text}");
    std::fs::write(&file, &good).unwrap();
    train(&args(&["--max-steps", "2", "--resume", &c]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Steps of 50 ms or more agree after every step (a signal then stops the
/// run after the step in progress, not up to 16 later): the log shows the
/// ranks' memory on every step.
#[test]
fn slow_steps_agree_after_every_step() {
    let dir = scratch("slow");
    let log = dir.join("log");
    train(&strings(&[
        "train",
        "face-head",
        "--ranks",
        "2",
        "--classes",
        "200000",
        "--dim",
        "256",
        "--batch-size",
        "256",
        "--max-steps",
        "4",
        "--no-eval",
        "--log-dir",
        &log.display().to_string(),
    ]));
    let text = std::fs::read_to_string(log.join("steps.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for l in &lines {
        assert!(l["memory_bytes"].is_array(), "{l}");
        assert!(l["samples_per_s"].as_f64().unwrap() < 256.0 / 0.05, "{l}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint written before `--optimizer` and its flags existed was
/// trained with Adam: it resumes under the defaults and is refused with SGD.
#[test]
fn a_checkpoint_from_before_the_optimizer_flags_resumes_as_adam() {
    use shardnet::train::checkpoint::differences;
    let s = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let old = s(&[("model", "face-head"), ("--lr", "0.01")]);
    let now = |opt: &str| {
        s(&[
            ("model", "face-head"),
            ("--lr", "0.01"),
            ("--optimizer", opt),
            ("--momentum", "0.9"),
            ("--weight-decay", "null"),
            ("--unfused-update", "false"),
        ])
    };
    assert!(differences(&old, &now("\"adam\"")).is_empty());
    let d = differences(&old, &now("\"sgd\""));
    assert_eq!(
        d,
        vec!["--optimizer: checkpoint \"adam\", this run \"sgd\"".to_string()]
    );
}

/// A consolidated VGG16 checkpoint (output channels split over 2 ranks)
/// holds what a single-device model needs, batch norm's running
/// statistics included (`bn1.running_mean`, …), and exactly what the same
/// run's `--save-params` wrote: the same names, the same bits.
#[test]
fn consolidate_keeps_the_running_statistics() {
    let dir = scratch("consolidate-buffers");
    let ck = dir.join("ck");
    let saved = dir.join("saved.safetensors");
    let (c, s) = (ck.display().to_string(), saved.display().to_string());
    let mut args = vec!["train"];
    args.extend(TINY_VGG16);
    args.extend(["--ranks", "2", "--max-steps", "2", "--no-eval"]);
    args.extend(["--checkpoint-dir", &c, "--save-params", &s]);
    let (o, text) = shardnet(&args);
    assert!(o.status.success(), "{text}");
    let whole = consolidated(&ck, &dir, "whole");
    let want: BTreeMap<String, Tensor> = candle_core::safetensors::load(&saved, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    assert!(whole.contains_key("bn13.running_var"), "{:?}", whole.keys());
    assert_eq!(
        whole.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, w) in &want {
        let got = whole[k].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            got,
            w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{k}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run that diverges stops before a checkpoint of the diverged step is
/// written: every kept checkpoint holds finite values only, the message
/// names the step and the settings to lower (--weight-decay where it is
/// set), and --keep deleted no good checkpoint for a bad one.
#[test]
fn a_diverged_run_writes_no_non_finite_checkpoint() {
    let dir = scratch("diverged");
    for (extra, names) in [
        (&["--lr", "1e20"][..], "lower --lr 1e20"),
        (
            &["--optimizer", "sgd", "--lr", "1", "--weight-decay", "1e9"][..],
            "or --weight-decay 1e9",
        ),
    ] {
        let ck = dir.join("ck");
        let _ = std::fs::remove_dir_all(&ck);
        let c = ck.display().to_string();
        let mut args = vec![
            "train",
            "mnist-mlp",
            "--ranks",
            "2",
            "--max-steps",
            "40",
            "--no-eval",
            "--checkpoint-dir",
            &c,
            "--checkpoint-every",
            "1",
            "--keep",
            "2",
        ];
        args.extend(extra);
        let (o, text) = shardnet(&args);
        assert!(!o.status.success(), "{text}");
        assert!(text.contains("the run diverged"), "{text}");
        assert!(text.contains(names), "{text}");
        let mut files = 0;
        for step in step_dirs(&ck) {
            for f in std::fs::read_dir(ck.join(step)).unwrap().flatten() {
                if f.path().extension().is_some_and(|e| e == "safetensors") {
                    files += 1;
                    for (k, t) in candle_core::safetensors::load(f.path(), &Device::Cpu).unwrap() {
                        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        assert!(v.iter().all(|x| x.is_finite()), "{k} in {:?}", f.path());
                    }
                }
            }
        }
        assert!(files > 0, "{text}: no checkpoint kept");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
