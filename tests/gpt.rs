//! The GPT on thread ranks: one rank against GPT-2's f64 definition; every
//! grid of tensor (t) × data (d) parallelism, with and without sequence
//! parallelism — heads that do not divide the ranks, a rank without a
//! head, positions and a batch that do not divide — gives one rank's
//! gradients (clipped by the global norm over every split) and, after
//! several AdamW steps, its parameters and losses; checkpoints resume bit
//! for bit and on other grids; the command trains and samples; bad
//! settings are refused naming their flag. The corpus is seeded text
//! written here.

mod common;
use candle_core::Tensor;
use shardnet::comm::launch_with_timeout;
use shardnet::models::gpt::{Config, GptTraining, Recompute};
use shardnet::train::{run, TrainModel};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

/// A text of 80 records of seeded words, separated as fortunes are.
fn corpus() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let words = [
            "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far",
        ];
        let u = common::uniform(7, 80 * 12);
        let mut text = String::new();
        for r in 0..80 {
            for w in 0..12 {
                text.push_str(words[(u[r * 12 + w] * 10.0) as usize % 10]);
                text.push(if w == 11 { '.' } else { ' ' });
            }
            text.push_str("\n%\n");
        }
        let path = common::scratch("gpt", "corpus").join("text");
        std::fs::write(&path, text).unwrap();
        path
    })
    .clone()
}

/// L = 4, D = 12, H = 3 (heads of 4), T = 9, batch 5, on t × d ranks,
/// dropout 0.1, gradients clipped to 0.05 (so that clipping acts on every
/// step).
fn config(t: usize, d: usize, steps: usize) -> Config {
    let mut cfg = Config {
        layers: 4,
        dim: 12,
        heads: 3,
        seq: 9,
        tensor_parallel: t,
        data_parallel: Some(d),
        batch_size: 5,
        dropout: 0.1,
        clip_grad_norm: Some(0.05),
        corpus: Some(corpus()),
        seed: 3,
        ..Config::default()
    };
    cfg.train.max_steps = Some(steps);
    cfg.train.evaluate = false;
    cfg.train.progress = false;
    cfg.train.schedule = shardnet::train::Schedule::WarmupCosine { warmup: 2 };
    cfg.train.lr = 1e-2;
    cfg
}

/// (ranks, t, d): 3 heads over 2 ranks (2 + 1), over 4 (one rank has
/// none), 5 windows over 2 and 3 groups, and 2 × 2.
const GRIDS: [(usize, usize, usize); 6] = [
    (2, 2, 1),
    (3, 3, 1),
    (4, 4, 1),
    (2, 1, 2),
    (3, 1, 3),
    (4, 2, 2),
];

/// (t, d) under sequence parallelism: 9 positions over 2, 3 and 4 ranks
/// (3 + 2 + 2 + 2), and 2 × 2.
const SEQUENCE_GRIDS: [(usize, usize); 4] = [(2, 1), (3, 1), (4, 1), (2, 2)];

/// Pipelines (t, p, d, micro-batches, schedule): each schedule, 4 stages
/// of one block, the interleaved one with 2 chunks a stage, gradient
/// accumulation on one rank, and pipelines inside t = 2 (sequence
/// parallel) and beside d = 2; and full recomputation.
fn pipelines() -> Vec<Config> {
    use shardnet::links::Schedule as S;
    let pipe = |t: usize, p: usize, d: usize, m: usize, s: S| Config {
        pipeline: p,
        micro_batches: m,
        schedule: Some(s),
        ..config(t, d, 1)
    };
    vec![
        pipe(1, 1, 1, 3, S::GPipe),
        pipe(1, 2, 1, 1, S::GPipe),
        pipe(1, 2, 1, 2, S::OneFOneB),
        pipe(1, 2, 1, 3, S::ZeroBubble),
        pipe(1, 2, 1, 4, S::Interleaved),
        pipe(1, 4, 1, 4, S::OneFOneB),
        Config {
            sequence_parallel: true,
            ..pipe(2, 2, 1, 2, S::OneFOneB)
        },
        pipe(1, 2, 2, 2, S::GPipe),
        // Each block recomputed in backward: alone, inside a sequence-
        // parallel group (its collectives run again), under zero-bubble
        // (weight gradients deferred) and interleaved stages.
        Config {
            recompute: Recompute::Full,
            ..pipe(1, 1, 1, 1, S::GPipe)
        },
        Config {
            recompute: Recompute::Full,
            sequence_parallel: true,
            ..pipe(2, 2, 1, 3, S::ZeroBubble)
        },
        Config {
            recompute: Recompute::Full,
            ..pipe(1, 2, 1, 4, S::Interleaved)
        },
    ]
}

