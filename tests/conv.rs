//! `nn::Conv2d` (our im2col GEMMs, and Winograd's F(2×2, 3×3) for f32 3×3
//! stride-1 layers with enough channels and tiles) against candle's
//! `conv2d` on one device: values and the gradients of x, W and b, for
//! paddings, strides, 1×1 and 3×3 kernels, odd sizes and batches that take
//! several chunks.

use candle_core::{DType, Tensor, Var};
use shardnet::nn::{Conv2d, Param};
use shardnet_conformance::{max_rel, seeded};

/// sum(tanh(y) ⊙ v).
fn loss(y: &Tensor, v: &Tensor) -> Tensor {
    y.tanh().unwrap().mul(v).unwrap().sum_all().unwrap()
}

/// (batch, in, h, w, out, kh, kw, stride, padding)
type Case = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

const CASES: &[Case] = &[
    (2, 3, 8, 8, 4, 3, 3, 1, 1),
    (3, 5, 7, 9, 6, 3, 3, 1, 0),
    (2, 4, 9, 7, 3, 3, 3, 2, 1),
    (1, 2, 6, 5, 3, 3, 2, 3, 2),
    (2, 6, 5, 5, 7, 1, 1, 1, 0),
    (2, 3, 6, 6, 2, 1, 1, 2, 1),
    (1, 1, 3, 3, 1, 3, 3, 1, 0),
    (4, 3, 5, 4, 2, 5, 3, 1, 2),
    // 9 pixels per image: chunks of 29 images on one thread (20 on two),
    // the last one shorter.
    (40, 3, 3, 3, 5, 3, 3, 1, 1),
    // 64 images of one pixel: one chunk of all.
    (64, 8, 2, 2, 3, 2, 2, 1, 0),
    // An image narrower than the kernel, and padding larger than it.
    (1, 2, 1, 2, 3, 3, 3, 1, 1),
    (2, 3, 4, 4, 2, 1, 1, 1, 2),
    // Winograd's path in f32 (≥ 16 channels, ≥ 64 tiles of 2 × 2 output
    // pixels): whole rows of 8 tiles; odd outputs (rows of 5 tiles, the
    // last cut) over 5 images; rows of 19 tiles (a block and a part) with
    // padding 2.
    (2, 16, 16, 16, 20, 3, 3, 1, 1),
    (5, 17, 13, 11, 9, 3, 3, 1, 0),
    (1, 16, 40, 35, 5, 3, 3, 1, 2),
    // The dense path in f32 (2 × 2 images, 3 × 3, padding 1): 4·17 = 68
    // columns in y and in dx, a full strip of 64 and a cut one.
    (3, 17, 2, 2, 17, 3, 3, 1, 1),
];

