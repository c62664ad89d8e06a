//! The tensor-parallel chains: column → row, row → column, embedding →
//! column and their three-layer forms, each layer built from given whole
//! weights or seeds, run against one device in f64.

use super::common::{close_slice, grad_of, param_grad, SEED, TOL};
use crate::autograd::{close, seeded, weighted};
use crate::{fail, miss};
use candle_core::{DType, Tensor, Var};
use shardnet::functions::Context;
use shardnet::links::{
    ColumnParallelLinear, Features, LinearConfig, RowParallelLinear, VocabParallelEmbedding,
};
use shardnet::nn::{Param, ParamStore, Whole};
use shardnet::Result;

/// Feature widths of the tensor-parallel chains: 5 → 7 → 3 → 4.
const FEATURES: [usize; 4] = [5, 7, 3, 4];
/// The embedding's vocabulary.
const VOCAB: usize = 9;

/// A tensor-parallel layer's form in a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dense {
    /// Column-parallel, its output left split (B, O_r).
    Column,
    /// Column-parallel, gathered.
    ColumnGathered,
    /// Row-parallel on a split input (after a column-parallel layer).
    Row,
    /// Row-parallel on a whole input (split by the layer).
    RowWhole,
    /// The vocabulary-parallel embedding (first only).
    Embedding,
}

enum DenseLayer {
    Column(ColumnParallelLinear),
    Row(RowParallelLinear),
    Embedding(VocabParallelEmbedding),
}

impl DenseLayer {
    fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        match self {
            DenseLayer::Column(l) => l.whole(root),
            DenseLayer::Row(l) => l.whole(root),
            DenseLayer::Embedding(l) => l.whole(root),
        }
    }
    fn params(&self) -> Vec<Param> {
        match self {
            DenseLayer::Column(l) => std::iter::once(l.linear.weight().clone())
                .chain(l.linear.bias().cloned())
                .collect(),
            DenseLayer::Row(l) => std::iter::once(l.linear.weight().clone())
                .chain(l.bias.clone())
                .collect(),
            DenseLayer::Embedding(l) => vec![l.weight.clone()],
        }
    }
}

/// Layer k's whole weight (O, I) — the table (V, D) for an embedding —
/// and bias, from seeds (f32).
fn given_dense(k: usize, form: Dense) -> Result<(Tensor, Tensor)> {
    let (i, o) = (FEATURES[k], FEATURES[k + 1]);
    let dims = if form == Dense::Embedding {
        [VOCAB, o]
    } else {
        [o, i]
    };
    let w = (seeded(240 + k as u64, &dims, DType::F32)? * 0.5)?;
    let b = (seeded(250 + k as u64, &[o], DType::F32)? * 0.1)?;
    Ok((w, b))
}

