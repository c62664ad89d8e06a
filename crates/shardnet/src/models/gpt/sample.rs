//! Text from a trained GPT ([`sample`]): the whole parameters (a
//! consolidated checkpoint or `--save-params` file) on one rank, a prompt,
//! and one token at a time drawn from the next token's distribution over
//! the last T tokens (temperature, top-k; a seed makes it repeatable).

use super::net::Net;
use super::Config;
use crate::functions::Context;
use crate::nn::ParamStore;
use crate::{Error, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;

/// How tokens are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleConfig {
    /// Tokens to generate after the prompt.
    pub tokens: usize,
    /// The logits are divided by it; 0: always the most likely token.
    pub temperature: f64,
    /// Draw among the k most likely tokens only; `None`: all.
    pub top_k: Option<usize>,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for SampleConfig {
    /// 200 tokens at temperature 0.8 among the 40 most likely, seed 0.
    fn default() -> Self {
        SampleConfig {
            tokens: 200,
            temperature: 0.8,
            top_k: Some(40),
            seed: 0,
        }
    }
}

/// The model's shape read from its parameters (`heads` cannot be: the
/// caller gives it): L from the blocks present, D and T from `wpe`.
pub fn config_of(params: &BTreeMap<String, Tensor>, heads: usize) -> Result<Config> {
    let wpe = params.get("transformer.wpe.weight").ok_or_else(|| {
        Error::Usage(
            "no transformer.wpe.weight among the parameters: not a GPT's (see \
             shardnet::models::gpt for its names)"
                .into(),
        )
    })?;
    let (seq, dim) = wpe.dims2()?;
    let layers = (0..)
        .take_while(|i| params.contains_key(&format!("transformer.h.{i}.ln_1.weight")))
        .count();
    let vocab = match params.get("transformer.wte.weight") {
        Some(w) => w.dims2()?.0,
        None => crate::data::BYTE_VOCAB,
    };
    Ok(Config {
        layers,
        dim,
        heads,
        seq,
        tokens: if vocab == crate::data::BYTE_VOCAB {
            super::Tokens::Bytes
        } else {
            super::Tokens::Bpe { vocab }
        },
        ..Config::default()
    })
}

/// `cfg.tokens` tokens after `prompt` from the GPT of `params` (whole, by
/// name) with `heads` heads; the prompt and what follows it. Every
/// parameter the model has must be there with its shape (an error names
/// the first that is not), and nothing else but optimizer-free extras is
/// read.
pub fn sample(
    params: &BTreeMap<String, Tensor>,
    heads: usize,
    prompt: &[u32],
    cfg: &SampleConfig,
) -> Result<Vec<u32>> {
    let model = config_of(params, heads)?;
    model.validate(1)?;
    if !(cfg.temperature >= 0.0 && cfg.temperature.is_finite()) {
        return Err(Error::Usage(format!(
            "--temperature {}: a finite number ≥ 0 (0: the most likely token)",
            cfg.temperature
        )));
    }
    if cfg.top_k == Some(0) {
        return Err(Error::Usage(
            "--top-k 0: draw among at least 1 token".into(),
        ));
    }
    let params = params.clone();
    let prompt = prompt.to_vec();
    let cfg = *cfg;
    let out = crate::comm::launch(1, move |comm| {
        let ctx = Context::new(&comm);
        let store = ParamStore::new(comm.device(), model.seed);
        let blocks: Vec<usize> = (0..model.layers).collect();
        let net = Net::new(&ctx, &store, &model, &blocks, (true, true), None)?;
        for p in store.params() {
            let t = params
                .get(p.name())
                .ok_or_else(|| Error::Usage(format!("the parameters lack {}", p.name())))?;
            if t.dims() != p.value().dims() {
                return Err(Error::Usage(format!(
                    "{}: shape {:?}, but a GPT of {} blocks, width {}, {} heads and context {} \
                     has {:?}",
                    p.name(),
                    t.dims(),
                    model.layers,
                    model.dim,
                    model.heads,
                    model.seq,
                    p.value().dims()
                )));
            }
            p.var()
                .set(&t.to_dtype(p.value().dtype())?.to_device(comm.device())?)?;
        }
        let _eval = ctx.no_grad();
        generate(&net, &comm, &prompt, &cfg)
    })?;
    out.into_iter()
        .next()
        .ok_or_else(|| Error::Usage("sample: no rank answered".into()))
}

fn generate(
    net: &Net,
    comm: &crate::comm::Communicator,
    prompt: &[u32],
    cfg: &SampleConfig,
) -> Result<Vec<u32>> {
    let window = net.max_seq()?;
    let mut ids: Vec<u32> = prompt.to_vec();
    if ids.is_empty() {
        // A newline starts a text, as between the corpus's records.
        ids.push(u32::from(b'\n'));
    }
    let mut state = cfg.seed ^ 0x5A3D_17E5;
    for _ in 0..cfg.tokens {
        let from = ids.len().saturating_sub(window);
        let ctx = Tensor::from_vec(ids[from..].to_vec(), (1, ids.len() - from), comm.device())?;
        let logits = net.next_logits(&ctx)?.squeeze(0)?;
        let logits: Vec<f32> = logits.to_vec1()?;
        let u = (crate::rng::splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
        ids.push(draw(&logits, cfg, u));
    }
    Ok(ids)
}

/// The token for a uniform draw `u` in [0, 1) from `logits` at `cfg`'s
/// temperature among its top k (the most likely at temperature 0).
fn draw(logits: &[f32], cfg: &SampleConfig, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if cfg.temperature == 0.0 {
        return order[0] as u32;
    }
    order.truncate(cfg.top_k.unwrap_or(order.len()).min(order.len()));
    let top = f64::from(logits[order[0]]);
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - top) / cfg.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (w, &i) in weights.iter().zip(&order) {
        acc += w / total;
        if u < acc {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_follow_temperature_and_top_k() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let greedy = SampleConfig {
            temperature: 0.0,
            ..SampleConfig::default()
        };
        assert_eq!(draw(&logits, &greedy, 0.99), 1);
        let top2 = SampleConfig {
            temperature: 1.0,
            top_k: Some(2),
            ..SampleConfig::default()
        };
        // Among tokens 1 and 2: p(1) = e² / (e² + e) ≈ 0.731.
        assert_eq!(draw(&logits, &top2, 0.70), 1);
        assert_eq!(draw(&logits, &top2, 0.75), 2);
        let all = SampleConfig {
            top_k: None,
            ..top2
        };
        assert_eq!(draw(&logits, &all, 0.9999), 3);
    }
}
