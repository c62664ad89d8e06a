//! The transformer's layers against their definitions in f64: values and
//! every gradient, over random shapes (a single feature, a single row, a
//! constant row), on the path this run takes (CI runs the suite on the CPU
//! kernels and again with `SHARDNET_KERNELS=generic`).
//!
//! The reference gradients are central differences of the f64 definition
//! (step 1e-6: truncation ~1e-12, rounding ~1e-10, far below the bounds),
//! so they share no formula with the layers' backward. Bounds: the f32
//! layer's values within 2e-5 and its gradients within 2e-4 of the
//! largest reference value (f32 rounding through a row's mean and variance,
//! and through γ's sum over the rows); on the generic path a constant row's
//! values within 1e-4 (its mean in f32, the rounding magnified by 1/√ε).

mod common;

use candle_core::{Device, Tensor, Var};
use proptest::prelude::*;
use shardnet::nn::{
    causal_attention, causal_self_attention, gelu, LayerNorm, ParamStore, ATTENTION_BLOCK,
};

const EPS: f64 = 1e-5;
const STEP: f64 = 1e-6;

/// Seeded values in [-2, 2).
fn values(seed: u64, n: usize) -> Vec<f64> {
    common::uniform(seed, n)
        .iter()
        .map(|u| u * 4.0 - 2.0)
        .collect()
}

/// The largest |r − g| over the largest |r| (at least 1).
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Central differences of `f` at each element of `at`.
fn numeric(at: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    (0..at.len())
        .map(|i| {
            let (mut hi, mut lo) = (at.to_vec(), at.to_vec());
            hi[i] += STEP;
            lo[i] -= STEP;
            (f(&hi) - f(&lo)) / (2.0 * STEP)
        })
        .collect()
}

/// LayerNorm's definition: rows of `d`, biased variance, eps inside.
fn layer_norm(x: &[f64], g: &[f64], b: &[f64], d: usize) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|row| {
            let n = d as f64;
            let m = row.iter().sum::<f64>() / n;
            let v = row.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n;
            row.iter()
                .enumerate()
                .map(move |(k, x)| (x - m) / (v + EPS).sqrt() * g[k] + b[k])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// GELU's tanh form (GPT-2's).
fn gelu_f64(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|x| *x as f32).collect()
}

