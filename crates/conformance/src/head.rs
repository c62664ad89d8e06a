//! The sharded classifier suite: [`ShardedClassifier`] against the same head
//! on one device, written with plain candle ops in f64.
//!
//! Every rank builds the whole batch from a seed, gathers the head's shards
//! (for the reference only) and computes the one-device loss, accuracy,
//! feature gradient and weight gradient; its own results must match:
//! relative error (max |got − want| / max |want|) ≤ 1e-5 in f32, 2e-3 with
//! bf16 logits and 3e-4 with f16 logits (loss and both gradients; measured
//! worst cases 6e-4 and 4e-5), and the same top-1 count in f32. Where the
//! CPU has AVX-512 BF16, bf16 logits also mean bf16 inputs to the three
//! GEMMs (f32 sums; 8 bits of mantissa in x̂, W and the logits' gradient):
//! there the bound is 3e-2, the weight gradient's error taken against the
//! whole gradient's largest value (measured worst: 3.1e-3 at C = 11 and
//! 1.9e-2 for the feature gradient at C = 8229, both at d = 6, where a
//! logit's rounding error, s·2⁻⁹, does not average out over d).
//!
//! The one-device target logit goes through ψ as an elementwise candle op
//! whose derivative is [`Margin::psi_and_derivative`]; ψ itself is checked
//! against closed forms and finite differences in `links::margin`.
//!
//! B = 7 samples over C = 11 classes, so shards and per-rank batches are
//! uneven on 2–4 ranks; one sample points away from its class (cos θ ≈ −1),
//! so ArcFace's fallback and every SphereFace branch are reached (checked).
//! The near-π cases (two combined margins, and SphereFace at s = 30) take
//! d = 128 and put four samples at θ = π − 0.004 … π − 0.049 (checked after
//! rounding to f32), where f32 target cosines gave errors up to 4e-3; the
//! kernels compute the target's term in f64 and must meet 1e-5 there too.

use super::autograd::{close, values, Case};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, Var, D};
use shardnet::comm::Communicator;
use shardnet::functions as f;
use shardnet::functions::Context;
use shardnet::functions::Margin;
use shardnet::links::ShardedClassifier;
use shardnet::{Error, Result};

const B: usize = 7;
const C: usize = 11;
const DIM: usize = 6;
const SEED: u64 = 17;
/// The feature width of the near-π cases.
const NEAR_PI_DIM: usize = 128;
/// π − θ of the near-π cases' first samples (the rest are seeded).
const NEAR_PI_GAPS: [f64; 4] = [0.004, 0.012, 0.03, 0.049];

