//! Seeded initialisation of the models' dense layers: layer l's weight and
//! bias uniform in ±1/√in (PyTorch's and Chainer's default), drawn from
//! (seed, l) alone, so the same layer gets the same values on whichever rank
//! holds it.

use crate::data::splitmix64;
use crate::nn::{Linear, Param};
use crate::Result;
use candle_core::{Device, Tensor};

/// splitmix64-based uniform values in ±bound from (seed, layer, which).
pub(crate) fn uniform(
    seed: u64,
    layer: usize,
    which: u64,
    dims: (usize, usize),
    bound: f64,
    device: &Device,
) -> Result<Tensor> {
    let mut s = seed ^ ((layer as u64) << 32) ^ (which << 56) ^ 0x5DEE_CE66_D1CE_4E5B;
    let n = dims.0 * dims.1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let z = splitmix64(&mut s);
            (((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * bound) as f32
        })
        .collect();
    Ok(Tensor::from_vec(v, dims, device)?)
}

/// Layer `l` as `Linear(input, output)` with bias, its parameters named
/// `{prefix}{l}.weight` and `{prefix}{l}.bias`.
pub(crate) fn seeded_linear(
    prefix: &str,
    seed: u64,
    l: usize,
    (input, output): (usize, usize),
    device: &Device,
) -> Result<Linear> {
    let bound = 1.0 / (input as f64).sqrt();
    let weight = Param::new(
        format!("{prefix}{l}.weight"),
        &uniform(seed, l, 0, (output, input), bound, device)?,
    )?;
    let bias = Param::new(
        format!("{prefix}{l}.bias"),
        &uniform(seed, l, 1, (1, output), bound, device)?.reshape(output)?,
    )?;
    Ok(Linear::new(weight, Some(bias)))
}
