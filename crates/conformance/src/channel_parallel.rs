//! The channel-parallel suite: [`OutputParallelConv2d`](shardnet::links::OutputParallelConv2d),
//! [`InputParallelConv2d`](shardnet::links::InputParallelConv2d) and [`ParallelConvolution2D`] against
//! convolutions on one device in f64 (candle's `conv2d`, from the global
//! tensors), [`BatchNorm2d::multi_node`] against one device's batch
//! normalisation of the concatenated batch, and max pooling against a hand
//! computation.
//!
//! Every rank builds the same input and compares its own results: the
//! output, dL/dx, and its part of each weight's and bias's gradient,
//! relative error ≤ 1e-5 (f32 against f64). Channel counts are uneven on
//! 2–4 ranks (5 → 7), and 3 → 3 on 4 ranks leaves a rank with no channels.

use super::autograd::{close, seeded, weighted, Case};
use super::check;
use candle_core::{DType, Tensor, Var};
use shardnet::comm::{chunk_range, chunk_sizes, ReduceOp};
use shardnet::functions::Context;
use shardnet::links::{ChannelConv2d, ChannelSplit, ConvConfig, ParallelConvolution2D};
use shardnet::nn::{init, max_pool2d, BatchNorm2d, Param, ParamStore};
use shardnet::Result;

const SEED: u64 = 31;
const B: usize = 3;
const TOL: f64 = 1e-5;

/// (in, out, kernel, stride, padding, side)
type Shape = (usize, usize, usize, usize, usize, usize);

const SHAPES: [Shape; 4] = [
    (5, 7, 3, 1, 1, 6),
    (3, 3, 3, 2, 1, 7),
    (4, 6, 1, 1, 0, 5),
    (2, 5, 3, 1, 0, 5),
];

/// Every case.
pub fn cases() -> Vec<Case> {
    let mut all: Vec<Case> = Vec::new();
    for (k, s) in SHAPES.into_iter().enumerate() {
        for split in [ChannelSplit::Output, ChannelSplit::Input] {
            all.push((
                format!(
                    "{split}_channel_parallel_conv_{}to{}_k{}_s{}_p{}_vs_one_device",
                    s.0, s.1, s.2, s.3, s.4
                ),
                Box::new(move |c| exact(c, split, k, s)),
            ));
        }
        for replicated in [false, true] {
            let form = if replicated {
                "same_loss"
            } else {
                "own_losses"
            };
            all.push((
                format!(
                    "grouped_conv_{}to{}_k{}_{form}_vs_one_device_grouped",
                    s.0, s.1, s.2
                ),
                Box::new(move |c| grouped(c, k, s, replicated)),
            ));
        }
    }
    all.push((
        "multi_node_batch_norm_vs_one_device".into(),
        Box::new(|c| multi_node_batch_norm(c, |r, _| r + 1)),
    ));
    // Rank 0 holds no image (with 2 or more ranks): it still joins every
    // allreduce, forward and backward, on both paths (on the generic path
    // through `BatchNorm2d`'s empty-rank graph).
    all.push((
        "multi_node_batch_norm_with_an_empty_rank_vs_one_device".into(),
        Box::new(|c| multi_node_batch_norm(c, |r, n| if n > 1 { r } else { 2 })),
    ));
    all.push((
        "max_pool_gradient_to_the_first_maximum".into(),
        Box::new(|_| max_pool()),
    ));
    all
}

fn grad(p: &Param) -> Result<Tensor> {
    Ok(match p.grad() {
        Some(g) => g.clone(),
        None => p.value().zeros_like()?,
    })
}

fn get(g: &candle_core::backprop::GradStore, v: &Var) -> Result<Tensor> {
    Ok(g.get(v.as_tensor())
        .cloned()
        .unwrap_or(v.as_tensor().zeros_like()?))
}