/// Every case: each margin with data-parallel and replicated features, the
/// half-precision logits, Partial FC, and accumulation over two steps.
pub fn cases() -> Vec<Case> {
    let mut all: Vec<Case> = Vec::new();
    for (name, margin) in margins() {
        push_both_forms(
            &mut all,
            name,
            Setup {
                margin,
                ..Setup::default()
            },
        );
    }
    // Targets within 0.05 of θ = π at d = 128, where ψ′ of the combined
    // margin grows as 1/sin θ and f32 cosines lose their last digits.
    for (name, margin, scale) in [
        (
            "combined",
            Margin::Combined {
                m1: 1.0,
                m2: 0.3,
                m3: 0.2,
            },
            None,
        ),
        (
            "combined_0.9_0.4_0.15",
            Margin::Combined {
                m1: 0.9,
                m2: 0.4,
                m3: 0.15,
            },
            None,
        ),
        ("sphereface_s30", Margin::SphereFace { m: 4 }, Some(30.0)),
    ] {
        push_both_forms(
            &mut all,
            &format!("{name}_near_pi_d{NEAR_PI_DIM}"),
            Setup {
                margin,
                scale,
                dim: NEAR_PI_DIM,
                near_pi: true,
                ..Setup::default()
            },
        );
    }
    for (logits, tol) in [(DType::BF16, bf16_tol()), (DType::F16, 3e-4)] {
        all.push((
            format!("head_arcface_{}_logits_within_{tol:e}", logits.as_str()),
            Box::new(move |c| {
                check(
                    c,
                    Setup {
                        margin: Margin::ArcFace { m: 0.5 },
                        logits,
                        tol,
                        ..Setup::default()
                    },
                )
            }),
        ));
    }
    for (name, margin) in [
        ("none", Margin::None),
        ("arcface", Margin::ArcFace { m: 0.5 }),
    ] {
        all.push((
            format!("head_{name}_partial_fc_half_vs_one_device_on_its_sample"),
            Box::new(move |c| {
                check(
                    c,
                    Setup {
                        margin,
                        rate: 0.5,
                        ..Setup::default()
                    },
                )
            }),
        ));
        // ⌈0.99·C_r⌉ = C_r: the sampling path keeps every class, and must be
        // exactly the full head.
        all.push((
            format!("head_{name}_partial_fc_all_classes_is_the_full_head"),
            Box::new(move |c| {
                check(
                    c,
                    Setup {
                        margin,
                        rate: 0.99,
                        ..Setup::default()
                    },
                )
            }),
        ));
        all.push((
            format!("head_{name}_two_steps_accumulate"),
            Box::new(move |c| {
                check(
                    c,
                    Setup {
                        margin,
                        steps: 2,
                        ..Setup::default()
                    },
                )
            }),
        ));
    }
    // More classes than one class block of the kernels (and a short last
    // block on every rank count): the blocked softmax statistics, the
    // per-block maxima of half-precision logits, a sample across blocks.
    let many = 2 * f::CLASS_BLOCK * 4 + 37;
    for (name, margin, logits, tol, rate) in [
        ("none", Margin::None, DType::F32, 1e-5, 1.0),
        ("arcface", Margin::ArcFace { m: 0.5 }, DType::F32, 1e-5, 1.0),
        (
            "arcface_bf16",
            Margin::ArcFace { m: 0.5 },
            DType::BF16,
            bf16_tol(),
            1.0,
        ),
        // Plain logits: at s = 64 a sampled shard of a few hundred classes
        // on 12 ranks sits at f32's floor (1.04e-5, from |z|·ε of the logits).
        ("partial_fc", Margin::None, DType::F32, 1e-5, 0.5),
    ] {
        all.push((
            format!("head_{name}_{many}_classes_in_class_blocks"),
            Box::new(move |c| {
                check(
                    c,
                    Setup {
                        margin,
                        logits,
                        tol,
                        rate,
                        classes: many,
                        ..Setup::default()
                    },
                )
            }),
        ));
    }
    // The same at d = 128 (its first samples near θ = π, as the near-π
    // cases place them): the f32 logits (x̂ · Wᵀ, 7 rows, class blocks of
    // up to 1024) run on `sgemm` where the CPU has AVX-512
    // (`kernels::dot::matmul_abt`), the shapes above on the `gemm` crate.
    // Plain logits: with ArcFace the near-π targets put the generic path's
    // weight gradient at f32's floor on 6 ranks (1.08e-5).
    all.push((
        format!("head_none_{many}_classes_at_d{NEAR_PI_DIM}"),
        Box::new(move |c| {
            check(
                c,
                Setup {
                    dim: NEAR_PI_DIM,
                    near_pi: true,
                    classes: many,
                    ..Setup::default()
                },
            )
        }),
    ));
    all.push((
        "head_ties_and_nan_are_not_hits".into(),
        Box::new(ties_and_nan),
    ));
    all
}

/// The tolerance of bf16 logits: 2e-3 with f32 GEMMs, 3e-2 where the GEMMs
/// take bf16 inputs (AVX-512 BF16; see the module doc).
fn bf16_tol() -> f64 {
    if shardnet::kernels::bf16::has_avx512_bf16() {
        3e-2
    } else {
        2e-3
    }
}

/// Push `setup` as two cases: data-parallel and replicated features.
fn push_both_forms(all: &mut Vec<Case>, name: &str, setup: Setup) {
    for replicated in [false, true] {
        let form = if replicated {
            "replicated"
        } else {
            "data_parallel"
        };
        let s = Setup {
            replicated,
            ..setup
        };
        all.push((
            format!("head_{name}_{form}_vs_one_device"),
            Box::new(move |c| check(c, s)),
        ));
    }
}

