//! A 2-D convolution in float64 from its definition, with its gradients for
//! the loss Σ y ⊙ v, by plain loops: the reference of the convolution
//! property tests (independent of candle's conv2d and of our kernels).

/// One convolution's shapes: x (n, c, h, w), W (o, c, kh, kw), stride s,
/// padding p on both axes.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub s: usize,
    pub p: usize,
}

impl Geometry {
    /// (Ho, Wo).
    pub fn out(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.p - self.kh) / self.s + 1,
            (self.w + 2 * self.p - self.kw) / self.s + 1,
        )
    }
}

/// y, dL/dx, dL/dW, dL/db for L = Σ y ⊙ v (flat, row-major).
pub struct Reference {
    pub y: Vec<f64>,
    pub dx: Vec<f64>,
    pub dw: Vec<f64>,
    pub db: Vec<f64>,
}

/// The convolution of x by W (+ b) and the gradients of Σ y ⊙ v.
pub fn conv_reference(g: &Geometry, x: &[f64], wt: &[f64], b: &[f64], v: &[f64]) -> Reference {
    let (ho, wo) = g.out();
    let mut r = Reference {
        y: vec![0.0; g.n * g.o * ho * wo],
        dx: vec![0.0; x.len()],
        dw: vec![0.0; wt.len()],
        db: vec![0.0; g.o],
    };
    let xi = |bb: usize, c: usize, iy: usize, ix: usize| ((bb * g.c + c) * g.h + iy) * g.w + ix;
    let wi = |o: usize, c: usize, i: usize, j: usize| ((o * g.c + c) * g.kh + i) * g.kw + j;
    for bb in 0..g.n {
        for o in 0..g.o {
            for oy in 0..ho {
                for ox in 0..wo {
                    let yi = ((bb * g.o + o) * ho + oy) * wo + ox;
                    let mut acc = b.get(o).copied().unwrap_or(0.0);
                    let dy = v[yi];
                    r.db[o] += dy;
                    for c in 0..g.c {
                        for i in 0..g.kh {
                            let iy = (oy * g.s + i) as isize - g.p as isize;
                            if iy < 0 || iy >= g.h as isize {
                                continue;
                            }
                            for j in 0..g.kw {
                                let ix = (ox * g.s + j) as isize - g.p as isize;
                                if ix < 0 || ix >= g.w as isize {
                                    continue;
                                }
                                let (xk, wk) =
                                    (xi(bb, c, iy as usize, ix as usize), wi(o, c, i, j));
                                acc += wt[wk] * x[xk];
                                r.dw[wk] += dy * x[xk];
                                r.dx[xk] += dy * wt[wk];
                            }
                        }
                    }
                    r.y[yi] = acc;
                }
            }
        }
    }
    r
}

/// max |got − want| / max |want| (0 when both are all zero).
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    if err == 0.0 {
        0.0
    } else {
        err / scale.max(1e-300)
    }
}

/// `count` values in [−1, 1) from `seed` (a 64-bit LCG), rounded to f32 so
/// that an f32 run sees exactly the reference's inputs.
pub fn values(seed: u64, count: usize) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            (2.0 * u - 1.0) as f32 as f64
        })
        .collect()
}

use candle_core::{DType, Tensor, Var};
use shardnet::functions::Context;
use shardnet::links::{Features, InputParallelConv2d, OutputParallelConv2d, ParallelConvolution2D};
use shardnet::nn::{Conv2d, Param, ParamStore, Whole};

/// f32 tensor of `v` shaped `dims`.
fn tensor(v: &[f64], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, &shardnet::comm::HOST)
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("a tensor")
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("values")
}

/// The inputs of one property case: x, W, b, v, from `seed`.
pub fn inputs(g: &Geometry, seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (ho, wo) = g.out();
    (
        values(seed, g.n * g.c * g.h * g.w),
        values(seed + 1, g.o * g.c * g.kh * g.kw),
        values(seed + 2, g.o),
        values(seed + 3, g.n * g.o * ho * wo),
    )
}