fn describe(cfg: &Config) -> String {
    format!(
        "t {} × p {} × d {:?}, {} micro-batches, {}, sequence parallel {}, recompute {:?}",
        cfg.tensor_parallel,
        cfg.pipeline,
        cfg.data_parallel,
        cfg.micro_batches,
        cfg.schedule(),
        cfg.sequence_parallel,
        cfg.recompute
    )
}

fn first_gradients(t: usize, d: usize) -> BTreeMap<String, Tensor> {
    first_gradients_of(config(t, d, 1))
}

fn first_gradients_of(cfg: Config) -> BTreeMap<String, Tensor> {
    let ranks = cfg.tensor_parallel * cfg.pipeline * cfg.data_parallel.unwrap_or(1);
    let grads = launch_with_timeout(ranks, Duration::from_secs(60), |c| {
        GptTraining::new(&c, &cfg)?.gradients()
    })
    .unwrap();
    grads.into_iter().flatten().next().unwrap()
}

/// The first step's gradients, summed over the groups and clipped, equal
/// one rank's to 1e-5 of each tensor's largest (f32 sums in other orders).
#[test]
fn every_grid_gives_one_ranks_gradients() {
    let one = first_gradients(1, 1);
    // wte, wpe, ln_f (2), and 12 tensors a block.
    assert_eq!(one.len(), 2 + 2 + 4 * 12, "{:?}", one.keys());
    assert_eq!(
        one["transformer.h.1.attn.c_attn.weight"].dims(),
        [3, 12, 12]
    );
    for (_, t, d) in GRIDS {
        let (e, at) = common::worst(&first_gradients(t, d), &one);
        assert!(e <= 1e-5, "t {t} × d {d}: d{at} differs by {e:e}");
    }
    for (t, d) in SEQUENCE_GRIDS {
        let cfg = Config {
            sequence_parallel: true,
            ..config(t, d, 1)
        };
        let (e, at) = common::worst(&first_gradients_of(cfg), &one);
        assert!(
            e <= 1e-5,
            "sequence parallel t {t} × d {d}: d{at} differs by {e:e}"
        );
    }
    for cfg in pipelines() {
        let what = describe(&cfg);
        let (e, at) = common::worst(&first_gradients_of(cfg), &one);
        assert!(e <= 1e-5, "{what}: d{at} differs by {e:e}");
    }
}

/// Mixed precision (`--precision bf16`): tensor, sequence, data and
/// pipeline splits give one bf16 rank's first gradients. Data and pipeline
/// splits cut the rows, whose GEMMs are one rank's: to 1e-5 of each
/// tensor's largest, as in f32. A tensor-parallel split sums a GEMM's
/// partial products in another order (f32 rounding apart); where that
/// moves an activation across a bf16 rounding boundary, the next GEMM
/// reads it 2⁻⁸ (3.9e-3) of itself apart: to 8e-3 (measured: at most
/// 2e-3). On the generic path candle's bf16 matmul rounds its outputs,
/// each rank's share of dW among them, so every split is held to 8e-3
/// there. And bf16 is not f32: one bf16 rank's gradients lie further than
/// 1e-3 from one f32 rank's.
#[test]
fn bf16_splits_give_one_bf16_ranks_gradients() {
    use shardnet::links::Schedule as S;
    let bf16 = |cfg: Config| Config {
        precision: candle_core::DType::BF16,
        ..cfg
    };
    let one = first_gradients_of(bf16(config(1, 1, 1)));
    let (e, at) = common::worst(&one, &first_gradients(1, 1));
    assert!(e > 1e-3, "bf16 is f32: d{at} differs by {e:e} only");
    let splits = [
        config(2, 1, 1),
        config(3, 1, 1),
        config(1, 2, 1),
        config(2, 2, 1),
        Config {
            sequence_parallel: true,
            ..config(2, 1, 1)
        },
        Config {
            pipeline: 2,
            micro_batches: 2,
            schedule: Some(S::OneFOneB),
            ..config(1, 1, 1)
        },
        Config {
            recompute: Recompute::Full,
            ..config(2, 1, 1)
        },
    ];
    for cfg in splits {
        let what = describe(&cfg);
        let rows_only = cfg.tensor_parallel == 1 && shardnet::kernels::fast(&shardnet::comm::HOST);
        let bound = if rows_only { 1e-5 } else { 8e-3 };
        let (e, at) = common::worst(&first_gradients_of(bf16(cfg)), &one);
        assert!(e <= bound, "bf16 {what}: d{at} differs by {e:e}");
    }
}

fn train(t: usize, d: usize) -> (BTreeMap<String, Tensor>, f64) {
    train_of(config(t, d, 4))
}

fn train_of(cfg: Config) -> (BTreeMap<String, Tensor>, f64) {
    let ranks = cfg.tensor_parallel * cfg.pipeline * cfg.data_parallel.unwrap_or(1);
    let reports = launch_with_timeout(ranks, Duration::from_secs(60), |c| run(&c, &cfg)).unwrap();
    let r = reports.into_iter().flatten().next().unwrap();
    (r.params, r.metrics.epochs[0].train_loss)
}