/// Top-1 counts neither a tie nor NaN: all-zero features give equal plain
/// logits (no hit; the old rule counted all B), and a NaN feature row is no
/// hit while features equal to their class centre are.
fn ties_and_nan(comm: &Context) -> Result<()> {
    let _eval = comm.no_grad();
    let labels: Vec<u32> = (0..B).map(|i| ((i * 5 + 3) % C) as u32).collect();
    let plain = ShardedClassifier::new(comm, C, DIM, Margin::None, SEED)?;
    let zeros = Tensor::zeros((B, DIM), DType::F32, comm.device())?;
    let hits = plain.evaluate(&zeros, &labels)?.correct;
    super::check(hits == 0, || {
        format!("all logits equal: {hits} of {B} counted as hits")
    })?;
    let head = ShardedClassifier::new(comm, C, DIM, Margin::Normalized, SEED)?;
    let w = comm.allgather(head.weight.value())?;
    let idx = Tensor::new(labels.as_slice(), comm.device())?;
    let mut x = w.index_select(&idx, 0)?.to_vec2::<f32>()?;
    x[0][0] = f32::NAN;
    let x = Tensor::new(x, comm.device())?;
    let hits = head.evaluate(&x, &labels)?.correct;
    super::check(hits == B - 1, || {
        format!(
            "features at their class centres, row 0 NaN: {hits} hits, want {}",
            B - 1
        )
    })
}

/// Run every case ([`super::Tally::run`]: the ranks agree on each outcome).
pub fn run_all(comm: &Communicator, tally: &mut super::Tally) -> Result<()> {
    for (name, body) in cases() {
        // A fresh tape per case: a failed case's pending ops stay behind.
        let cx = &Context::new(comm);
        tally.run(comm, &name, || body(cx))?;
    }
    Ok(())
}

fn margins() -> Vec<(&'static str, Margin)> {
    vec![
        ("none", Margin::None),
        ("normalized", Margin::Normalized),
        ("cosface", Margin::CosFace { m: 0.35 }),
        ("arcface", Margin::ArcFace { m: 0.5 }),
        ("sphereface", Margin::SphereFace { m: 4 }),
        (
            "combined",
            Margin::Combined {
                m1: 0.9,
                m2: 0.4,
                m3: 0.15,
            },
        ),
    ]
}

#[derive(Clone, Copy)]
struct Setup {
    margin: Margin,
    replicated: bool,
    logits: DType,
    tol: f64,
    rate: f64,
    steps: usize,
    /// s, if not the margin's default.
    scale: Option<f64>,
    /// The feature width d.
    dim: usize,
    /// Whether the first samples lie within 0.05 of θ = π ([`NEAR_PI_GAPS`]).
    near_pi: bool,
    /// The head's classes.
    classes: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            margin: Margin::None,
            replicated: false,
            logits: DType::F32,
            tol: 1e-5,
            rate: 1.0,
            steps: 1,
            scale: None,
            dim: DIM,
            near_pi: false,
            classes: C,
        }
    }
}

fn fail(what: String) -> Error {
    Error::Usage(format!("head conformance: {what}"))
}