fn check(dtype: DType, tol: f64, bias: bool) {
    for (k, &(n, c, h, w, o, kh, kw, s, p)) in CASES.iter().enumerate() {
        let seed = 10 * k as u64;
        let x = seeded(seed + 1, &[n, c, h, w], dtype).unwrap();
        let wt = seeded(seed + 2, &[o, c, kh, kw], dtype).unwrap();
        let bt = seeded(seed + 3, &[o], dtype).unwrap();

        // candle's own convolution and its gradients.
        let (xv, wv, bv) = (
            Var::from_tensor(&x).unwrap(),
            Var::from_tensor(&wt).unwrap(),
            Var::from_tensor(&bt).unwrap(),
        );
        let mut want = xv.as_tensor().conv2d(wv.as_tensor(), p, s, 1, 1).unwrap();
        if bias {
            want = want
                .broadcast_add(&bv.as_tensor().reshape((1, o, 1, 1)).unwrap())
                .unwrap();
        }
        let v = seeded(seed + 4, want.dims(), dtype).unwrap();
        let gs = loss(&want, &v).backward().unwrap();

        // Ours.
        let wp = Param::new("w", &wt).unwrap();
        let bp = bias.then(|| Param::new("b", &bt).unwrap());
        let conv = Conv2d::new(wp.clone(), bp.clone(), s, p).unwrap();
        let xo = Var::from_tensor(&x).unwrap();
        let got = conv.forward(xo.as_tensor()).unwrap();
        let go = loss(&got, &v).backward().unwrap();

        let what = format!("case {k} {:?} {dtype:?} bias {bias}", CASES[k]);
        let rel = |a: &Tensor, b: &Tensor| max_rel(a, b).unwrap();
        assert_eq!(got.dims(), want.dims(), "{what}: shape");
        assert!(rel(&got, &want) <= tol, "{what}: y {}", rel(&got, &want));
        let dx = go.get(xo.as_tensor()).unwrap();
        let dx_want = gs.get(xv.as_tensor()).unwrap();
        assert!(rel(dx, dx_want) <= tol, "{what}: dx {}", rel(dx, dx_want));
        let dw = wp.grad().unwrap();
        let dw_want = gs.get(wv.as_tensor()).unwrap();
        assert!(rel(dw, dw_want) <= tol, "{what}: dW {}", rel(dw, dw_want));
        if let Some(bp) = &bp {
            let db = bp.grad().unwrap();
            let db_want = gs.get(bv.as_tensor()).unwrap();
            assert!(rel(db, db_want) <= tol, "{what}: db {}", rel(db, db_want));
        }

        // A second backward adds to the buffers.
        let again = conv.forward(xo.as_tensor()).unwrap();
        loss(&again, &v).backward().unwrap();
        let twice = (dw_want * 2.0).unwrap();
        assert!(
            rel(wp.grad().unwrap(), &twice) <= tol,
            "{what}: dW accumulated"
        );
        if let Some(bp) = &bp {
            let twice = (gs.get(bv.as_tensor()).unwrap() * 2.0).unwrap();
            assert!(
                rel(bp.grad().unwrap(), &twice) <= tol,
                "{what}: db accumulated"
            );
        }

        // A backward through the first forward's graph once more: the same
        // dx, and dW added a third time (on the Winograd path the first
        // backward took the forward's U; this one packs its own).
        let go = loss(&got, &v).backward().unwrap();
        let dx = go.get(xo.as_tensor()).unwrap();
        assert!(
            rel(dx, dx_want) <= tol,
            "{what}: dx again {}",
            rel(dx, dx_want)
        );
        let thrice = (dw_want * 3.0).unwrap();
        assert!(
            rel(wp.grad().unwrap(), &thrice) <= tol,
            "{what}: dW through the first graph again"
        );
    }
}

#[test]
fn conv2d_matches_candle_f64() {
    check(DType::F64, 1e-12, true);
    check(DType::F64, 1e-12, false);
}

#[test]
fn conv2d_matches_candle_f32() {
    check(DType::F32, 1e-5, true);
}