/// After 4 AdamW steps (warm-up, cosine, clipping) every grid holds one
/// rank's parameters to 1e-4 of each tensor's largest, and its mean loss
/// to 1e-5: Adam's g/√v turns the f32 rounding of near-zero gradients into
/// steps of up to lr, which the gradients' own 1e-5 agreement bounds.
#[test]
fn every_grid_trains_one_ranks_parameters() {
    let (one, l1) = train(1, 1);
    for (_, t, d) in GRIDS {
        let (got, loss) = train(t, d);
        let (e, at) = common::worst(&got, &one);
        assert!(e <= 1e-4, "t {t} × d {d}: {at} differs by {e:e}");
        assert!(
            (loss - l1).abs() <= 1e-5 * l1,
            "t {t} × d {d}: loss {loss} vs {l1}"
        );
    }
    for (t, d) in SEQUENCE_GRIDS {
        let (got, loss) = train_of(Config {
            sequence_parallel: true,
            ..config(t, d, 4)
        });
        let (e, at) = common::worst(&got, &one);
        assert!(
            e <= 1e-4,
            "sequence parallel t {t} × d {d}: {at} differs by {e:e}"
        );
        assert!(
            (loss - l1).abs() <= 1e-5 * l1,
            "sequence parallel t {t}: {loss} vs {l1}"
        );
    }
    for mut cfg in pipelines() {
        let what = describe(&cfg);
        cfg.train.max_steps = Some(4);
        let (got, loss) = train_of(cfg);
        let (e, at) = common::worst(&got, &one);
        assert!(e <= 1e-4, "{what}: {at} differs by {e:e}");
        assert!(
            (loss - l1).abs() <= 1e-5 * l1,
            "{what}: loss {loss} vs {l1}"
        );
    }
}

/// Grids with data parallelism: 5 windows over 2 and 3 replicas (uneven
/// rows), 2 × 2 inside tensor parallelism (3 heads over 2 ranks; sequence
/// parallel too: the group's parts of the layer norms' gradients), and 2
/// pipeline stages × 2 replicas with 2 micro-batches.
fn replica_grids() -> Vec<Config> {
    vec![
        config(1, 2, 4),
        config(1, 3, 4),
        config(2, 2, 4),
        Config {
            sequence_parallel: true,
            ..config(2, 2, 4)
        },
        Config {
            pipeline: 2,
            micro_batches: 2,
            schedule: Some(shardnet::links::Schedule::OneFOneB),
            ..config(1, 2, 4)
        },
    ]
}

/// The optimizer's state sharded over the replicas (ZeRO stage 1,
/// `--shard-state optimizer`) trains the parameters of the same grid
/// without it, after 4 AdamW steps with clipping on every one: the
/// gradients are the same sums (a reduce-scatter adds in the allreduce's
/// order), the update is element by element; only the clip's norm is
/// summed in f64 in another grouping (each replica's rows first), whose
/// last bits may move the f32 factor, on every [`replica_grids`] grid.
/// Each replica holds a 1 / d share of the moments (but for the weights
/// sharded along another dimension, which keep theirs whole).
#[test]
fn sharded_optimizer_state_trains_the_unsharded_parameters() {
    use shardnet::optim::ShardState;
    for cfg in replica_grids() {
        let what = describe(&cfg);
        let (whole, l0) = train_of(cfg.clone());
        let sharded = Config {
            shard_state: ShardState::Optimizer,
            ..cfg.clone()
        };
        let (got, loss) = train_of(sharded.clone());
        let (e, at) = common::worst(&got, &whole);
        assert!(e <= 1e-6, "{what}: {at} differs by {e:e}");
        assert!(
            (loss - l0).abs() <= 1e-6 * l0,
            "{what}: loss {loss} vs {l0}"
        );
        // Each rank's moments: about 1 / d of the unsharded rank's.
        let ranks = cfg.tensor_parallel * cfg.pipeline * cfg.data_parallel.unwrap();
        let state = |c: &Config| {
            let c = c.clone();
            launch_with_timeout(ranks, Duration::from_secs(60), move |comm| {
                let t = GptTraining::new(&comm, &c)?;
                Ok(t.parts()
                    .opt
                    .state()
                    .iter()
                    .map(|s| s.shape.iter().product::<usize>())
                    .sum::<usize>())
            })
            .unwrap()
        };
        // With t > 1 the row-parallel weights (sharded along their inputs,
        // 5/12 of a block) keep their whole state.
        let d = cfg.data_parallel.unwrap() as f64;
        let bound = if cfg.tensor_parallel == 1 {
            1.0 / d + 0.05
        } else {
            (1.0 + 5.0 / 12.0 * (d - 1.0)) / d + 0.05
        };
        for (r, (a, b)) in state(&sharded).iter().zip(state(&cfg)).enumerate() {
            let share = *a as f64 / b as f64;
            assert!(
                share <= bound,
                "{what}: rank {r} holds {a} of {b} state elements"
            );
        }
    }
}