/// The same reference on |x|, |W|, |b|, |v|: each entry's Σ |terms|, the
/// scale an f32 sum of those terms is accurate to (the condition of the
/// sum: a db that cancels to 0.004 from 36 terms of ±1 is not known to
/// 1e-5 of 0.004 in f32, by any summation order).
pub fn magnitudes(g: &Geometry, x: &[f64], w: &[f64], b: &[f64], v: &[f64]) -> Reference {
    let abs = |a: &[f64]| a.iter().map(|t| t.abs()).collect::<Vec<_>>();
    conv_reference(g, &abs(x), &abs(w), &abs(b), &abs(v))
}

/// Every entry within `tol` of its Σ |terms| (`mag`), else a message.
fn within(what: &str, got: &[f64], want: &[f64], mag: &[f64], tol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    let e = got
        .iter()
        .zip(want)
        .zip(mag)
        .map(|((a, b), m)| (a - b).abs() / m.max(1e-30))
        .fold(0f64, f64::max);
    if e <= tol {
        Ok(())
    } else {
        Err(format!(
            "{what}: error {e:.2e} of the entry's Σ|terms| over {tol:e} (largest relative to \
             the largest value: {:.2e})",
            rel_err(got, want)
        ))
    }
}

/// `nn::Conv2d` (whichever kernels the process uses) against the
/// reference: y, dx, dW, db, each entry within 1e-5 of its Σ|terms|.
pub fn check_conv2d(g: &Geometry, seed: u64) -> Result<(), String> {
    let (x, w, b, v) = inputs(g, seed);
    let r = conv_reference(g, &x, &w, &b, &v);
    let (ho, wo) = g.out();
    let err = |e: shardnet::Error| e.to_string();
    let wp = Param::new("w", &tensor(&w, &[g.o, g.c, g.kh, g.kw])).map_err(err)?;
    let bp = Param::new("b", &tensor(&b, &[g.o])).map_err(err)?;
    let conv = Conv2d::new(wp.clone(), Some(bp.clone()), g.s, g.p).map_err(err)?;
    let xv = Var::from_tensor(&tensor(&x, &[g.n, g.c, g.h, g.w])).map_err(|e| e.to_string())?;
    let y = conv.forward(xv.as_tensor()).map_err(err)?;
    let vt = tensor(&v, &[g.n, g.o, ho, wo]);
    let grads = y
        .mul(&vt)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.backward())
        .map_err(|e| e.to_string())?;
    let dx = grads.get(xv.as_tensor()).ok_or("no dx")?;
    let m = magnitudes(g, &x, &w, &b, &v);
    within("y", &flat(&y), &r.y, &m.y, 1e-5)?;
    within("dx", &flat(dx), &r.dx, &m.dx, 1e-5)?;
    within("dW", &flat(wp.grad().ok_or("no dW")?), &r.dw, &m.dw, 1e-5)?;
    within("db", &flat(bp.grad().ok_or("no db")?), &r.db, &m.db, 1e-5)
}

/// A layer's `whole(Some(last rank))`, kept for after backward.
type Gather = Box<dyn Fn() -> shardnet::Result<Option<Whole>>>;

/// A channel-parallel form under property test.
#[derive(Clone, Copy, Debug)]
pub enum Form {
    /// ChainerMN's grouped convolution (own losses: here every rank's loss
    /// is Σ y ⊙ v, so the gradients are n times the one-loss ones).
    Grouped,
    /// The grouped convolution with one loss.
    GroupedOneLoss,
    /// Output channels split, gathered.
    Output,
    /// Output channels split, left sharded (each rank's loss: its chunk).
    OutputSharded,
    /// Input channels split.
    Input,
    /// Input channels split, sharded in and out.
    InputSharded,
}

/// The grouped convolution's structure: 1 where weight (o, c) is used.
fn group_mask(g: &Geometry, n: usize) -> Vec<f64> {
    let mut m = vec![0.0; g.o * g.c * g.kh * g.kw];
    for r in 0..n {
        for o in shardnet::comm::chunk_range(g.o, n, r) {
            for c in (r..g.c).step_by(n) {
                for k in 0..g.kh * g.kw {
                    m[(o * g.c + c) * g.kh * g.kw + k] = 1.0;
                }
            }
        }
    }
    m
}