/// The global weight (out, in, k, k) and bias of `layer`, f64.
fn global(layer: usize, (cin, cout, k, ..): Shape, fan_in: usize) -> Result<(Tensor, Tensor)> {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let kk = k * k;
    let dev = &shardnet::comm::HOST;
    let w = init::uniform_block(
        init::layer_seed(SEED, layer, 0),
        0..cout,
        0..cin * kk,
        cin * kk,
        bound,
        dev,
    )?;
    let b = init::uniform_block(
        init::layer_seed(SEED, layer, 1),
        0..cout,
        0..1,
        1,
        bound,
        dev,
    )?;
    Ok((
        w.reshape((cout, cin, k, k))?.to_dtype(DType::F64)?,
        b.reshape(cout)?.to_dtype(DType::F64)?,
    ))
}

/// An exact split against the whole convolution, on a loss every rank
/// computes alike.
fn exact(c: &Context, split: ChannelSplit, layer: usize, s: Shape) -> Result<()> {
    let (cin, cout, k, stride, pad, side) = s;
    let store = ParamStore::new(c.device(), SEED);
    let cfg = ConvConfig {
        kernel: k.into(),
        stride,
        padding: pad,
        bias: true,
        layer,
    };
    let conv = ChannelConv2d::new(c, &store.pp("conv"), split, (cin, cout), cfg)?;
    let x = Var::from_tensor(&seeded(
        40 + layer as u64,
        &[B, cin, side, side],
        DType::F32,
    )?)?;
    let y = conv.forward(x.as_tensor())?;
    let mut grads = weighted(&y, 50 + layer as u64)?.backward()?;
    store.absorb(&mut grads)?;
    let dx = get(&grads, &x)?;

    let (w, b) = global(layer, s, cin * k * k)?;
    let (w, b) = (Var::from_tensor(&w)?, Var::from_tensor(&b)?);
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let want = x64
        .as_tensor()
        .conv2d(w.as_tensor(), pad, stride, 1, 1)?
        .broadcast_add(&b.as_tensor().reshape((1, cout, 1, 1))?)?;
    let g = weighted(&want, 50 + layer as u64)?.backward()?;
    close("output", &y, &want, TOL)?;
    close("dL/dx", &dx, &get(&g, &x64)?, TOL)?;
    let (dw, db) = (get(&g, &w)?, get(&g, &b)?);
    match &conv {
        ChannelConv2d::Output(l) => {
            let mine = chunk_range(cout, c.size(), c.rank());
            let part = |t: &Tensor| t.narrow(0, mine.start, mine.len());
            close(
                "its output channels of dW",
                &grad(l.conv.weight())?,
                &part(&dw)?,
                TOL,
            )?;
            if let Some(bp) = l.conv.bias() {
                close("its output channels of db", &grad(bp)?, &part(&db)?, TOL)?;
            }
        }
        ChannelConv2d::Input(l) => {
            let mine = chunk_range(cin, c.size(), c.rank());
            close(
                "its input channels of dW",
                &grad(l.conv.weight())?,
                &dw.narrow(1, mine.start, mine.len())?,
                TOL,
            )?;
            if let Some(bp) = &l.bias {
                close("db (whole)", &grad(bp)?, &db, TOL)?;
            }
        }
        _ => check(false, || format!("{split}: not an exact split"))?,
    }
    Ok(())
}

