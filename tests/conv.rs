//! `nn::Conv2d` (our im2col GEMMs) against candle's `conv2d` on one device:
//! values and the gradients of x, W and b, for paddings, strides, 1×1 and
//! 3×3 kernels, odd sizes and batches that take several chunks.

use candle_core::{DType, Tensor, Var};
use shardnet::conformance::{max_rel, seeded};
use shardnet::nn::{Conv2d, Param};

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
    // 9 pixels per image: chunks of 29 images, the last one shorter.
    (40, 3, 3, 3, 5, 3, 3, 1, 1),
    // 64 images of one pixel: one chunk of all.
    (64, 8, 2, 2, 3, 2, 2, 1, 0),
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
