//! The settings a checkpoint records and a resume must match: compared by
//! field, shown by the caller's names; which may change, and the values of
//! settings older checkpoints predate.

use super::*;

/// Settings that may change between a checkpoint and its resume, by field
/// (see [`field`]): how long to train, what to write, and where, how a
/// pipeline is scheduled and placed, and over how many data-parallel
/// replicas the batch is spread; the rest must match.
pub const RESUMABLE_CHANGES: [&str; 22] = [
    "epochs",
    "max_steps",
    "metrics",
    "no_eval",
    "warmup_steps",
    "checkpoint_dir",
    "checkpoint_every",
    "keep",
    "resume",
    "log_dir",
    "save_params",
    "stop_after",
    // How a pipeline runs, not what it computes: every schedule and
    // placement trains the same parameters.
    "schedule",
    "virtual_stages",
    "balance",
    // Over how many replicas the global batch is spread: the same global
    // batch, gradient and synchronised batch norm on any number (the
    // optimizer's state, sharded over the replicas, is re-split). With
    // --local-batch-norm the batch statistics come from other slices after
    // the change, as in PyTorch's DDP resumed on another number of ranks;
    // the parameters, the optimizer's state and the running statistics
    // (averaged over the replicas) carry over whole.
    "data_parallel",
    // Whether the replicas shard the optimizer's state: a checkpoint holds
    // it as shards of the whole state, re-split on resume.
    "shard_state",
    // How a tensor-parallel group splits each layer (the GPT's heads,
    // features and vocabulary): every sharded tensor is re-split, and the
    // same model trains on any number.
    "tensor_parallel",
    // Where a group keeps the activations between its regions: the same
    // parameters and gradients either way.
    "sequence_parallel",
    // Over how many stages a model's blocks are cut: each rank restores
    // its blocks' tensors by name, and the same model trains.
    "pipeline",
    // What backward recomputes: the same values either way.
    "recompute",
    // Whose statistics batch norm takes in training (each replica's, or the
    // whole batch's): the same parameters, state and running statistics
    // either way, so that a --local-batch-norm run can continue on one
    // rank, where the flag has nothing to do.
    "local_batch_norm",
];

/// The field a setting's name denotes: the name without leading dashes,
/// `-` and `_` alike. The caller names settings as its users know them
/// (the `shardnet` command: by flag, `--max-steps`); a checkpoint compares
/// them by field (`max_steps`) and shows them by the caller's name.
pub fn field(name: &str) -> String {
    name.trim_start_matches('-').replace('-', "_")
}

/// Settings added after checkpoints were first written, by field, with the
/// value (as recorded: JSON) that gives what a checkpoint without them was
/// trained with: such a checkpoint resumes with those values and is refused
/// with others.
pub const ADDED_SETTINGS: [(&str, &str); 8] = [
    ("optimizer", "\"adam\""),
    ("momentum", "0.9"),
    ("weight_decay", "null"),
    ("unfused_update", "false"),
    ("local_batch_norm", "false"),
    ("tokenizer", "\"bytes\""),
    ("vocab_size", "null"),
    ("precision", "\"f32\""),
];

/// The settings of `ours` that differ from the checkpoint's, compared by
/// [`field`] ([`RESUMABLE_CHANGES`] aside; a setting of [`ADDED_SETTINGS`]
/// the checkpoint lacks counts at its value there), as one line each, named
/// as `ours` names them (else as the checkpoint does).
pub fn differences(theirs: &[(String, String)], ours: &[(String, String)]) -> Vec<String> {
    // field → (name shown, value)
    let map = |s: &[(String, String)]| -> BTreeMap<String, (String, String)> {
        s.iter()
            .map(|(k, v)| (field(k), (k.clone(), v.clone())))
            .filter(|(f, _)| !RESUMABLE_CHANGES.contains(&f.as_str()))
            .collect()
    };
    let (mut a, b) = (map(theirs), map(ours));
    for (f, then) in ADDED_SETTINGS {
        if let (Some((name, _)), false) = (b.get(f), a.contains_key(f)) {
            a.insert(f.to_string(), (name.clone(), then.to_string()));
        }
    }
    let mut out = Vec::new();
    for f in a.keys().chain(b.keys().filter(|f| !a.contains_key(*f))) {
        let (x, y) = (a.get(f), b.get(f));
        if x.map(|p| &p.1) != y.map(|p| &p.1) {
            let name = y.or(x).map_or(f.as_str(), |p| p.0.as_str());
            let show =
                |v: Option<&(String, String)>| v.map_or("(not set)".to_string(), |p| p.1.clone());
            out.push(format!(
                "{name}: checkpoint {}, this run {}",
                show(x),
                show(y)
            ));
        }
    }
    out
}