/// A tensor's f32 values in row-major order.
fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn back(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

fn check_layer_norm(lead: (usize, usize), d: usize, constant_row: bool, seed: u64) {
    let dev = Device::Cpu;
    let rows = lead.0 * lead.1;
    let mut x = back(&f32s(&values(seed, rows * d)));
    if constant_row {
        x[..d].fill(0.75);
    }
    let g = back(&f32s(&values(seed + 1, d)));
    let b = back(&f32s(&values(seed + 2, d)));
    let w = back(&f32s(&values(seed + 3, rows * d)));
    let store = ParamStore::new(&dev, 0);
    let ln = LayerNorm::new(&store.pp("ln"), d, EPS).unwrap();
    let [gp, bp] = [&ln.params()[0], &ln.params()[1]];
    gp.var()
        .set(&Tensor::from_vec(f32s(&g), d, &dev).unwrap())
        .unwrap();
    bp.var()
        .set(&Tensor::from_vec(f32s(&b), d, &dev).unwrap())
        .unwrap();
    let xv =
        Var::from_tensor(&Tensor::from_vec(f32s(&x), (lead.0, lead.1, d), &dev).unwrap()).unwrap();
    let y = ln.forward(xv.as_tensor()).unwrap();
    let wt = Tensor::from_vec(f32s(&w), (lead.0, lead.1, d), &dev).unwrap();
    let grads = (&y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
    let got_y = flat(&y);
    let dx = flat(grads.get(&xv).unwrap());
    let dg: Vec<f32> = gp.grad().unwrap().to_vec1().unwrap();
    let db: Vec<f32> = bp.grad().unwrap().to_vec1().unwrap();

    let loss = |x: &[f64], g: &[f64], b: &[f64]| -> f64 {
        layer_norm(x, g, b, d)
            .iter()
            .zip(&w)
            .map(|(y, w)| y * w)
            .sum()
    };
    let what = format!("LayerNorm lead {lead:?}, d = {d}, constant row {constant_row}");
    // The generic path takes a row's mean in f32: for a constant row x − μ
    // is that rounding (up to 2⁻²⁴ of x), multiplied by 1/√ε ≈ 316 and γ.
    let generic_constant = constant_row && !shardnet::kernels::fast(&dev);
    let bound = if generic_constant { 1e-4 } else { 2e-5 };
    let e = rel(&got_y, &layer_norm(&x, &g, &b, d));
    assert!(e <= bound, "{what}: y off by {e:e}");
    let e = rel(&dx, &numeric(&x, |x| loss(x, &g, &b)));
    assert!(e <= 2e-4, "{what}: dx off by {e:e}");
    let e = rel(&dg, &numeric(&g, |g| loss(&x, g, &b)));
    assert!(e <= 2e-4, "{what}: dγ off by {e:e}");
    let e = rel(&db, &numeric(&b, |b| loss(&x, &g, b)));
    assert!(e <= 2e-4, "{what}: dβ off by {e:e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn layer_norm_matches_its_definition(
        a in 1usize..4, b in 1usize..4, d in 1usize..24, constant in any::<bool>(), seed in 0u64..1000
    ) {
        check_layer_norm((a, b), d, constant, seed);
    }

    #[test]
    fn gelu_matches_its_definition(n in 1usize..64, scale in 0.5f64..6.0, seed in 0u64..1000) {
        let dev = Device::Cpu;
        let mut x: Vec<f64> = values(seed, n).iter().map(|v| v * scale).collect();
        x[0] = 0.0;
        let x = back(&f32s(&x));
        let w = back(&f32s(&values(seed + 1, n)));
        let xv = Var::from_tensor(&Tensor::from_vec(f32s(&x), n, &dev).unwrap()).unwrap();
        let y = gelu(xv.as_tensor()).unwrap();
        let wt = Tensor::from_vec(f32s(&w), n, &dev).unwrap();
        let grads = (&y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
        let got: Vec<f32> = y.to_vec1().unwrap();
        let dx: Vec<f32> = grads.get(&xv).unwrap().to_vec1().unwrap();
        let want: Vec<f64> = x.iter().map(|v| gelu_f64(*v)).collect();
        let e = rel(&got, &want);
        prop_assert!(e <= 2e-5, "gelu: y off by {:e}", e);
        let loss = |x: &[f64]| x.iter().zip(&w).map(|(x, w)| gelu_f64(*x) * w).sum::<f64>();
        let e = rel(&dx, &numeric(&x, loss));
        prop_assert!(e <= 2e-4, "gelu: dx off by {:e}", e);
    }
}

/// A LayerNorm's rows with one feature normalise to β, with no gradient
/// into x; a single row of many features is checked like any other.
#[test]
fn layer_norm_edges() {
    check_layer_norm((1, 1), 1, false, 3);
    check_layer_norm((1, 1), 37, false, 4);
    check_layer_norm((2, 3), 5, true, 5);
    // Backward's blocks of 64 rows: three, the last short.
    check_layer_norm((2, 70), 6, false, 6);
}

/// Causal attention's definition, one head (T × d each): softmax over the
/// keys up to each query of q·k/√d, times v.
fn attention_f64(q: &[f64], k: &[f64], v: &[f64], t: usize, d: usize) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; t * d];
    for i in 0..t {
        let s: Vec<f64> = (0..=i)
            .map(|j| (0..d).map(|x| q[i * d + x] * k[j * d + x]).sum::<f64>() * scale)
            .collect();
        let top = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|s| (s - top).exp()).collect();
        let z: f64 = e.iter().sum();
        for (j, e) in e.iter().enumerate() {
            for x in 0..d {
                out[i * d + x] += e / z * v[j * d + x];
            }
        }
    }
    out
}

fn check_attention(b: usize, h: usize, t: usize, d: usize, seed: u64) {
    let dev = Device::Cpu;
    let n = b * h * t * d;
    let [q, k, v, w] = [0, 1, 2, 3].map(|i| back(&f32s(&values(seed * 4 + i, n))));
    let vars: Vec<Var> = [&q, &k, &v]
        .iter()
        .map(|x| Var::from_tensor(&Tensor::from_vec(f32s(x), (b, h, t, d), &dev).unwrap()).unwrap())
        .collect();
    let out = causal_attention(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    )
    .unwrap();
    let wt = Tensor::from_vec(f32s(&w), (b, h, t, d), &dev).unwrap();
    let grads = (&out * &wt).unwrap().sum_all().unwrap().backward().unwrap();
    let got = flat(&out);
    let per = t * d;
    let all = |q: &[f64], k: &[f64], v: &[f64]| -> Vec<f64> {
        (0..b * h)
            .flat_map(|hd| {
                let r = hd * per..(hd + 1) * per;
                attention_f64(&q[r.clone()], &k[r.clone()], &v[r], t, d)
            })
            .collect()
    };
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        all(q, k, v).iter().zip(&w).map(|(o, w)| o * w).sum()
    };
    let what = format!("attention (B, H, T, d) = ({b}, {h}, {t}, {d})");
    let e = rel(&got, &all(&q, &k, &v));
    assert!(e <= 2e-5, "{what}: out off by {e:e}");
    let wants = [
        numeric(&q, |q| loss(q, &k, &v)),
        numeric(&k, |k| loss(&q, k, &v)),
        numeric(&v, |v| loss(&q, &k, v)),
    ];
    for ((name, var), want) in ["dq", "dk", "dv"].iter().zip(&vars).zip(&wants) {
        let g = flat(grads.get(var).unwrap());
        let e = rel(&g, want);
        assert!(e <= 2e-4, "{what}: {name} off by {e:e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn attention_matches_its_definition(
        b in 1usize..3, h in 1usize..3, t in 1usize..10, d in 1usize..6, seed in 0u64..1000
    ) {
        check_attention(b, h, t, d, seed);
    }
}