/// ChainerMN's grouped convolution against one device's grouped
/// convolution built from every rank's weights: with each rank's own loss
/// (reduce-scatter backward) or one loss on every rank (`replicated`).
fn grouped(c: &Context, layer: usize, s: Shape, replicated: bool) -> Result<()> {
    let (cin, cout, k, stride, pad, side) = s;
    let (n, r) = (c.size(), c.rank());
    let store = ParamStore::new(c.device(), SEED);
    let cfg = ConvConfig {
        kernel: k.into(),
        stride,
        padding: pad,
        bias: true,
        layer,
    };
    let conv = ParallelConvolution2D::new(c, &store.pp("conv"), (cin, cout), cfg)?;
    let conv = if replicated { conv.replicated() } else { conv };
    let x = Var::from_tensor(&seeded(
        60 + layer as u64,
        &[B, cin, side, side],
        DType::F32,
    )?)?;
    let y = conv.forward(x.as_tensor())?;
    // Each rank's loss (its own weights), or the same.
    let seed = |rank: usize| 70 + if replicated { 0 } else { rank as u64 };
    let mut grads = weighted(&y, seed(r))?.backward()?;
    store.absorb(&mut grads)?;
    // Own losses (ChainerMN's): a rank's dx holds its input channels' part
    // of the summed losses' gradient, zero elsewhere (the previous layer's
    // allgather sums them). One loss: every rank's dx is the whole.
    let dx = get(&grads, &x)?;

    // One device: every group's weights, gathered (flattened, variable length).
    let wflat = conv
        .conv
        .weight()
        .value()
        .flatten_all()?
        .to_dtype(DType::F64)?;
    let bflat = match conv.conv.bias() {
        Some(b) => b.value().to_dtype(DType::F64)?,
        None => Tensor::zeros(0, DType::F64, c.device())?,
    };
    let all_w = c.comm().allgather(&wflat)?;
    let all_b = c.comm().allgather(&bflat)?;
    let outs = chunk_sizes(cout, n);
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let (mut at_w, mut at_b) = (0, 0);
    let mut ws = Vec::new();
    let mut pieces = Vec::new();
    for (g, o) in outs.iter().enumerate() {
        let idx: Vec<u32> = (g..cin).step_by(n).map(|i| i as u32).collect();
        let len = o * idx.len() * k * k;
        let wv = Var::from_tensor(&all_w.narrow(0, at_w, len)?.reshape((*o, idx.len(), k, k))?)?;
        let bg = all_b.narrow(0, at_b, *o)?;
        at_w += len;
        at_b += o;
        let xi = x64
            .as_tensor()
            .index_select(&Tensor::new(idx.as_slice(), c.device())?, 1)?;
        let yg = if idx.is_empty() {
            let ho = (side + 2 * pad - k) / stride + 1;
            Tensor::zeros((B, *o, ho, ho), DType::F64, c.device())?
        } else {
            xi.conv2d(wv.as_tensor(), pad, stride, 1, 1)?
        };
        pieces.push(yg.broadcast_add(&bg.reshape((1, *o, 1, 1))?)?);
        ws.push(wv);
    }
    let want = Tensor::cat(&pieces, 1)?;
    let mut total = weighted(&want, seed(0))?;
    if !replicated {
        for rank in 1..n {
            total = (total + weighted(&want, seed(rank))?)?;
        }
    }
    let g = total.backward()?;
    close("output", &y, &want, TOL)?;
    let want_dx = get(&g, &x64)?;
    let want_dx = if replicated {
        want_dx
    } else {
        own_channels(&want_dx, n, r)?
    };
    close("dL/dx as this rank sees it", &dx, &want_dx, TOL)?;
    close(
        "dW of its group",
        &grad(conv.conv.weight())?,
        &get(&g, &ws[r])?,
        TOL,
    )
}

/// `t` (B, C, …) with every channel but r, r+n, … zeroed: what rank r of
/// n holds of an input gradient of ChainerMN's grouped convolution.
pub(super) fn own_channels(t: &Tensor, n: usize, r: usize) -> Result<Tensor> {
    let c = t.dims()[1];
    let mask: Vec<f64> = (0..c).map(|k| f64::from(u8::from(k % n == r))).collect();
    let mut shape = vec![1; t.rank()];
    shape[1] = c;
    let mask = Tensor::from_vec(mask, shape, t.device())?.to_dtype(t.dtype())?;
    Ok(t.broadcast_mul(&mask)?)
}