#[test]
fn conv2d_with_no_input_channels_gives_the_bias() {
    let wp = Param::new(
        "w",
        &Tensor::zeros((2, 0, 3, 3), DType::F32, &candle_core::Device::Cpu).unwrap(),
    )
    .unwrap();
    let bp = Param::new(
        "b",
        &Tensor::new(&[1f32, -2.], &candle_core::Device::Cpu).unwrap(),
    )
    .unwrap();
    let conv = Conv2d::new(wp, Some(bp.clone()), 1, 1).unwrap();
    let x = Tensor::zeros((3, 0, 4, 4), DType::F32, &candle_core::Device::Cpu).unwrap();
    let y = conv.forward(&x).unwrap();
    assert_eq!(y.dims(), &[3, 2, 4, 4]);
    let per_channel = y.sum((0, 2, 3)).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(per_channel, vec![48., -96.]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(bp.grad().unwrap().to_vec1::<f32>().unwrap(), vec![48., 48.]);
}

#[test]
fn conv2d_refuses_bad_shapes() {
    let dev = candle_core::Device::Cpu;
    let wp = Param::new("w", &Tensor::zeros((2, 3, 3, 3), DType::F32, &dev).unwrap()).unwrap();
    let conv = Conv2d::new(wp.clone(), None, 1, 0).unwrap();
    let err = |x: Tensor| conv.forward(&x).unwrap_err().to_string();
    assert!(err(Tensor::zeros((1, 2, 5, 5), DType::F32, &dev).unwrap()).contains("2 channels"));
    assert!(err(Tensor::zeros((1, 3, 2, 5), DType::F32, &dev).unwrap()).contains("does not fit"));
    assert!(err(Tensor::zeros((3, 5, 5), DType::F32, &dev).unwrap()).contains("expected (batch"));
    assert!(Conv2d::new(wp, None, 0, 0).is_err());
}

/// d(Σ y)/dx, flattened.
fn grad_of_sum(y: &Tensor, x: &Var) -> Vec<f32> {
    let g = y.sum_all().unwrap().backward().unwrap();
    let dx = g.get(x.as_tensor()).unwrap();
    dx.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn max_pool_matches_candle_and_sends_ties_to_the_first() {
    for dtype in [DType::F64, DType::F32] {
        // (candle's backward is only right when the window divides the sides.)
        let x = Var::from_tensor(&seeded(5, &[3, 4, 8, 6], dtype).unwrap()).unwrap();
        let want = x.as_tensor().max_pool2d(2).unwrap();
        let got = shardnet::nn::max_pool2d(x.as_tensor(), 2).unwrap();
        assert_eq!(got.dims(), want.dims());
        assert_eq!(max_rel(&got, &want).unwrap(), 0.0);
        // (candle's own backward divides by the window's size: not a reference.)
        let v = seeded(6, want.dims(), dtype).unwrap();
        let gg = got.mul(&v).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = gg.get(x.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
        let dx = dx.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let xs = x.as_tensor().to_dtype(DType::F64).unwrap();
        let xs = xs.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let vs = v
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let mut want_dx = vec![0.0; xs.len()];
        for (o, vo) in vs.iter().enumerate() {
            let (plane, i, j) = (o / 12, (o % 12) / 3, o % 3);
            let at = |a: usize, b: usize| plane * 48 + (2 * i + a) * 6 + 2 * j + b;
            let best = [(0, 0), (0, 1), (1, 0), (1, 1)]
                .into_iter()
                .map(|(a, b)| at(a, b))
                .fold(at(0, 0), |m, k| if xs[k] > xs[m] { k } else { m });
            want_dx[best] += vo;
        }
        assert_eq!(dx, want_dx, "{dtype:?}");
    }
    // 3×3: the last row and column are dropped, as in PyTorch.
    let x = Var::from_tensor(
        &Tensor::new(
            &[1f32, 5., 9., 2., 3., 9., 9., 9., 9.],
            &candle_core::Device::Cpu,
        )
        .unwrap()
        .reshape((1, 1, 3, 3))
        .unwrap(),
    )
    .unwrap();
    let y = shardnet::nn::max_pool2d(x.as_tensor(), 2).unwrap();
    assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![5.]);
    let dx = grad_of_sum(&y, &x);
    assert_eq!(dx, vec![0., 1., 0., 0., 0., 0., 0., 0., 0.]);
    // A window of equal values: its gradient goes to the first one only.
    let x = Var::from_tensor(
        &Tensor::zeros((1, 1, 2, 2), DType::F32, &candle_core::Device::Cpu).unwrap(),
    )
    .unwrap();
    let y = shardnet::nn::max_pool2d(x.as_tensor(), 2).unwrap();
    let dx = grad_of_sum(&y, &x);
    assert_eq!(dx, vec![1., 0., 0., 0.]);
    // NaN wins its window.
    let x = Tensor::new(&[1f32, f32::NAN, 3., 2.], &candle_core::Device::Cpu)
        .unwrap()
        .reshape((1, 1, 2, 2))
        .unwrap();
    assert!(shardnet::nn::max_pool2d(&x, 2)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0]
        .is_nan());
    assert!(shardnet::nn::max_pool2d(&x, 3).is_err());
}

/// A (B, C, H, W) tensor's values per channel, in f64.
fn per_channel(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64)
        .unwrap()
        .permute((1, 0, 2, 3))
        .unwrap()
        .flatten_from(1)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
}

