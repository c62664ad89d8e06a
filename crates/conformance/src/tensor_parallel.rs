//! The tensor-parallel layers' suite: [`ColumnParallelLinear`],
//! [`RowParallelLinear`] and [`VocabParallelEmbedding`] against the same
//! layers on one device, written with plain candle ops in f64 from the
//! global tensors.
//!
//! Every rank builds the input (the same on every rank) and the global
//! weights from seeds, computes the one-device output and every gradient,
//! and compares its own: the output, dL/dx, and its shard of each weight's
//! and bias's gradient, relative error ≤ 1e-5 (f32 against f64). Sizes are
//! uneven on 2–4 ranks (I = 5, H = 7, O = 3), and a hidden width of 3 on 4
//! ranks leaves a rank with no features.

use super::autograd::{close, seeded, weighted, Case};
use candle_core::{DType, Tensor, Var};
use shardnet::comm::chunk_range;
use shardnet::functions::Context;
use shardnet::links::{
    ColumnParallelLinear, Features, LinearConfig, RowParallelLinear, VocabParallelEmbedding,
};
use shardnet::nn::{init, Param, ParamStore};
use shardnet::Result;

const SEED: u64 = 23;
const B: usize = 6;
const I: usize = 5;
const O: usize = 3;
const TOL: f64 = 1e-5;

/// Every case: column → row with the one allreduce (parallel input), with
/// gathered output and a split input, at hidden widths 7 and 3, and the
/// embedding.
pub fn cases() -> Vec<Case> {
    let mut all: Vec<Case> = Vec::new();
    for hidden in [7, 3] {
        for gather in [false, true] {
            let form = if gather {
                "gathered_output_split_input"
            } else {
                "parallel_hidden"
            };
            all.push((
                format!("tensor_parallel_mlp_h{hidden}_{form}_vs_one_device"),
                Box::new(move |c| mlp(c, hidden, gather)),
            ));
        }
    }
    all.push((
        "vocab_parallel_embedding_vs_one_device".into(),
        Box::new(embedding),
    ));
    all
}

/// The global (rows, cols) tensor `which` of `layer`, in f64.
fn global(layer: usize, which: u64, rows: usize, cols: usize, fan_in: usize) -> Result<Tensor> {
    let seed = init::layer_seed(SEED, layer, which);
    let bound = 1.0 / (fan_in as f64).sqrt();
    let t = init::uniform_block(seed, 0..rows, 0..cols, cols, bound, &shardnet::comm::HOST)?;
    Ok(t.to_dtype(DType::F64)?)
}

fn grad(p: &Param) -> Result<Tensor> {
    Ok(match p.grad() {
        Some(g) => g.clone(),
        None => p.value().zeros_like()?,
    })
}

/// y = down(relu(up(x))): up column-parallel, down row-parallel; with
/// `gather`, up gathers its output and down splits its input.
fn mlp(c: &Context, hidden: usize, gather: bool) -> Result<()> {
    let (rank, n) = (c.rank(), c.size());
    let store = ParamStore::new(c.device(), SEED);
    let between = LinearConfig::new().with_features(if gather {
        Features::Whole
    } else {
        Features::Sharded
    });
    let up = ColumnParallelLinear::new(c, &store.pp("up"), I, hidden, between)?;
    let down = RowParallelLinear::new(c, &store.pp("down"), hidden, O, between.with_layer(1))?;
    let x = Var::from_tensor(&seeded(5, &[B, I], DType::F32)?)?;
    let y = down.forward(&up.forward(x.as_tensor())?.relu()?)?;
    let mut grads = weighted(&y, 6)?.backward()?;
    store.absorb(&mut grads)?;
    let dx = grads
        .get(x.as_tensor())
        .cloned()
        .unwrap_or(x.as_tensor().zeros_like()?);

    // One device, f64, from the global tensors.
    let wu = Var::from_tensor(&global(0, 0, hidden, I, I)?)?;
    let bu = Var::from_tensor(&global(0, 1, hidden, 1, I)?.reshape(hidden)?)?;
    let wd = Var::from_tensor(&global(1, 0, O, hidden, hidden)?)?;
    let bd = Var::from_tensor(&global(1, 1, O, 1, hidden)?.reshape(O)?)?;
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let h = x64
        .as_tensor()
        .matmul(&wu.as_tensor().t()?)?
        .broadcast_add(bu.as_tensor())?
        .relu()?;
    let want = h
        .matmul(&wd.as_tensor().t()?)?
        .broadcast_add(bd.as_tensor())?;
    let g = weighted(&want, 6)?.backward()?;
    let get = |v: &Var| -> Result<Tensor> {
        Ok(g.get(v.as_tensor())
            .cloned()
            .unwrap_or(v.as_tensor().zeros_like()?))
    };
    let rows = chunk_range(hidden, n, rank);
    close("output", &y, &want, TOL)?;
    close("dL/dx", &dx, &get(&x64)?, TOL)?;
    let narrow =
        |t: Tensor, dim: usize| -> Result<Tensor> { Ok(t.narrow(dim, rows.start, rows.len())?) };
    close(
        "up's weight gradient (its rows)",
        &grad(up.linear.weight())?,
        &narrow(get(&wu)?, 0)?,
        TOL,
    )?;
    let up_bias = up.linear.bias().map(grad).transpose()?;
    if let Some(gb) = up_bias {
        close(
            "up's bias gradient (its rows)",
            &gb,
            &narrow(get(&bu)?, 0)?,
            TOL,
        )?;
    }
    close(
        "down's weight gradient (its columns)",
        &grad(down.linear.weight())?,
        &narrow(get(&wd)?, 1)?,
        TOL,
    )?;
    match &down.bias {
        Some(b) => close("down's bias gradient", &grad(b)?, &get(&bd)?, TOL),
        None => super::check(false, || "down has no bias".into()),
    }
}

/// The embedding's rows for seeded ids, then a weighted sum.
fn embedding(c: &Context) -> Result<()> {
    const V: usize = 9;
    const D: usize = 4;
    let store = ParamStore::new(c.device(), SEED);
    let emb = VocabParallelEmbedding::new(c, &store.pp("emb"), V, D, 2)?;
    let ids: Vec<u32> = (0..B).map(|i| ((i * 7 + 2) % V) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), c.device())?;
    let y = emb.forward(&ids)?;
    let mut grads = weighted(&y, 8)?.backward()?;
    store.absorb(&mut grads)?;

    let e = Var::from_tensor(&global(2, 0, V, D, 1)?)?;
    let want = e.as_tensor().index_select(&ids, 0)?;
    let g = weighted(&want, 8)?.backward()?;
    let de = g
        .get(e.as_tensor())
        .cloned()
        .unwrap_or(e.as_tensor().zeros_like()?);
    let rows = chunk_range(V, c.size(), c.rank());
    close("embedding output", &y, &want, TOL)?;
    close(
        "embedding gradient (its rows)",
        &grad(&emb.weight)?,
        &de.narrow(0, rows.start, rows.len())?,
        TOL,
    )
}