/// A channel-parallel layer built from the whole weights on `n` thread
/// ranks, against the reference (for the grouped forms, of the dense
/// weight with zeros outside the groups): every rank's y and dx as it sees
/// them, and the whole weight and bias gradients gathered on the last rank.
pub fn check_channel_parallel(g: &Geometry, seed: u64, n: usize, form: Form) -> Result<(), String> {
    let (x, w0, b, v) = inputs(g, seed);
    let grouped = matches!(form, Form::Grouped | Form::GroupedOneLoss);
    let mask = group_mask(g, n);
    let w: Vec<f64> = if grouped {
        w0.iter().zip(&mask).map(|(a, m)| a * m).collect()
    } else {
        w0.clone()
    };
    let r = conv_reference(g, &x, &w, &b, &v);
    let mag = magnitudes(g, &x, &w, &b, &v);
    let scale = if matches!(form, Form::Grouped) {
        n as f64
    } else {
        1.0
    };
    let (ho, wo) = g.out();
    let g = *g;
    let outs = shardnet::comm::launch(n, move |comm| {
        let ctx = Context::new(&comm);
        let store = ParamStore::new(comm.device(), 1);
        let (rank, size) = (comm.rank(), comm.size());
        let wt = tensor(&w0, &[g.o, g.c, g.kh, g.kw]);
        let bt = tensor(&b, &[g.o]);
        let xt = tensor(&x, &[g.n, g.c, g.h, g.w]);
        let vt = tensor(&v, &[g.n, g.o, ho, wo]);
        let cin = shardnet::comm::chunk_range(g.c, size, rank);
        let cout = shardnet::comm::chunk_range(g.o, size, rank);
        let xv = match form {
            Form::InputSharded => Var::from_tensor(&xt.narrow(1, cin.start, cin.len())?)?,
            _ => Var::from_tensor(&xt)?,
        };
        let (y, whole): (Tensor, Gather) = match form {
            Form::Grouped | Form::GroupedOneLoss => {
                let l = ParallelConvolution2D::from_weights(
                    &ctx,
                    &store.pp("c"),
                    &wt,
                    Some(&bt),
                    g.s,
                    g.p,
                )?;
                let l = if matches!(form, Form::GroupedOneLoss) {
                    l.replicated()
                } else {
                    l
                };
                (
                    l.forward(xv.as_tensor())?,
                    Box::new(move || l.whole(Some(size - 1))),
                )
            }
            Form::Output | Form::OutputSharded => {
                let l = OutputParallelConv2d::from_weights(
                    &ctx,
                    &store.pp("c"),
                    &wt,
                    Some(&bt),
                    g.s,
                    g.p,
                )?;
                let l = if matches!(form, Form::OutputSharded) {
                    l.sharded_output()
                } else {
                    l
                };
                (
                    l.forward(xv.as_tensor())?,
                    Box::new(move || l.whole(Some(size - 1))),
                )
            }
            Form::Input | Form::InputSharded => {
                let sharded = match form {
                    Form::InputSharded => Features::Sharded,
                    _ => Features::Whole,
                };
                let l = InputParallelConv2d::from_weights(
                    &ctx,
                    &store.pp("c"),
                    &wt,
                    Some(&bt),
                    g.s,
                    g.p,
                    sharded,
                )?;
                (
                    l.forward(xv.as_tensor())?,
                    Box::new(move || l.whole(Some(size - 1))),
                )
            }
        };
        let sharded_out = matches!(form, Form::OutputSharded | Form::InputSharded);
        let v_mine = if sharded_out {
            vt.narrow(1, cout.start, cout.len())?
        } else {
            vt
        };
        let grads = y.mul(&v_mine)?.sum_all()?.backward()?;
        let dx = grads
            .get(xv.as_tensor())
            .cloned()
            .unwrap_or(xv.as_tensor().zeros_like()?);
        let whole = whole()?;
        Ok((
            flat(&y),
            flat(&dx),
            whole.map(|w| (w.weight_grad, w.bias_grad)),
        ))
    })
    .map_err(|e| e.to_string())?;
    let hw = g.h * g.w;
    let ohw = ho * wo;
    for (rank, (y, dx, whole)) in outs.into_iter().enumerate() {
        let cin = shardnet::comm::chunk_range(g.c, n, rank);
        let cout = shardnet::comm::chunk_range(g.o, n, rank);
        // What this rank should see of y and dx.
        let pick =
            |all: &[f64], per: usize, chans: usize, keep: &dyn Fn(usize) -> bool| -> Vec<f64> {
                all.chunks(per * chans)
                    .flat_map(|img| {
                        img.chunks(per)
                            .enumerate()
                            .filter(|(c, _)| keep(*c))
                            .flat_map(|(_, p)| p.to_vec())
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
        // What this rank should see, of the values and of their Σ|terms|.
        let expect = |r: &Reference| {
            let y = match form {
                Form::OutputSharded | Form::InputSharded => {
                    pick(&r.y, ohw, g.o, &|c| cout.contains(&c))
                }
                _ => r.y.clone(),
            };
            let dx_all: Vec<f64> = r.dx.iter().map(|d| d * scale).collect();
            let dx = match form {
                Form::InputSharded => pick(&dx_all, hw, g.c, &|c| cin.contains(&c)),
                Form::Grouped => dx_all
                    .chunks(hw)
                    .enumerate()
                    .flat_map(|(k, p)| {
                        let keep = (k % g.c) % n == rank;
                        p.iter().map(move |d| if keep { *d } else { 0.0 })
                    })
                    .collect(),
                _ => dx_all,
            };
            let dw: Vec<f64> = if grouped {
                r.dw.iter().zip(&mask).map(|(d, m)| d * m * scale).collect()
            } else {
                r.dw.clone()
            };
            let db: Vec<f64> = r.db.iter().map(|d| d * scale).collect();
            (y, dx, dw, db)
        };
        let (want_y, want_dx, want_dw, want_db) = expect(&r);
        let (mag_y, mag_dx, mag_dw, mag_db) = expect(&mag);
        within(&format!("rank {rank}: y"), &y, &want_y, &mag_y, 1e-5)?;
        within(&format!("rank {rank}: dx"), &dx, &want_dx, &mag_dx, 1e-5)?;
        if rank == n - 1 {
            let Some((Some(dw), Some(db))) = whole else {
                return Err(format!("rank {rank}: no whole gradients"));
            };
            within("whole dW", &flat(&dw), &want_dw, &mag_dw, 1e-5)?;
            within("whole db", &flat(&db), &want_db, &mag_db, 1e-5)?;
        }
    }
    Ok(())
}

/// The property tests' space: kernels 1–5 × 1–5, stride 1–3, padding 0–2,
/// batch 1–5, channels 1–9, sizes from the smallest the kernel allows to
/// six more (odd and even).
pub fn geometry() -> impl proptest::strategy::Strategy<Value = Geometry> {
    use proptest::strategy::Strategy;
    (
        (1usize..=5, 1usize..=9, 1usize..=9),
        (1usize..=5, 1usize..=5, 1usize..=3, 0usize..=2),
        (0usize..=6, 0usize..=6),
    )
        .prop_map(|((n, c, o), (kh, kw, s, p), (eh, ew))| Geometry {
            n,
            c,
            o,
            kh,
            kw,
            s,
            p,
            // h + 2p ≥ kh + eh ≥ kh: at least one output row.
            h: (kh + eh).saturating_sub(2 * p).max(1),
            w: (kw + ew).saturating_sub(2 * p).max(1),
        })
}

/// The channel-parallel forms, for a strategy to pick from.
pub const FORMS: [Form; 6] = [
    Form::Grouped,
    Form::GroupedOneLoss,
    Form::Output,
    Form::OutputSharded,
    Form::Input,
    Form::InputSharded,
];