/// Fully sharded blocks (`--shard-state parameters`, ZeRO stage 3) train
/// the unsharded run's parameters (each with full recomputation) within
/// 1e-6 of each tensor's largest after 4 AdamW steps with dropout and
/// clipping, on every [`replica_grids`] grid: the same block computations
/// on the same gathered weights, the gradients reduce-scattered in the
/// allreduce's order (the clip's norm grouped by replica). Under gradient
/// accumulation each micro-batch's gradients are reduce-scattered before
/// they are summed: 1e-4, as between grids. Each replica holds about 1/d
/// of the blocks' parameters; the first step's gradients, gathered whole,
/// are the unsharded run's.
#[test]
fn fully_sharded_blocks_train_the_unsharded_parameters() {
    use shardnet::optim::ShardState;
    for cfg in replica_grids() {
        let cfg = Config {
            recompute: Recompute::Full,
            ..cfg
        };
        let what = describe(&cfg);
        let (whole, l0) = train_of(cfg.clone());
        let sharded = Config {
            shard_state: ShardState::Parameters,
            ..cfg.clone()
        };
        let (got, loss) = train_of(sharded.clone());
        assert_eq!(got.len(), whole.len(), "{what}");
        // Per micro-batch reduce-scatters add in another order: Adam's
        // g/√v turns that rounding into up to lr, as between grids.
        let tol = if cfg.micro_batches > 1 { 1e-4 } else { 1e-6 };
        let (e, at) = common::worst(&got, &whole);
        assert!(e <= tol, "{what}: {at} differs by {e:e}");
        assert!(
            (loss - l0).abs() <= 1e-6 * l0,
            "{what}: loss {loss} vs {l0}"
        );
        let g1 = first_gradients_of(Config {
            train: shardnet::train::Options {
                max_steps: Some(1),
                ..sharded.train.clone()
            },
            ..sharded.clone()
        });
        let g0 = first_gradients_of(cfg.clone());
        let (e, at) = common::worst(&g1, &g0);
        assert!(e <= 1e-6, "{what}: the gradient of {at} differs by {e:e}");
        // Each rank's parameters: its blocks' shares and the rest whole.
        let ranks = cfg.tensor_parallel * cfg.pipeline * cfg.data_parallel.unwrap();
        let held = |c: &Config| {
            let c = c.clone();
            launch_with_timeout(ranks, Duration::from_secs(60), move |comm| {
                let t = GptTraining::new(&comm, &c)?;
                Ok(t.parts()
                    .store
                    .params()
                    .iter()
                    .filter(|p| p.name().contains(".h."))
                    .map(|p| p.value().elem_count())
                    .sum::<usize>())
            })
            .unwrap()
        };
        let d = cfg.data_parallel.unwrap() as f64;
        for (r, (a, b)) in held(&sharded).iter().zip(held(&cfg)).enumerate() {
            let share = *a as f64 / b as f64;
            assert!(
                (share - 1.0 / d).abs() <= 0.05,
                "{what}: rank {r} holds {a} of its blocks' {b} parameters"
            );
        }
    }
}

/// A grid that is not the ranks, a width the heads do not divide, and a
/// missing corpus are refused, each naming its flag, on every rank.
#[test]
fn bad_settings_are_refused_naming_the_flag() {
    let refused = |cfg: Config, ranks: usize, want: &str| {
        let out = launch_with_timeout(ranks, Duration::from_secs(60), |c| {
            GptTraining::new(&c, &cfg).map(|_| ())
        });
        let e = out.expect_err("refused").to_string();
        assert!(e.contains(want), "{e}");
    };
    refused(
        config(2, 2, 1),
        2,
        "--tensor-parallel 2 × --pipeline 1 × --data-parallel 2",
    );
    refused(
        Config {
            heads: 5,
            ..config(1, 1, 1)
        },
        1,
        "--heads 5",
    );
    refused(
        Config {
            corpus: Some(PathBuf::from("/nonexistent/text")),
            ..config(1, 2, 1)
        },
        2,
        "--corpus /nonexistent/text",
    );
    refused(
        Config {
            seq: 5000,
            ..config(1, 1, 1)
        },
        1,
        "--seq 5000",
    );
    // Fully sharded blocks: without full recomputation, and under
    // zero-bubble (which defers the gradients
    // they hand on).
    use shardnet::optim::ShardState::Parameters;
    let fsdp = |cfg: Config| Config {
        shard_state: Parameters,
        recompute: Recompute::Full,
        ..cfg
    };
    refused(
        Config {
            recompute: Recompute::None,
            ..fsdp(config(1, 2, 1))
        },
        2,
        "--recompute full",
    );
    refused(
        Config {
            pipeline: 2,
            micro_batches: 2,
            schedule: Some(shardnet::links::Schedule::ZeroBubble),
            ..fsdp(config(1, 1, 1))
        },
        2,
        "--schedule zero-bubble",
    );
    // ZeRO stage 2 is VGG16's: the message says what the GPT shards.
    refused(
        Config {
            shard_state: shardnet::optim::ShardState::Gradients,
            ..config(1, 2, 1)
        },
        2,
        "--shard-state gradients: the GPT shards",
    );
}