pub(super) fn dense_chain(c: &Context, forms: &[Dense]) -> Result<()> {
    let store = ParamStore::new(c.device(), SEED);
    let given = forms.len() == 3;
    let mut layers = Vec::new();
    for (k, form) in forms.iter().enumerate() {
        let (i, o) = (FEATURES[k], FEATURES[k + 1]);
        let name = format!("fc{k}");
        let (w, b) = given_dense(k, *form)?;
        let cfg = LinearConfig::new().with_layer(k);
        let gather = match form {
            Dense::ColumnGathered => Features::Whole,
            _ => Features::Sharded,
        };
        layers.push(match form {
            Dense::Column | Dense::ColumnGathered => DenseLayer::Column(if given {
                ColumnParallelLinear::from_weights(c, &store.pp(&name), &w, Some(&b), gather)?
            } else {
                ColumnParallelLinear::new(c, &store.pp(&name), i, o, cfg.with_features(gather))?
            }),
            Dense::Row | Dense::RowWhole => {
                let parallel = match form {
                    Dense::Row => Features::Sharded,
                    _ => Features::Whole,
                };
                DenseLayer::Row(if given {
                    RowParallelLinear::from_weights(c, &store.pp(&name), &w, Some(&b), parallel)?
                } else {
                    RowParallelLinear::new(c, &store.pp(&name), i, o, cfg.with_features(parallel))?
                })
            }
            Dense::Embedding => DenseLayer::Embedding(if given {
                VocabParallelEmbedding::from_weights(c, &store.pp(&name), &w)?
            } else {
                VocabParallelEmbedding::new(c, &store.pp(&name), VOCAB, o, k)?
            }),
        });
    }
    let ids: Vec<u32> = (0..3).map(|i| ((i * 4 + 1) % VOCAB) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), c.device())?;
    let x = Var::from_tensor(&seeded(260, &[3, FEATURES[0]], DType::F32)?)?;
    let mut h = x.as_tensor().clone();
    for (k, l) in layers.iter().enumerate() {
        if k > 0 {
            h = h.tanh()?;
        }
        h = match l {
            DenseLayer::Column(l) => l.forward(&h)?,
            DenseLayer::Row(l) => l.forward(&h)?,
            DenseLayer::Embedding(l) => l.forward(&ids)?,
        };
    }
    let grads = weighted(&h, 270)?.backward()?;
    let dx = grad_of(&grads, &x)?;

    let mut wholes = Vec::new();
    for (k, l) in layers.iter().enumerate() {
        let Some(whole) = l.whole(None)? else {
            return Err(fail("whole(None) gave nothing".into()));
        };
        if given {
            let (w, b) = given_dense(k, forms[k])?;
            close(&format!("layer {k}: whole weight"), &whole.weight, &w, 0.0)?;
            if let Some(got) = &whole.bias {
                close(&format!("layer {k}: whole bias"), got, &b, 0.0)?;
            }
        }
        wholes.push(whole);
    }
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let mut h64 = x64.as_tensor().clone();
    let mut vars = Vec::new();
    for (k, (form, whole)) in forms.iter().zip(&wholes).enumerate() {
        if k > 0 {
            h64 = h64.tanh()?;
        }
        let w = Var::from_tensor(&whole.weight.to_dtype(DType::F64)?)?;
        let b = match &whole.bias {
            Some(b) => Some(Var::from_tensor(&b.to_dtype(DType::F64)?)?),
            None => None,
        };
        h64 = if *form == Dense::Embedding {
            w.as_tensor().index_select(&ids, 0)?
        } else {
            let y = h64.matmul(&w.as_tensor().t()?)?;
            match &b {
                Some(b) => y.broadcast_add(b.as_tensor())?,
                None => y,
            }
        };
        vars.push((w, b));
    }
    let g = weighted(&h64, 270)?.backward()?;
    close("output", &h, &h64, TOL)?;
    if forms[0] != Dense::Embedding {
        close("dL/dx as this rank sees it", &dx, &grad_of(&g, &x64)?, TOL)?;
    }
    for (k, (l, (w, b))) in layers.iter().zip(&vars).enumerate() {
        let dw = grad_of(&g, w)?;
        let db = b.as_ref().map(|b| grad_of(&g, b)).transpose()?;
        for p in l.params() {
            let full = if p.name().ends_with(".bias") {
                match &db {
                    Some(db) => db.clone(),
                    None => continue,
                }
            } else {
                dw.clone()
            };
            let want = match p.shard() {
                Some(s) => full.narrow(s.dim, s.offset, p.value().dims()[s.dim])?,
                None => full.clone(),
            };
            close_slice(
                &format!("layer {k} ({:?}): this rank's {}", forms[k], p.name()),
                &param_grad(&p)?,
                &want,
                &full,
            )?;
        }
        if let Some(whole) = l.whole(Some(c.size() - 1))? {
            match &whole.weight_grad {
                Some(gw) => close(&format!("layer {k}: whole weight gradient"), gw, &dw, TOL)?,
                None => miss(format!("layer {k}: whole weight gradient missing")),
            }
            if let (Some(gb), Some(db)) = (&whole.bias_grad, &db) {
                close(&format!("layer {k}: whole bias gradient"), gb, db, TOL)?;
            }
        }
    }
    Ok(())
}
