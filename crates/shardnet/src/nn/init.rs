//! Seeded initialisers: the one home of how shardnet fills parameters.
//!
//! Values come from splitmix64 streams keyed by the run's seed and by *what*
//! is initialised (a layer and which of its tensors, or a row's global
//! index), never by which rank holds it: a model split over any number of
//! ranks starts from the same global tensors, so every split trains the same
//! model.
//!
//! | initialiser | stream | values |
//! |-------------|--------|--------|
//! | [`uniform_layer`] | seed ⊕ layer·2³² ⊕ which·2⁵⁶ ⊕ const | U(−bound, bound), row-major |
//! | [`uniform_rows`], [`uniform_rows_var`] | per global row g: seed ⊕ g·0xD1B5…ED03 | U(−bound, bound), each row its own stream |
//! | [`uniform_block`] | as [`uniform_rows`] | the block (rows, cols) of that global tensor: a shard split along either dimension |
//! | [`normal_layer`] | seed ⊕ layer·2³² ⊕ which·2⁵⁶ ⊕ const | N(0, std²), Box–Muller, row-major |
//! | [`layer_seed`] | seed ⊕ layer·2³² ⊕ which·2⁵⁶ ⊕ const | the seed of one tensor of one layer, for the two above |
//!
//! `bound` is usually 1/√fan_in (PyTorch's and Chainer's default for linear
//! layers).

use crate::rng::unit;
use crate::Result;
use candle_core::{Device, Tensor, Var};
use rayon::prelude::*;

/// A whole tensor of `dims` (rows, cols) for tensor `which` (0: weight,
/// 1: bias, …) of layer `layer`, uniform in ±`bound`, on `device`.
pub fn uniform_layer(
    seed: u64,
    layer: usize,
    which: u64,
    dims: (usize, usize),
    bound: f64,
    device: &Device,
) -> Result<Tensor> {
    let mut s = seed ^ ((layer as u64) << 32) ^ (which << 56) ^ 0x5DEE_CE66_D1CE_4E5B;
    let v: Vec<f32> = (0..dims.0 * dims.1)
        .map(|_| (unit(&mut s) * bound) as f32)
        .collect();
    Ok(Tensor::from_vec(v, dims, device)?)
}

/// A whole tensor of `dims` for tensor `which` of layer `layer`, normal
/// with mean 0 and standard deviation `std` (Box–Muller on the stream of
/// [`uniform_layer`]'s key, row-major), on `device`. Chainer's default for
/// a linear layer's weight is LeCun's: std = 1/√fan_in.
pub fn normal_layer(
    seed: u64,
    layer: usize,
    which: u64,
    dims: (usize, usize),
    std: f64,
    device: &Device,
) -> Result<Tensor> {
    let mut s = seed ^ ((layer as u64) << 32) ^ (which << 56) ^ 0x2545_F491_4F6C_DD1D;
    let n = dims.0 * dims.1;
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        // Two uniforms in (0, 1] → two independent normals.
        let u1 = (unit(&mut s) + 1.0) / 2.0;
        let u2 = (unit(&mut s) + 1.0) / 2.0;
        let r = (-2.0 * (1.0 - u1).max(f64::MIN_POSITIVE).ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        v.push((r * t.cos() * std) as f32);
        v.push((r * t.sin() * std) as f32);
    }
    v.truncate(n);
    Ok(Tensor::from_vec(v, dims, device)?)
}

/// The seed of tensor `which` (0: weight, 1: bias, …) of layer `layer`, for
/// [`uniform_rows`] and [`uniform_block`].
pub fn layer_seed(seed: u64, layer: usize, which: u64) -> u64 {
    seed ^ ((layer as u64) << 32) ^ (which << 56) ^ 0x9E37_79B9_7F4A_7C15
}

/// The block `rows` × `cols` (global indices) of the (·, `total_cols`)
/// tensor of [`uniform_rows`]: the same values whichever way the tensor is
/// split over ranks, by rows (output features) or by columns (input
/// features). On `device`.
pub fn uniform_block(
    seed: u64,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    total_cols: usize,
    bound: f64,
    device: &Device,
) -> Result<Tensor> {
    if cols.end > total_cols {
        return Err(crate::Error::Usage(format!(
            "uniform_block: columns {cols:?} of a tensor with {total_cols}"
        )));
    }
    let (n, k) = (rows.len(), cols.len());
    let mut w = vec![0f32; n * k];
    w.par_chunks_mut(k.max(1)).enumerate().for_each(|(i, row)| {
        let mut s = seed ^ ((rows.start + i) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        // Each row is one stream: skip the columns before the block.
        for _ in 0..cols.start {
            unit(&mut s);
        }
        for v in row {
            *v = (unit(&mut s) * bound) as f32;
        }
    });
    Ok(Tensor::from_vec(w, (n, k), device)?)
}

/// Rows `rows` (global indices) of a (·, cols) tensor whose row g is drawn
/// from its own stream: any split of the rows over ranks gives the same
/// global tensor. On `device`.
pub fn uniform_rows(
    seed: u64,
    rows: std::ops::Range<usize>,
    cols: usize,
    bound: f64,
    device: &Device,
) -> Result<Tensor> {
    let n = rows.len();
    Ok(Tensor::from_vec(
        uniform_rows_vec(seed, rows, cols, bound),
        (n, cols),
        device,
    )?)
}

/// [`uniform_rows`] made a `Var` directly: on the CPU its values are never
/// copied (a [`Param`](super::Param) made from a tensor copies it), so a
/// large shard never exists twice, not even for a moment.
pub fn uniform_rows_var(
    seed: u64,
    rows: std::ops::Range<usize>,
    cols: usize,
    bound: f64,
    device: &Device,
) -> Result<Var> {
    let n = rows.len();
    Ok(Var::from_vec(
        uniform_rows_vec(seed, rows, cols, bound),
        (n, cols),
        device,
    )?)
}

fn uniform_rows_vec(seed: u64, rows: std::ops::Range<usize>, cols: usize, bound: f64) -> Vec<f32> {
    let mut w = vec![0f32; rows.len() * cols];
    w.par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(k, row)| {
            let mut s = seed ^ ((rows.start + k) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            for v in row {
                *v = (unit(&mut s) * bound) as f32;
            }
        });
    w
}