/// GPT-2's forward in f64 on plain candle ops, written from the
/// definition (nanoGPT's layout: c_attn's rows are q, k, v in turn, heads
/// consecutive within each), independent of the layers under test.
mod definition {
    use candle_core::{DType, Tensor, Var, D};
    use std::collections::BTreeMap;

    fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        let mean = x.mean_keepdim(D::Minus1).unwrap();
        let c = x.broadcast_sub(&mean).unwrap();
        let var = c.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let inv = (var + 1e-5).unwrap().sqrt().unwrap().recip().unwrap();
        c.broadcast_mul(&inv)
            .unwrap()
            .broadcast_mul(w)
            .unwrap()
            .broadcast_add(b)
            .unwrap()
    }

    fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        let (o, i) = (
            w.elem_count() / x.dim(D::Minus1).unwrap(),
            x.dim(D::Minus1).unwrap(),
        );
        let w = w.reshape((o, i)).unwrap();
        let dims = x.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let y = x
            .reshape((rows, i))
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap();
        let mut out = dims.clone();
        *out.last_mut().unwrap() = o;
        y.broadcast_add(&b.reshape(o).unwrap())
            .unwrap()
            .reshape(out)
            .unwrap()
    }

    fn gelu(x: &Tensor) -> Tensor {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let inner = ((x + (x.powf(3.0).unwrap() * 0.044715).unwrap()).unwrap() * c).unwrap();
        ((x * 0.5).unwrap() * (inner.tanh().unwrap() + 1.0).unwrap()).unwrap()
    }

    fn softmax(s: &Tensor) -> Tensor {
        let m = s.max_keepdim(D::Minus1).unwrap();
        let e = s.broadcast_sub(&m).unwrap().exp().unwrap();
        e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
    }

    /// The mean next-token loss of `ids` against `targets` (B, T), and the
    /// gradient of every parameter, from `params` (f32, whole) taken as f64.
    pub fn loss_and_grads(
        params: &BTreeMap<String, Tensor>,
        ids: &[u32],
        targets: &[u32],
        (b, t): (usize, usize),
        (layers, heads): (usize, usize),
    ) -> (f64, BTreeMap<String, Tensor>) {
        let vars: BTreeMap<String, Var> = params
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    Var::from_tensor(&v.to_dtype(DType::F64).unwrap()).unwrap(),
                )
            })
            .collect();
        let p = |k: &str| vars[&format!("transformer.{k}")].as_tensor().clone();
        let wte = p("wte.weight");
        let d = wte.dim(1).unwrap();
        let hd = d / heads;
        let dev = wte.device().clone();
        let idx = Tensor::from_vec(ids.to_vec(), b * t, &dev).unwrap();
        let pos = p("wpe.weight").narrow(0, 0, t).unwrap();
        let mut x = wte
            .index_select(&idx, 0)
            .unwrap()
            .reshape((b, t, d))
            .unwrap()
            .broadcast_add(&pos)
            .unwrap();
        let mask: Vec<f64> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f64::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
        for l in 0..layers {
            let q = |k: &str| p(&format!("h.{l}.{k}"));
            let a = layer_norm(&x, &q("ln_1.weight"), &q("ln_1.bias"));
            let qkv = linear(&a, &q("attn.c_attn.weight"), &q("attn.c_attn.bias"));
            let head = |i: usize| {
                qkv.narrow(2, i * d, d)
                    .unwrap()
                    .reshape((b, t, heads, hd))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let (qh, kh, vh) = (head(0), head(1), head(2));
            let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let att = softmax(&s.broadcast_add(&mask).unwrap());
            let y = att
                .matmul(&vh)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((b, t, d))
                .unwrap();
            x = (x + linear(&y, &q("attn.c_proj.weight"), &q("attn.c_proj.bias"))).unwrap();
            let m = layer_norm(&x, &q("ln_2.weight"), &q("ln_2.bias"));
            let h = gelu(&linear(&m, &q("mlp.c_fc.weight"), &q("mlp.c_fc.bias")));
            x = (x + linear(&h, &q("mlp.c_proj.weight"), &q("mlp.c_proj.bias"))).unwrap();
        }
        let x = layer_norm(&x, &p("ln_f.weight"), &p("ln_f.bias"));
        let logits = x
            .reshape((b * t, d))
            .unwrap()
            .matmul(&wte.t().unwrap())
            .unwrap();
        let m = logits.max_keepdim(1).unwrap();
        let z = logits.broadcast_sub(&m).unwrap();
        let lse = z.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
        let logp = z.broadcast_sub(&lse).unwrap();
        let tg = Tensor::from_vec(targets.to_vec(), (b * t, 1), &dev).unwrap();
        let loss = (logp
            .gather(&tg, 1)
            .unwrap()
            .sum_all()
            .unwrap()
            .neg()
            .unwrap()
            / (b * t) as f64)
            .unwrap();
        let grads = loss.backward().unwrap();
        let g = vars
            .iter()
            .map(|(k, v)| (k.clone(), grads.get(v.as_tensor()).unwrap().clone()))
            .collect();
        (loss.to_scalar::<f64>().unwrap(), g)
    }
}