fn check(comm: &Context, s: Setup) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let dim = s.dim;
    let c = s.classes;
    let mut head = ShardedClassifier::new(comm, c, dim, s.margin, SEED)?;
    head.logits = s.logits;
    head.sample_rate = s.rate;
    if let Some(scale) = s.scale {
        head.scale = scale;
    }
    let w_full = comm.allgather(head.weight.value())?;
    let labels: Vec<u32> = (0..B).map(|i| ((i * 5 + 3) % c) as u32).collect();
    let target_row = |i: usize| -> Result<Vec<f64>> {
        Ok(w_full
            .get(labels[i] as usize)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?)
    };
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    let cos = |a: &[f64], b: &[f64]| -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>() / (norm(a) * norm(b))
    };
    // Features: seeded, except sample 0, which points away from its class,
    // and with `near_pi` the first samples, at angles π − gap from theirs.
    let mut x = values(SEED, B * dim);
    let w0 = target_row(0)?;
    for (k, v) in x[..dim].iter_mut().enumerate() {
        *v = -w0[k] + 0.1 * *v;
    }
    if s.near_pi {
        for (i, gap) in NEAR_PI_GAPS.into_iter().enumerate() {
            let row = &mut x[i * dim..(i + 1) * dim];
            let w = target_row(i)?;
            let w_norm = norm(&w);
            let what: Vec<f64> = w.iter().map(|v| v / w_norm).collect();
            // A seeded direction orthogonal to ŵ_y, and lengths 0.75 … 1.5.
            let along: f64 = row.iter().zip(&what).map(|(a, b)| a * b).sum();
            row.iter_mut().zip(&what).for_each(|(v, w)| *v -= along * w);
            let p_norm = norm(row);
            let len = 0.5 + (i as f64 + 1.0) / 4.0;
            for (v, w) in row.iter_mut().zip(&what) {
                let p = *v / p_norm;
                // Rounded to f32 here, so the angle checked is the one run.
                *v = (len * (-gap.cos() * w + gap.sin() * p)) as f32 as f64;
            }
            let theta = cos(row, &w).clamp(-1.0, 1.0).acos();
            let pi = std::f64::consts::PI;
            if !(theta > pi - 0.05 && theta < pi) {
                return Err(fail(format!(
                    "near-π sample {i} has θ = π − {:.3e}",
                    pi - theta
                )));
            }
        }
    }
    let cos0 = cos(&x[..dim], &w0);
    if cos0 > (std::f64::consts::PI - 0.5).cos() {
        return Err(fail(format!(
            "sample 0 has cos θ = {cos0}: ArcFace's fallback is not reached"
        )));
    }
    let x_full = Tensor::from_vec(x, (B, dim), comm.device())?;

    let rows = shardnet::comm::chunk_range(B, n, rank);
    let mine = if s.replicated {
        x_full.clone()
    } else {
        x_full.narrow(0, rows.start, rows.len())?
    };
    let xv = Var::from_tensor(&mine.to_dtype(DType::F32)?)?;
    let (mut loss, mut correct, mut sample) = (0f64, 0, None);
    let mut grads = None;
    for _ in 0..s.steps {
        let feats = if s.replicated {
            f::copy_to_shards(comm, xv.as_tensor())?
        } else {
            f::allgather(comm, xv.as_tensor(), 0)?
        };
        let out = head.forward(&feats, &labels)?;
        loss = out.loss.to_scalar::<f32>()? as f64;
        correct = out.correct;
        let mut g = out.loss.backward()?;
        head.weight.absorb(&mut g)?;
        let gx = g
            .get(xv.as_tensor())
            .cloned()
            .unwrap_or(xv.as_tensor().zeros_like()?);
        grads = Some(match grads {
            None => gx,
            Some(prev) => (prev + gx)?,
        });
        sample = out.sample;
    }
    let gx = grads.ok_or_else(|| fail("no steps".into()))?;
    let gw = head
        .weight
        .take_grad()
        .ok_or_else(|| fail("no weight gradient".into()))?;

    // The classes that took part: this step's samples of every rank.
    let cols = match sample {
        Some(sm) => {
            let mut all: Vec<u32> = comm.allgather_obj(&sm)?.concat();
            all.sort_unstable();
            Some(all)
        }
        None => None,
    };
    if s.rate == 0.99 && cols.as_ref().map(Vec::len) != Some(c) {
        return Err(fail(format!(
            "a 0.99 sample kept {:?} classes",
            cols.map(|c| c.len())
        )));
    }
    let r = reference(
        &x_full,
        &w_full,
        &labels,
        s.margin,
        head.scale,
        cols.as_deref(),
    )?;
    let steps = s.steps as f64;
    let tol = s.tol;
    close(
        "loss",
        &Tensor::new(loss, comm.device())?,
        &Tensor::new(r.loss, comm.device())?,
        tol,
    )?;
    let want_dx = if s.replicated {
        r.dx.clone()
    } else {
        r.dx.narrow(0, rows.start, rows.len())?
    };
    close("feature gradient", &gx, &(want_dx * steps)?, tol)?;
    let want_dw = r.dw.narrow(0, head.offset(), head.local_classes())?;
    if gw.elem_count() == 0 {
        // An empty shard (fewer classes than ranks): nothing to compare.
    } else if s.logits == DType::BF16 && shardnet::kernels::bf16::has_avx512_bf16() {
        // bf16 GEMMs: the shard's error against the whole gradient's
        // largest value (a shard of negligible probabilities has a gradient
        // of ~1e-12, where 8 bits of mantissa say nothing relative to it).
        let scale = r.dw.abs()?.max_all()?.to_scalar::<f64>()? * steps;
        let err = (&gw.to_dtype(DType::F64)? - (want_dw * steps)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        if err > tol * scale {
            return Err(fail(format!(
                "weight gradient: error {:.2e} of the whole gradient's largest {scale:.3e}, \
                 over {tol:e}",
                err / scale
            )));
        }
    } else {
        close("weight gradient", &gw, &(want_dw * steps)?, tol)?;
    }
    if correct != r.correct && s.logits == DType::F32 {
        return Err(fail(format!(
            "{correct} correct, one device says {}",
            r.correct
        )));
    }
    Ok(())
}