#[test]
fn batch_norm_matches_a_hand_computation() {
    use shardnet::nn::{BatchNorm2d, ParamStore};
    let dev = candle_core::Device::Cpu;
    let store = ParamStore::new(&dev, 0);
    let bn = BatchNorm2d::new(&store, "bn", 3).unwrap();
    bn.weight
        .var()
        .set(&Tensor::new(&[1.5f32, -0.5, 2.0], &dev).unwrap())
        .unwrap();
    bn.bias
        .var()
        .set(&Tensor::new(&[0.1f32, 0.2, -0.3], &dev).unwrap())
        .unwrap();
    let x = seeded(7, &[4, 3, 5, 2], DType::F32).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let y = bn.forward(xv.as_tensor(), true).unwrap();
    let v = seeded(8, y.dims(), DType::F32).unwrap();
    let mut grads = loss(&y, &v).backward().unwrap();
    store.absorb(&mut grads).unwrap();

    // By hand, in f64: per channel c, over its 40 values.
    let xs = per_channel(&x);
    let ys = per_channel(&y);
    let vs = per_channel(&v);
    let dx = per_channel(grads.get(xv.as_tensor()).unwrap());
    let (gamma, beta) = ([1.5, -0.5, 2.0], [0.1, 0.2, -0.3]);
    let (rm, rv) = bn.running_stats();
    let (rm, rv) = (rm.to_vec1::<f32>().unwrap(), rv.to_vec1::<f32>().unwrap());
    let dgamma = bn.weight.grad().unwrap().to_vec1::<f32>().unwrap();
    let dbeta = bn.bias.grad().unwrap().to_vec1::<f32>().unwrap();
    for c in 0..3 {
        let n = xs[c].len() as f64;
        let mu = xs[c].iter().sum::<f64>() / n;
        let var = xs[c].iter().map(|a| (a - mu).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + 1e-5).sqrt();
        let xhat: Vec<f64> = xs[c].iter().map(|a| (a - mu) * inv).collect();
        for (k, xh) in xhat.iter().enumerate() {
            let want = gamma[c] * xh + beta[c];
            assert!((ys[c][k] - want).abs() < 1e-5, "y");
        }
        // dL/dy = tanh'(y) v; dγ = Σ dy x̂, dβ = Σ dy;
        // dx = γ inv (dy − mean(dy) − x̂ mean(dy x̂)).
        let dy: Vec<f64> = ys[c]
            .iter()
            .zip(&vs[c])
            .map(|(y, v)| (1.0 - y.tanh().powi(2)) * v)
            .collect();
        let sdy: f64 = dy.iter().sum();
        let sdyx: f64 = dy.iter().zip(&xhat).map(|(a, b)| a * b).sum();
        assert!(
            (dgamma[c] as f64 - sdyx).abs() < 1e-4 * (1.0 + sdyx.abs()),
            "dγ"
        );
        assert!(
            (dbeta[c] as f64 - sdy).abs() < 1e-4 * (1.0 + sdy.abs()),
            "dβ"
        );
        for k in 0..xs[c].len() {
            let want = gamma[c] * inv * (dy[k] - sdy / n - xhat[k] * sdyx / n);
            assert!(
                (dx[c][k] - want).abs() < 1e-4 * (1.0 + want.abs()),
                "dx {c} {k}: {} vs {want}",
                dx[c][k]
            );
        }
        assert!((rm[c] as f64 - 0.1 * mu).abs() < 1e-6, "running mean");
        assert!(
            (rv[c] as f64 - (0.9 + 0.1 * var * n / (n - 1.0))).abs() < 1e-5,
            "running var"
        );
    }
    // Evaluation uses the running statistics.
    let e = per_channel(&bn.forward(&x, false).unwrap());
    let want = gamma[1] * (xs[1][3] - rm[1] as f64) / (rv[1] as f64 + 1e-5).sqrt() + beta[1];
    assert!((e[1][3] - want).abs() < 1e-5);
}

#[test]
fn dropout_is_seeded_and_scaled() {
    let dev = candle_core::Device::Cpu;
    let x = Tensor::ones((100, 100), DType::F32, &dev).unwrap();
    let drop = |seed: u64| -> Vec<f32> {
        let y = shardnet::nn::dropout(&x, 0.3, seed).unwrap();
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let (a, b, c) = (drop(7), drop(7), drop(8));
    assert_eq!(a, b);
    assert_ne!(a, c);
    let dropped = a.iter().filter(|v| **v == 0.0).count();
    assert!(
        (2700..3300).contains(&dropped),
        "{dropped} of 10000 dropped at p = 0.3"
    );
    assert!(a.iter().all(|v| *v == 0.0 || (*v - 1.0 / 0.7).abs() < 1e-6));
    assert!(shardnet::nn::dropout(&x, 1.0, 0).is_err());
    assert_eq!(
        shardnet::nn::dropout(&x, 0.0, 0)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_vec0::<f32>()
            .unwrap(),
        10000.0
    );
}