/// One rank's first loss and gradients (no clipping, no dropout) equal GPT-2's
/// definition in f64 on the same weights and windows, to 1e-5 of each
/// tensor's largest gradient (f32 arithmetic through two blocks).
#[test]
fn one_rank_equals_the_f64_definition() {
    use shardnet::data::{Corpus, Dataset, SerialIterator, TextWindows};
    use shardnet::train::TrainModel;
    let cfg = Config {
        clip_grad_norm: None,
        dropout: 0.0,
        ..config(1, 1, 1)
    };
    let out = launch_with_timeout(1, Duration::from_secs(60), |c| {
        let mut m = GptTraining::new(&c, &cfg)?;
        let params = m.gather_params()?;
        let grads = m.gradients()?;
        Ok((params, grads))
    })
    .unwrap();
    let (params, grads) = out.into_iter().next().unwrap();
    let (params, grads) = (params.unwrap(), grads.unwrap());
    // The same first batch: the iterator's seeded shuffle over the windows.
    let corpus = Corpus::read(cfg.corpus.as_deref()).unwrap();
    let windows =
        TextWindows::new(corpus.train.clone(), cfg.seq, &shardnet::comm::HOST, "t").unwrap();
    let mut it = SerialIterator::new(windows.len(), cfg.batch_size, Some(cfg.seed)).unwrap();
    let batch = it.next_batch(&windows).unwrap();
    let flat = |x: &Option<Tensor>| {
        x.as_ref()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    let (loss, want) = definition::loss_and_grads(
        &params,
        &flat(&batch.x),
        &flat(&batch.t),
        (cfg.batch_size, cfg.seq),
        (cfg.layers, cfg.heads),
    );
    let got: BTreeMap<String, Tensor> = grads
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(candle_core::DType::F64).unwrap()))
        .collect();
    let (e, at) = common::worst(&got, &want);
    assert!(e <= 1e-5, "d{at} differs from the f64 definition by {e:e}");
    assert!(
        loss > 5.0 && loss < 6.0,
        "the first loss {loss} is near ln 256"
    );
}