struct Reference {
    loss: f64,
    dx: Tensor,
    dw: Tensor,
    correct: usize,
}

/// The head on one device in f64: logits over every class (or `cols`),
/// log-softmax, mean negative log-likelihood.
fn reference(
    x: &Tensor,
    w: &Tensor,
    labels: &[u32],
    margin: Margin,
    scale: f64,
    cols: Option<&[u32]>,
) -> Result<Reference> {
    let xv = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
    let wv = Var::from_tensor(&w.to_dtype(DType::F64)?)?;
    let classes = w.dims2()?.0;
    let onehot: Vec<f64> = labels
        .iter()
        .flat_map(|&l| (0..classes).map(move |c| f64::from(u8::from(c == l as usize))))
        .collect();
    let onehot = Tensor::from_vec(onehot, (B, classes), &shardnet::comm::HOST)?;
    let unit =
        |t: &Tensor| -> Result<Tensor> { Ok(t.broadcast_div(&t.sqr()?.sum_keepdim(1)?.sqrt()?)?) };
    let (z, raw) = if margin.normalizes() {
        let cos = unit(xv.as_tensor())?.matmul(&unit(wv.as_tensor())?.t()?)?;
        let cos_t = (&cos * &onehot)?.sum(1)?;
        let psi_t = cos_t.apply_op1(Psi(margin))?;
        let shift = onehot.broadcast_mul(&(psi_t - &cos_t)?.unsqueeze(1)?)?;
        (((&cos + shift)? * scale)?, (cos * scale)?)
    } else {
        let z = xv.as_tensor().matmul(&wv.as_tensor().t()?)?;
        (z.clone(), z)
    };
    let (z, raw, onehot) = match cols {
        Some(cols) => {
            let idx = Tensor::new(cols, &shardnet::comm::HOST)?;
            (
                z.index_select(&idx, 1)?,
                raw.index_select(&idx, 1)?,
                onehot.index_select(&idx, 1)?,
            )
        }
        None => (z, raw, onehot),
    };
    let logp = candle_nn::ops::log_softmax(&z, D::Minus1)?;
    let loss = (logp * &onehot)?.sum(1)?.neg()?.mean_all()?;
    let grads = loss.backward()?;
    let correct = shardnet::functions::top1_hits(&raw, &onehot.argmax(1)?)?;
    let get = |v: &Var| -> Result<Tensor> {
        Ok(grads
            .get(v.as_tensor())
            .cloned()
            .unwrap_or(v.as_tensor().zeros_like()?))
    };
    Ok(Reference {
        loss: loss.to_scalar::<f64>()?,
        dx: get(&xv)?,
        dw: get(&wv)?,
        correct,
    })
}

/// ψ elementwise, for the one-device reference.
struct Psi(Margin);

impl CustomOp1 for Psi {
    fn name(&self) -> &'static str {
        "reference-psi"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F64(v) = s else {
            candle_core::bail!("psi: f64 only")
        };
        let n = l.shape().elem_count();
        let out = v[l.start_offset()..l.start_offset() + n]
            .iter()
            .map(|&c| self.0.psi(c));
        Ok((CpuStorage::F64(out.collect()), l.shape().clone()))
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let d: Vec<f64> = arg
            .to_vec1::<f64>()?
            .iter()
            .map(|&c| self.0.psi_and_derivative(c).1)
            .collect();
        Ok(Some(
            (grad * Tensor::from_vec(d, arg.shape(), arg.device())?)?,
        ))
    }
}
