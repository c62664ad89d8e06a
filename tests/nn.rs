//! `nn::Linear` and `optim::Adam` against candle's own ops on one device.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use shardnet::nn::{Linear, Param};
use shardnet::optim::Adam;

fn seeded(seed: u64, dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_rel(got: &Tensor, want: &Tensor) -> f64 {
    shardnet_conformance::max_rel(got, want).unwrap()
}

/// The loss every Linear test uses: sum(tanh(y) ⊙ v).
fn loss(y: &Tensor, v: &Tensor) -> Tensor {
    y.tanh().unwrap().mul(v).unwrap().sum_all().unwrap()
}

/// The same layer in candle's own ops: y = x Wᵀ + b and the gradients of
/// [`loss`] for x, W and b.
fn reference(x: &Tensor, w: &Tensor, b: &Tensor, v: &Tensor) -> (Tensor, Tensor, Tensor, Tensor) {
    let (xv, wv, bv) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(w).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let y = xv
        .as_tensor()
        .matmul(&wv.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(bv.as_tensor())
        .unwrap();
    let g = loss(&y, v).backward().unwrap();
    let grad = |t: &Var| g.get(t.as_tensor()).unwrap().clone();
    (y, grad(&xv), grad(&wv), grad(&bv))
}

#[test]
fn linear_matches_candle_values_and_gradients_and_accumulates() {
    // The second shape fills the f32 forward's tiles: on AVX-512 it runs
    // on our sgemm (kernels::dot::matmul_abt), the first on the crate.
    for ((b, i, o), dtype) in [(5, 7, 3), (13, 200, 70)]
        .into_iter()
        .flat_map(|s| [(s, DType::F64), (s, DType::F32)])
    {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = Var::from_tensor(&seeded(1, &[b, i], dtype)).unwrap();
        let w = seeded(2, &[o, i], dtype);
        let bias = seeded(3, &[o], dtype);
        let v = seeded(4, &[b, o], dtype);
        let layer = Linear::new(
            Param::new("w", &w).unwrap(),
            Some(Param::new("b", &bias).unwrap()),
        );
        let (yr, gxr, gwr, gbr) = reference(x.as_tensor(), &w, &bias, &v);

        // Twice: the parameter gradients must add up.
        for _ in 0..2 {
            let y = layer.forward(x.as_tensor()).unwrap();
            let g = loss(&y, &v).backward().unwrap();
            assert!(max_rel(&y, &yr) <= tol, "{dtype:?} forward");
            assert!(
                max_rel(g.get(x.as_tensor()).unwrap(), &gxr) <= tol,
                "{dtype:?} dx"
            );
        }
        assert!(
            max_rel(layer.weight().grad().unwrap(), &(&gwr * 2.0).unwrap()) <= tol,
            "{dtype:?} dW accumulated"
        );
        assert!(
            max_rel(
                layer.bias().unwrap().grad().unwrap(),
                &(&gbr * 2.0).unwrap()
            ) <= tol,
            "{dtype:?} db accumulated"
        );
        // Taking the gradient empties the buffer; the next backward overwrites it.
        assert!(layer.weight().take_grad().is_some());
        assert!(layer.weight().grad().is_none());
        loss(&layer.forward(x.as_tensor()).unwrap(), &v)
            .backward()
            .unwrap();
        assert!(
            max_rel(layer.weight().grad().unwrap(), &gwr) <= tol,
            "{dtype:?} dW after take"
        );
    }
}

/// `t` rounded to bf16 (to nearest even), in f64.
fn bf16(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
}

/// A bf16 layer on x of three dimensions against its definition in f64:
/// y = x̃ W̃ᵀ + b, dx = ṽ W̃, dW = Σ ṽᵀ x̃, db = Σ v for the loss sum(y ⊙ v),
/// ˜ the rounding to bf16. On the CPU kernels the sums are f32's: 1e-5 of
/// the largest. The generic path's bf16 matmul rounds its outputs (y, dx,
/// dW) to bf16 too: within 2⁻⁸ of each, 8e-3 of the largest. Not the f32
/// layer: its y is further than 1e-4 from the bf16 one.
#[test]
fn a_bf16_linear_matches_its_definition() {
    let (lead, i, o) = ([2, 13], 200, 70);
    let x = seeded(1, &[lead[0], lead[1], i], DType::F32);
    let w = seeded(2, &[o, i], DType::F32);
    let bias = seeded(3, &[o], DType::F32);
    let v = seeded(4, &[lead[0], lead[1], o], DType::F32);
    let layer = |bf16_on: bool| {
        Linear::new(
            Param::new("w", &w).unwrap(),
            Some(Param::new("b", &bias).unwrap()),
        )
        .with_bf16(bf16_on)
    };
    let ours = layer(true);
    assert!(ours.is_bf16());
    let xv = Var::from_tensor(&x).unwrap();
    let y = ours.forward(xv.as_tensor()).unwrap();
    assert_eq!(y.dims(), &[2, 13, 70]);
    let g = y.mul(&v).unwrap().sum_all().unwrap().backward().unwrap();

    let flat =
        |t: &Tensor, cols: usize| t.to_dtype(DType::F64).unwrap().reshape(((), cols)).unwrap();
    let (xr, wr, vr) = (bf16(&flat(&x, i)), bf16(&w), bf16(&flat(&v, o)));
    let y_want = xr
        .matmul(&wr.t().unwrap())
        .unwrap()
        .broadcast_add(&bias.to_dtype(DType::F64).unwrap())
        .unwrap();
    let dx_want = vr.matmul(&wr).unwrap();
    let dw_want = vr.t().unwrap().matmul(&xr).unwrap();
    let db_want = flat(&v, o).sum(0).unwrap();
    let tol = if shardnet::kernels::fast(&Device::Cpu) {
        1e-5
    } else {
        8e-3
    };
    let checks = [
        ("y", flat(&y, o), y_want, tol),
        ("dx", flat(g.get(xv.as_tensor()).unwrap(), i), dx_want, tol),
        ("dW", ours.weight().grad().unwrap().clone(), dw_want, tol),
        (
            "db",
            ours.bias().unwrap().grad().unwrap().clone(),
            db_want,
            1e-5,
        ),
    ];
    for (name, got, want, tol) in checks {
        let e = max_rel(&got.to_dtype(DType::F64).unwrap(), &want);
        assert!(e <= tol, "bf16 {name} off by {e:e}");
    }
    let f32_y = layer(false).forward(&x).unwrap();
    let e = max_rel(&y, &f32_y);
    assert!(e > 1e-4, "the bf16 layer is the f32 one ({e:e} apart)");
}

#[test]
fn linear_rejects_a_wrong_input_shape() {
    let layer = Linear::new(
        Param::new("w", &seeded(1, &[3, 4], DType::F32)).unwrap(),
        None,
    );
    let err = layer
        .forward(&seeded(2, &[2, 5], DType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Linear(4 -> 3)") && err.contains("[2, 5]"),
        "{err}"
    );
}

#[test]
fn adam_matches_candle_adamw_without_weight_decay() {
    let w0 = seeded(5, &[4, 6], DType::F32);
    let p = Param::new("w", &w0).unwrap();
    let layer = Linear::new(p.clone(), None);
    let mut adam = Adam::new(vec![p.clone()], 1e-2).unwrap();
    let wr = Var::from_tensor(&w0).unwrap();
    let mut reference = candle_nn::AdamW::new(
        vec![wr.clone()],
        candle_nn::ParamsAdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    )
    .unwrap();
    for step in 0..5 {
        let x = seeded(10 + step, &[3, 6], DType::F32);
        layer
            .forward(&x)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        adam.step().unwrap();
        let g = x
            .matmul(&wr.as_tensor().t().unwrap())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        reference.step(&g).unwrap();
        assert!(max_rel(p.value(), wr.as_tensor()) <= 1e-6, "step {step}");
    }
    // A step where a parameter got no gradient (a forgotten absorb, or a
    // parameter outside the loss) is an error naming it, never a silent
    // skip; the parameter is not moved.
    let before = p.value().copy().unwrap();
    let err = adam.step().unwrap_err().to_string();
    assert!(err.contains("parameter w received no gradient"), "{err}");
    assert!(max_rel(p.value(), &before) == 0.0);
}

#[test]
fn store_builds_layers_by_name_and_yields_the_state_dict() {
    use shardnet::nn::{ParamStore, Shard};
    let store = ParamStore::new(&shardnet::comm::HOST, 3);
    let l0 = store.pp("backbone").linear("layer0", 0, 4, 5).unwrap();
    assert_eq!(l0.weight().name(), "backbone.layer0.weight");
    assert_eq!(l0.weight().value().dims(), &[5, 4]);
    // The same seed and layer give the same values, whatever the store.
    let again = ParamStore::new(&shardnet::comm::HOST, 3)
        .linear("x", 0, 4, 5)
        .unwrap();
    assert_eq!(max_rel(again.weight().value(), l0.weight().value()), 0.0);
    let shard = Shard {
        dim: 0,
        offset: 2,
        global: 7,
    };
    store
        .add("head.weight", &seeded(1, &[3, 4], DType::F32), Some(shard))
        .unwrap();
    let dup = store.add("head.weight", &seeded(1, &[3, 4], DType::F32), None);
    assert!(dup
        .unwrap_err()
        .to_string()
        .contains("two parameters are named head.weight"));
    let names: Vec<(String, Option<Shard>)> = store
        .state_dict()
        .into_iter()
        .map(|e| (e.name, e.shard))
        .collect();
    assert_eq!(
        names,
        vec![
            ("backbone.layer0.weight".to_string(), None),
            ("backbone.layer0.bias".to_string(), None),
            ("head.weight".to_string(), Some(shard)),
        ]
    );
}

#[test]
fn a_candle_nn_layer_in_the_store_is_stepped_by_adam() {
    use candle_core::Module;
    use shardnet::nn::ParamStore;
    let store = ParamStore::new(&shardnet::comm::HOST, 0);
    let w = Var::from_tensor(&seeded(5, &[2, 3], DType::F32)).unwrap();
    store
        .register(Param::from_var("plain.weight", w.clone()).unwrap())
        .unwrap();
    let layer = candle_nn::Linear::new(w.as_tensor().clone(), None);
    let before = w.as_tensor().copy().unwrap();
    let x = seeded(6, &[4, 3], DType::F32);
    let mut grads = layer
        .forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut opt = Adam::new(store.params(), 0.1).unwrap();
    store.absorb(&mut grads).unwrap();
    opt.step().unwrap();
    // Adam's first step moves every element with a gradient by lr.
    let moved = (w.as_tensor() - &before).unwrap().abs().unwrap();
    let min = moved.min_all().unwrap().to_scalar::<f32>().unwrap();
    assert!((min - 0.1).abs() < 1e-4, "moved by {min}");
}

/// `functions::backward_from` against candle's backward of ⟨y, g⟩: with y
/// a variable, y's gradient is g bit for bit; chained after tanh and a
/// scale (y = 3 tanh x), x's gradient equals candle's; g gets none; sizes
/// from empty up, f32 and f64. Mismatched y and g are refused.
#[test]
fn backward_from_sends_g_to_y() {
    use shardnet::functions::backward_from;
    for dtype in [DType::F32, DType::F64] {
        for (k, n) in [0usize, 1, 7, 4097, 100_003].into_iter().enumerate() {
            let x = Var::from_tensor(&seeded(2 * k as u64, &[n], dtype)).unwrap();
            let g = Var::from_tensor(&seeded(2 * k as u64 + 1, &[n], dtype)).unwrap();
            let grads = backward_from(x.as_tensor(), g.as_tensor()).unwrap();
            let dx = grads.get(&x).unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(dx), bits(g.as_tensor()), "{dtype:?} n {n}");
            assert!(grads.get(&g).is_none(), "g got a gradient");
            let y = (x.tanh().unwrap() * 3.0).unwrap();
            let ours = backward_from(&y, g.as_tensor()).unwrap();
            let theirs = y
                .mul(&g.detach())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (da, db) = (ours.get(&x).unwrap(), theirs.get(&x).unwrap());
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-14 };
            assert!(
                max_rel(da, db) <= tol,
                "{dtype:?} n {n}: {}",
                max_rel(da, db)
            );
            assert!(ours.get(&g).is_none());
        }
    }
    let y = seeded(1, &[2, 3], DType::F32);
    for g in [
        seeded(2, &[3, 2], DType::F32),
        seeded(2, &[2, 3], DType::F64),
    ] {
        let e = backward_from(&y, &g).unwrap_err().to_string();
        assert!(e.contains("backward_from: y is [2, 3] F32"), "{e}");
    }
}

/// A column- then row-parallel MLP built with candle-nn's `seq()` (our
/// layers as `candle_nn::Module`s, candle-nn's ReLU between) gives every
/// rank the bits of the layers' own forwards, on 1–3 ranks.
#[test]
fn parallel_layers_compose_as_candle_nn_modules() {
    use candle_nn::Module;
    use shardnet::functions::Context;
    use shardnet::links::{ColumnParallelLinear, Features, LinearConfig, RowParallelLinear};
    use shardnet::nn::ParamStore;
    for ranks in [1, 2, 3] {
        let same = shardnet::launch(ranks, |comm| {
            let c = &Context::new(&comm);
            let store = ParamStore::new(comm.device(), 7);
            let between = LinearConfig::new().with_features(Features::Sharded);
            let up = ColumnParallelLinear::new(c, &store.pp("up"), 5, 7, between)?;
            let down = RowParallelLinear::new(c, &store.pp("down"), 7, 3, between.with_layer(1))?;
            let x = Tensor::arange(0f32, 20.0, comm.device())?
                .reshape((4, 5))?
                .affine(0.1, -1.0)?;
            let direct = down.forward(&up.forward(&x)?.relu()?)?;
            let model = candle_nn::seq()
                .add(up.clone())
                .add(candle_nn::Activation::Relu)
                .add(down.clone());
            let composed = model.forward(&x)?;
            let (a, b) = (direct.to_vec2::<f32>()?, composed.to_vec2::<f32>()?);
            Ok(a == b && a.iter().flatten().any(|v| *v != 0.0))
        })
        .unwrap();
        assert!(same.iter().all(|s| *s), "{ranks} ranks: {same:?}");
    }
}

/// A gradient's Σ g² in f64 and its scaling in place: a gradient large
/// enough to be split over the threads (and blocks of 16 Ki), one of a
/// few elements, and none.
#[test]
fn grad_squares_and_scale_grad() {
    for n in [5usize, 100_003] {
        let p = Param::new("p", &seeded(9, &[n], DType::F32)).unwrap();
        assert_eq!(p.grad_squares().unwrap(), 0.0, "no gradient yet");
        let g = seeded(10, &[n], DType::F32);
        p.set_grad(&g).unwrap();
        let want: f64 = g
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum();
        let got = p.grad_squares().unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "n = {n}: {got} against {want}"
        );
        p.scale_grad(0.5).unwrap();
        let half: Vec<f32> = p.grad().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = g.to_vec1().unwrap();
        assert!(
            half.iter().zip(&g).all(|(h, g)| *h == g * 0.5),
            "n = {n}: scaled"
        );
    }
}