/// Data parallelism: rank r of n holds `images(r, n)` images; its batch
/// norm across ranks equals one device's on all of them.
fn multi_node_batch_norm(c: &Context, images: fn(usize, usize) -> usize) -> Result<()> {
    const C: usize = 3;
    let (n, r) = (c.size(), c.rank());
    let store = ParamStore::new(c.device(), SEED);
    let bn = BatchNorm2d::new(&store, "bn", C)?.multi_node(c.clone());
    bn.weight.var().set(&seeded(80, &[C], DType::F32)?)?;
    bn.bias.var().set(&seeded(81, &[C], DType::F32)?)?;
    let sizes: Vec<usize> = (0..n).map(|s| images(s, n)).collect();
    let all = seeded(82, &[sizes.iter().sum(), C, 3, 2], DType::F32)?;
    let start: usize = sizes[..r].iter().sum();
    let x = Var::from_tensor(&all.narrow(0, start, sizes[r])?)?;
    let y = bn.forward(x.as_tensor(), true)?;
    // Each rank's loss on its own images: the total is their sum.
    let v = seeded(83, &[all.dims()[0], C, 3, 2], DType::F32)?.narrow(0, start, sizes[r])?;
    let mut grads = y.tanh()?.mul(&v)?.sum_all()?.backward()?;
    store.absorb(&mut grads)?;
    let dx = get(&grads, &x)?;
    // Data parallelism sums γ's and β's gradients over the ranks.
    let dgamma = c.comm().allreduce(&grad(&bn.weight)?, ReduceOp::Sum)?;
    let dbeta = c.comm().allreduce(&grad(&bn.bias)?, ReduceOp::Sum)?;

    let one = ParamStore::new(c.device(), SEED);
    let whole = BatchNorm2d::new(&one, "bn", C)?;
    whole.weight.var().set(&seeded(80, &[C], DType::F32)?)?;
    whole.bias.var().set(&seeded(81, &[C], DType::F32)?)?;
    let xa = Var::from_tensor(&all.to_dtype(DType::F64)?)?;
    let w64 = Param::new("w", &whole.weight.value().to_dtype(DType::F64)?)?;
    let b64 = Param::new("b", &whole.bias.value().to_dtype(DType::F64)?)?;
    let whole = BatchNorm2d::from_params(w64.clone(), b64.clone())?;
    let want = whole.forward(xa.as_tensor(), true)?;
    let v_all = seeded(83, &[all.dims()[0], C, 3, 2], DType::F64)?;
    let mut g = want.tanh()?.mul(&v_all)?.sum_all()?.backward()?;
    let dxa = get(&g, &xa)?;
    w64.absorb(&mut g)?;
    b64.absorb(&mut g)?;
    close(
        "output (its images)",
        &y,
        &want.narrow(0, start, sizes[r])?,
        TOL,
    )?;
    close(
        "dL/dx (its images)",
        &dx,
        &dxa.narrow(0, start, sizes[r])?,
        TOL,
    )?;
    close("dγ summed over ranks", &dgamma, &grad(&w64)?, TOL)?;
    close("dβ summed over ranks", &dbeta, &grad(&b64)?, TOL)?;
    let (m, v) = bn.running_stats();
    let (mw, vw) = whole.running_stats();
    close("running mean", &m, &mw, TOL)?;
    close(
        "running variance (unbiased over all ranks' images)",
        &v,
        &vw,
        TOL,
    )
}

/// 2×2 max pooling of a 4×6 plane with a tie: values, and the gradient at
/// each window's first maximum.
fn max_pool() -> Result<()> {
    let dev = &shardnet::comm::HOST;
    let v: Vec<f32> = vec![
        1., 5., 2., 2., 0., -1., //
        3., 4., 2., 2., -3., -2., //
        9., 0., 1., 7., 4., 4., //
        0., 9., 6., 1., 4., 8.,
    ];
    let x = Var::from_tensor(&Tensor::from_vec(v, (1, 1, 4, 6), dev)?)?;
    let y = max_pool2d(x.as_tensor(), 2)?;
    let w = Tensor::new(&[10f32, 20., 30., 40., 50., 60.], dev)?.reshape((1, 1, 2, 3))?;
    let g = y.mul(&w)?.sum_all()?.backward()?;
    let want_y = Tensor::new(&[5f32, 2., 0., 9., 7., 8.], dev)?.reshape((1, 1, 2, 3))?;
    super::expect_eq("max-pooled values", &y, &want_y)?;
    let want_dx: Vec<f32> = vec![
        0., 10., 20., 0., 30., 0., //
        0., 0., 0., 0., 0., 0., //
        40., 0., 0., 50., 0., 0., //
        0., 0., 0., 0., 0., 60.,
    ];
    let want_dx = Tensor::from_vec(want_dx, (1, 1, 4, 6), dev)?;
    super::expect_eq("max-pool gradient", &get(&g, &x)?, &want_dx)
}