/// `shardnet train gpt` on 2 thread ranks (t = 2): trains from a text
/// file, prints the validation loss, writes the documented parameter names
/// with `--save-params`, and refuses a missing corpus naming the flag.
#[test]
fn the_command_trains_and_saves_gpt2_names() {
    let dir = common::scratch("gpt", "command");
    let out = dir.join("params.safetensors");
    let corpus = corpus().display().to_string();
    let mut args = tiny_gpt(&corpus);
    args.extend(["--max-steps", "3"]);
    let mut with_out = args.to_vec();
    let path = out.display().to_string();
    let ck = dir.join("ck").display().to_string();
    with_out.extend(["--save-params", &path, "--checkpoint-dir", &ck]);
    let (status, text) = common::shardnet(&with_out);
    assert!(status.status.success(), "{text}");
    assert!(text.contains("validation loss"), "{text}");
    assert!(text.contains("tokens/s"), "{text}");
    let saved = candle_core::safetensors::load(&out, &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    assert_eq!(names.len(), 4 + 12, "{names:?}");
    assert_eq!(saved["transformer.wte.weight"].dims(), [256, 8]);
    assert_eq!(
        saved["transformer.h.0.attn.c_attn.weight"].dims(),
        [3, 8, 8]
    );
    assert_eq!(saved["transformer.h.0.mlp.c_proj.weight"].dims(), [8, 32]);
    // Greedy samples from the parameter file (heads given) and from the
    // sharded checkpoint (heads recorded) are the same text.
    let sample = |model: &str, extra: &[&str]| {
        let mut a = vec!["sample", model, "--prompt", "the cat", "--tokens", "12"];
        a.extend(["--temperature", "0"]);
        a.extend(extra);
        let (status, text) = common::shardnet(&a);
        assert!(status.status.success(), "{text}");
        text
    };
    let from_file = sample(&path, &["--heads", "2"]);
    assert!(from_file.starts_with("the cat"), "{from_file}");
    assert_eq!(
        from_file.trim_end_matches('\n').len(),
        7 + 12,
        "{from_file:?}"
    );
    assert_eq!(sample(&ck, &[]), from_file);
    let (status, text) = common::shardnet(&["sample", &path]);
    assert!(!status.status.success());
    assert!(text.contains("--heads"), "{text}");
    let mut missing = args.to_vec();
    let at = missing.iter().position(|a| *a == "--corpus").unwrap() + 1;
    missing[at] = "/nonexistent/corpus";
    let (status, text) = common::shardnet(&missing);
    assert!(!status.status.success());
    assert!(text.contains("--corpus /nonexistent/corpus"), "{text}");
}

/// `train gpt` of a tiny GPT (L = 1, D = 8, H = 2, T = 8, batch 4) on 2
/// ranks, t = 2, on the text at `corpus`.
fn tiny_gpt(corpus: &str) -> Vec<&str> {
    vec![
        "train",
        "gpt",
        "--ranks",
        "2",
        "--tensor-parallel",
        "2",
        "--layers",
        "1",
        "--dim",
        "8",
        "--heads",
        "2",
        "--seq",
        "8",
        "--batch-size",
        "4",
        "--corpus",
        corpus,
    ]
}

/// `--tokenizer bpe`: a BPE learned from the training text (fewer tokens
/// than bytes), the model's vocabulary its size (wte split over t = 2),
/// `tokenizer.json` in the checkpoint directory and beside the parameter
/// file; `shardnet sample` finds it in both places and gives the same
/// text, which decodes to what the prompt began; a resumed run reads the
/// saved tokenizer back (a changed corpus cannot change the tokens), and
/// a model of a BPE vocabulary without its tokenizer is an error naming
/// where it looked. A --vocab-size without --tokenizer bpe is refused.
#[test]
fn a_bpe_tokenizer_is_learned_saved_and_sampled_with() {
    let dir = common::scratch("gpt", "bpe");
    let text = std::fs::read_to_string(corpus()).unwrap();
    let own = dir.join("text");
    std::fs::write(&own, &text).unwrap();
    let (c, ck, params) = (
        own.display().to_string(),
        dir.join("ck").display().to_string(),
        dir.join("p.safetensors").display().to_string(),
    );
    let train = |steps: &str, extra: &[&str]| {
        let mut a = tiny_gpt(&c);
        a.extend([
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "300",
            "--max-steps",
            steps,
            "--checkpoint-dir",
            &ck,
        ]);
        a.extend_from_slice(extra);
        common::shardnet(&a)
    };
    let (out, log) = train("2", &["--save-params", &params]);
    assert!(out.status.success(), "{log}");
    let saved = Path::new(&ck).join("tokenizer.json");
    let beside = dir.join("p.tokenizer.json");
    let json = std::fs::read_to_string(&saved).unwrap();
    assert_eq!(std::fs::read_to_string(&beside).unwrap(), json);
    let tok = shardnet::data::Tokenizer::from_json(&json).unwrap();
    assert!(tok.vocab_size() > 256 && tok.vocab_size() <= 300);
    let ids = tok.encode(text.as_bytes()).unwrap();
    assert!(
        ids.len() * 2 < text.len(),
        "{} tokens for {} bytes",
        ids.len(),
        text.len()
    );
    assert_eq!(tok.decode(&ids).unwrap(), text.as_bytes());
    let p = candle_core::safetensors::load(&params, &candle_core::Device::Cpu).unwrap();
    assert_eq!(p["transformer.wte.weight"].dims(), [300, 8]);

    let sample = |model: &str, extra: &[&str]| {
        let mut a = vec!["sample", model, "--prompt", "the cat", "--tokens", "6"];
        a.extend(["--temperature", "0"]);
        a.extend(extra);
        common::shardnet(&a)
    };
    let (o1, from_file) = sample(&params, &["--heads", "2"]);
    assert!(o1.status.success(), "{from_file}");
    assert!(from_file.starts_with("the cat"), "{from_file}");
    let (o2, from_ck) = sample(&ck, &[]);
    assert!(o2.status.success(), "{from_ck}");
    assert_eq!(from_ck, from_file);

    // Resumed with another text: the saved tokenizer, not a new one.
    std::fs::write(&own, "zzz qqq xxx\n%\n".repeat(400)).unwrap();
    let (out, log) = train("4", &["--resume", &ck]);
    assert!(out.status.success(), "{log}");
    assert_eq!(std::fs::read_to_string(&saved).unwrap(), json);

    std::fs::remove_file(&beside).unwrap();
    let (out, text) = sample(&params, &["--heads", "2"]);
    assert!(!out.status.success());
    assert!(
        text.contains("vocabulary of 300 tokens") && text.contains("p.tokenizer.json"),
        "{text}"
    );
    let (out, text) = sample(
        &params,
        &["--heads", "2", "--tokenizer", &saved.display().to_string()],
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(text, from_file);

    let (out, text) = common::shardnet(&[
        "train",
        "gpt",
        "--vocab-size",
        "300",
        "--corpus",
        &c,
        "--max-steps",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(text.contains("add --tokenizer bpe"), "{text}");
}

/// A run stopped after 2 of 4 steps on t = 2 resumes bit for bit on the
/// same grid, and on t = 3, t = 1 and t = 1 × d = 2 (every sharded tensor
/// re-split; the optimizer's moments too) to one run's parameters within
/// 1e-4 of each tensor's largest (sums in other orders, as between grids);
/// and with the optimizer's state sharded over the replicas, from and to
/// a checkpoint.
#[test]
fn a_checkpoint_resumes_bit_for_bit_and_on_another_grid() {
    let dir = common::scratch("gpt", "resume");
    let corpus = corpus().display().to_string();
    let run = |ranks: &str, t: &str, extra: &[&str], out: &str| {
        let mut args = vec![
            "train",
            "gpt",
            "--ranks",
            ranks,
            "--tensor-parallel",
            t,
            "--layers",
            "1",
            "--dim",
            "12",
            "--heads",
            "3",
            "--seq",
            "8",
            "--batch-size",
            "4",
            "--max-steps",
            "4",
            "--lr-warmup",
            "1",
            "--no-eval",
            "--corpus",
            &corpus,
        ];
        args.extend(extra);
        let path = dir.join(out);
        let path = path.display().to_string();
        if !out.is_empty() {
            args.extend(["--save-params", &path]);
        }
        let (status, text) = common::shardnet(&args);
        assert!(status.status.success(), "{args:?}: {text}");
        if out.is_empty() {
            return BTreeMap::new();
        }
        candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect::<BTreeMap<_, _>>()
    };
    let straight = run("2", "2", &[], "straight.st");
    let ck = dir.join("ck").display().to_string();
    run(
        "2",
        "2",
        &["--stop-after", "2", "--checkpoint-dir", &ck],
        "",
    );
    let fork = |name: &str| {
        let to = dir.join(name);
        let status = std::process::Command::new("cp")
            .args(["-r", &ck, &to.display().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        to.display().to_string()
    };
    let same = fork("same");
    let resumed = run("2", "2", &["--resume", &same], "same.st");
    for (k, v) in &straight {
        let (a, b) = (v.flatten_all().unwrap(), resumed[k].flatten_all().unwrap());
        assert_eq!(
            a.to_vec1::<f32>().unwrap(),
            b.to_vec1::<f32>().unwrap(),
            "{k} after resuming on the same grid"
        );
    }
    for (ranks, t) in [("3", "3"), ("1", "1"), ("2", "1")] {
        let at = fork(&format!("t{t}r{ranks}"));
        let got = run(ranks, t, &["--resume", &at], &format!("t{t}r{ranks}.st"));
        let (e, name) = common::worst(&got, &straight);
        assert!(
            e <= 1e-4,
            "resumed on {ranks} ranks, t {t}: {name} differs by {e:e}"
        );
    }
    // The optimizer's state sharded over 2 replicas (each replica's rows
    // of the moments), and the blocks fully sharded (each replica's shares
    // of the parameters and moments): each resumed from the whole
    // checkpoint, and its own checkpoint resumed whole on one rank and
    // sharded over 3 replicas.
    let zero1 = ["--shard-state", "optimizer"];
    let zero3 = ["--shard-state", "parameters", "--recompute", "full"];
    for (tag, flags) in [("zero1", &zero1[..]), ("zero3", &zero3[..])] {
        let at = fork(tag);
        let mut args = vec!["--resume", at.as_str()];
        args.extend(flags);
        let got = run("2", "1", &args, &format!("{tag}.st"));
        let (e, name) = common::worst(&got, &straight);
        assert!(
            e <= 1e-4,
            "{tag} resumed on 2 replicas: {name} differs by {e:e}"
        );
        let ck = dir.join(format!("ck-{tag}")).display().to_string();
        let mut first = vec!["--stop-after", "2", "--checkpoint-dir", &ck];
        first.extend(flags);
        run("2", "1", &first, "");
        for (ranks, extra) in [("1", &[][..]), ("3", flags)] {
            let to = dir.join(format!("ck-{tag}-{ranks}"));
            let status = std::process::Command::new("cp")
                .args(["-r", &ck, &to.display().to_string()])
                .status()
                .unwrap();
            assert!(status.success());
            let mut args = vec!["--resume", to.to_str().unwrap()];
            args.extend(extra);
            let got = run(ranks, "1", &args, &format!("{tag}-{ranks}.st"));
            let (e, name) = common::worst(&got, &straight);
            assert!(
                e <= 1e-4,
                "{tag}'s checkpoint resumed on {ranks} ranks {extra:?}: {name} differs by {e:e}"
            );
        }
    }
}