/// A fully sharded `Linear` (and one with only its gradient sharded) over
/// 1–4 replicas, two passes each (a pipeline's micro-batches: both
/// forwards, then both backwards), against the whole layer on every
/// replica's rows in candle's ops: each replica's y and dx are its rows',
/// its share's gradient is its chunk of the summed dW, and the whole bias's
/// gradients sum to db. Fully sharded f32 weights shared out by rows also
/// move in blocks (`with_gather_block`: 4 bytes, a row per round; 2 or 3
/// rows a round; uneven shares), which must give the same. Fails when the
/// reduce-scatter averages, when a share is another replica's chunk, when a
/// pass's dW is dropped, or when a block's features land out of order.
#[test]
fn a_sharded_linear_gives_each_replica_its_chunk_of_the_summed_gradient() {
    use shardnet::comm::chunk_range;
    use shardnet::functions::{in_chain, Context};
    for (g, (rows, i, o), dim, keep, dtype, block) in [
        (1, (3, 5, 4), 0, false, DType::F64, 0),
        (2, (3, 5, 4), 0, false, DType::F64, 0),
        (2, (4, 7, 9), 1, true, DType::F64, 0),
        (3, (2, 5, 7), 0, true, DType::F64, 0),
        (3, (5, 8, 3), 1, false, DType::F32, 0),
        (4, (3, 6, 10), 0, false, DType::F32, 0),
        (4, (6, 70, 33), 1, true, DType::F32, 0),
        (1, (3, 5, 4), 0, false, DType::F32, 4),
        (2, (3, 5, 9), 0, false, DType::F32, 4),
        (2, (4, 7, 9), 0, false, DType::F32, 2 * 7 * 4),
        (3, (2, 6, 11), 0, false, DType::F32, 3 * 6 * 4),
        (4, (3, 6, 10), 0, false, DType::F32, 4),
        (4, (5, 33, 70), 0, false, DType::F32, 9 * 33 * 4),
    ] {
        let passes = 2;
        let w = seeded(1, &[o, i], dtype);
        let b = seeded(2, &[o], dtype);
        // Rows of pass k on replica r: block k·g + r of the whole input.
        let x = seeded(3, &[passes * g * rows, i], dtype);
        let v = seeded(4, &[passes * g * rows, o], dtype);
        let (y_ref, dx_ref, dw_ref, db_ref) = reference(&x, &w, &b, &v);
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let out = shardnet::launch(g, |comm| {
            let ctx = Context::new(&comm);
            let r = comm.rank();
            let own = chunk_range(w.dims()[dim], g, r);
            let share = Param::new("w", &w.narrow(dim, own.start, own.len())?)?;
            let bias = Param::new("b", &b)?;
            let whole = Linear::new(Param::new("w", &w)?, Some(bias.clone()));
            let layer = if keep {
                whole.gradient_sharded(&ctx, share.clone(), dim)?
            } else {
                whole
                    .fully_sharded(&ctx, share.clone(), dim)?
                    .with_gather_block(block)
            };
            let block = |k: usize| (k * g + r) * rows;
            let mut held = Vec::new();
            for k in 0..passes {
                let xv = Var::from_tensor(&x.narrow(0, block(k), rows)?)?;
                let y = in_chain(k as u64 + 1, || layer.forward(xv.as_tensor()))?;
                held.push((xv, y));
            }
            let mut err = 0f64;
            for (k, (xv, y)) in held.iter().enumerate() {
                err = err.max(max_rel(y, &y_ref.narrow(0, block(k), rows)?));
                let grads = loss(y, &v.narrow(0, block(k), rows)?).backward()?;
                let dx = grads.get(xv.as_tensor()).expect("dx");
                err = err.max(max_rel(dx, &dx_ref.narrow(0, block(k), rows)?));
            }
            let dw = share.grad().expect("the share's gradient");
            err = err.max(max_rel(dw, &dw_ref.narrow(dim, own.start, own.len())?));
            let db = comm.allreduce(bias.grad().expect("db"), shardnet::ReduceOp::Sum)?;
            err = err.max(max_rel(&db, &db_ref));
            assert_eq!(ctx.pending_backward(), 0);
            Ok(err)
        })
        .unwrap();
        for (r, e) in out.iter().enumerate() {
            assert!(
                *e < tol,
                "{g} replicas, {rows}×{i}→{o}, along {dim}, keep {keep}, {dtype:?}, blocks of \
                 {block} bytes: rank {r} off by {e}"
            );
        }
    }
}