/// One query, heads of size 1, and sequences across a block of keys.
#[test]
fn attention_edges() {
    check_attention(1, 1, 1, 1, 1);
    check_attention(1, 2, 5, 1, 2);
    check_attention(1, 1, ATTENTION_BLOCK + 3, 2, 3);
    check_attention(2, 1, 2 * ATTENTION_BLOCK + 1, 1, 4);
}

/// Causal self-attention of a fused (B, T, 3·H·d) qkv, by its definition:
/// head h's q, k, v at h·d of each position's three parts, its output at
/// h·d of (B, T, H·d).
fn self_attention_f64(qkv: &[f64], (b, h, t, d): (usize, usize, usize, usize)) -> Vec<f64> {
    let width = 3 * h * d;
    let mut y = vec![0f64; b * t * h * d];
    for bb in 0..b {
        for hh in 0..h {
            let part = |p: usize| -> Vec<f64> {
                (0..t)
                    .flat_map(|i| {
                        let at = (bb * t + i) * width + p * h * d + hh * d;
                        qkv[at..at + d].to_vec()
                    })
                    .collect()
            };
            let out = attention_f64(&part(0), &part(1), &part(2), t, d);
            for i in 0..t {
                let at = (bb * t + i) * h * d + hh * d;
                y[at..at + d].copy_from_slice(&out[i * d..(i + 1) * d]);
            }
        }
    }
    y
}

fn check_self_attention(b: usize, h: usize, t: usize, d: usize, seed: u64) {
    let dev = Device::Cpu;
    let shape = (b, h, t, d);
    let qkv = back(&f32s(&values(seed * 2, b * t * 3 * h * d)));
    let w = back(&f32s(&values(seed * 2 + 1, b * t * h * d)));
    let var =
        Var::from_tensor(&Tensor::from_vec(f32s(&qkv), (b, t, 3 * h * d), &dev).unwrap()).unwrap();
    let out = causal_self_attention(var.as_tensor(), h).unwrap();
    assert_eq!(out.dims(), &[b, t, h * d]);
    let wt = Tensor::from_vec(f32s(&w), (b, t, h * d), &dev).unwrap();
    let grads = (&out * &wt).unwrap().sum_all().unwrap().backward().unwrap();
    let got = flat(&out);
    let what = format!("self-attention (B, H, T, d) = {shape:?}");
    let e = rel(&got, &self_attention_f64(&qkv, shape));
    assert!(e <= 2e-5, "{what}: out off by {e:e}");
    let want = numeric(&qkv, |x| {
        self_attention_f64(x, shape)
            .iter()
            .zip(&w)
            .map(|(o, w)| o * w)
            .sum()
    });
    let g = flat(grads.get(&var).unwrap());
    let e = rel(&g, &want);
    assert!(e <= 2e-4, "{what}: dqkv off by {e:e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn self_attention_matches_its_definition(
        b in 1usize..3, h in 1usize..4, t in 1usize..9, d in 1usize..5, seed in 0u64..1000
    ) {
        check_self_attention(b, h, t, d, seed);
    }
}

/// One position, heads of size 1, and sequences across a block of queries.
#[test]
fn self_attention_edges() {
    check_self_attention(1, 1, 1, 1, 5);
    check_self_attention(2, 3, 4, 1, 6);
    check_self_attention(1, 2, ATTENTION_BLOCK + 2, 2, 7);
}

/// A width that is not 3 × heads × head dim, and a qkv of two dimensions,
/// are refused with what to give.
#[test]
fn self_attention_refuses_bad_shapes() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 2, 10), candle_core::DType::F32, &dev).unwrap();
    let e = causal_self_attention(&x, 2).unwrap_err().to_string();
    assert!(e.contains("10 features for 2 heads"), "{e}");
    let e = causal_self_attention(&x.get(0).unwrap(), 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("(batch, seq, 3 × heads × head dim)"), "{e}");
}
