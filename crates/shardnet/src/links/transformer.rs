//! A GPT-2 block split Megatron's way over a tensor-parallel group
//! ([`GptBlock`], whose doc has the table), and its two halves.

use super::region::{enter_linear, exit_linear};
use super::tensor_parallel::{ColumnParallelLinear, Features, LinearConfig, RowParallelLinear};
use crate::comm::chunk_range;
use crate::functions::Context;
use crate::nn::{
    add_residual, causal_self_attention, dropout_rows, gelu, Init, LayerNorm, Linear, Param,
    ParamStore, ShardedParam,
};
use crate::{Error, Result};
use candle_core::Tensor;

/// GPT-2's initial standard deviation of a weight.
pub const INIT_STD: f64 = 0.02;

/// LayerNorm's ε in GPT-2.
pub const LN_EPS: f64 = 1e-5;

/// The shape of a block and where its seeds are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// Model width D.
    pub dim: usize,
    /// Attention heads H (D divisible by H).
    pub heads: usize,
    /// Blocks in the model L (the residual projections' initial standard
    /// deviation is 0.02/√(2L)).
    pub layers: usize,
    /// The first of the four layer indices (seeds) this block uses.
    pub seed_layer: usize,
    /// Megatron's sequence parallelism: the block's input and output are
    /// this rank's positions (B, T_r, D), T_r = `chunk_range(T, n, r)`;
    /// the layer norms and residuals run on them alone.
    pub sequence_parallel: bool,
    /// Mixed precision: the block's four linear layers' GEMMs on bf16
    /// inputs with f32 sums ([`Linear::with_bf16`]).
    pub bf16: bool,
}

impl BlockConfig {
    /// Refuse a shape no block can have.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.heads == 0 || !self.dim.is_multiple_of(self.heads) {
            return Err(Error::Usage(format!(
                "--dim {} and --heads {}: the width must be a positive multiple of the heads \
                 (each head has dim / heads features)",
                self.dim, self.heads
            )));
        }
        Ok(())
    }

    fn residual_std(&self) -> f64 {
        INIT_STD / (2.0 * self.layers.max(1) as f64).sqrt()
    }
}

/// Dropout on a block's two residual branches (GPT-2's `resid_pdrop`):
/// probability `p`, masks from `seed` and the block's layer, each (b, t)
/// row of the block's input keyed by `keys` (its global index: the batch
/// row and the position, whatever the rank holds of them), so every split
/// drops what one device would.
#[derive(Clone, Debug)]
pub struct BlockDropout {
    /// The probability of dropping an element.
    pub p: f64,
    /// The step's seed.
    pub seed: u64,
    /// One key per row of the input's (B, T) (row-major).
    pub keys: Vec<u64>,
}

impl BlockDropout {
    /// Dropout of branch `which` (0 attention, 1 MLP) of the block whose
    /// first seed is `layer`.
    fn apply(&self, y: &Tensor, layer: usize, which: u64) -> Result<Tensor> {
        let mut s = self.seed ^ (layer as u64).wrapping_mul(0xA24B_AED4_963E_E407);
        let seed = crate::rng::splitmix64(&mut s) ^ which;
        dropout_rows(y, self.p, seed, &self.keys)
    }
}

/// y + b, b broadcast over the rows (none: y).
fn with_bias(y: Tensor, bias: Option<&Param>) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => y.broadcast_add(&b.tracked()?)?,
        None => y,
    })
}

/// Causal self-attention with its heads split over the ranks (see the
/// module doc).
#[derive(Clone)]
pub struct ParallelAttention {
    ctx: Context,
    /// This rank's q, k, v rows: (3, H_r·d_h, D), bias (3, H_r·d_h).
    c_attn: Linear,
    /// This rank's columns of the output projection (D, H_r·d_h).
    c_proj: Linear,
    /// The output projection's bias, whole.
    c_proj_bias: Param,
    heads: usize,
    sequence_parallel: bool,
}

impl ParallelAttention {
    /// This rank's heads of the attention of `cfg`, its parameters in
    /// `store` (scope it: `store.pp("attn")`): `c_attn.weight`,
    /// `c_attn.bias`, `c_proj.weight`, `c_proj.bias`.
    pub fn new(ctx: &Context, store: &ParamStore, cfg: &BlockConfig) -> Result<Self> {
        cfg.validate()?;
        let (d, hd) = (cfg.dim, cfg.dim / cfg.heads);
        let mine = chunk_range(cfg.heads, ctx.size(), ctx.rank());
        let features = mine.start * hd..mine.end * hd;
        let qkv = store.pp("c_attn");
        let w = ShardedParam::new("weight", &[3, d, d], Init::std(cfg.seed_layer, INIT_STD))
            .split_at(1, features.clone())
            .build(&qkv)?;
        let b = ShardedParam::new("bias", &[3, d], Init::Constant(0.0))
            .split_at(1, features.clone())
            .build(&qkv)?;
        let proj = store.pp("c_proj");
        let std = cfg.residual_std();
        let pw = ShardedParam::new("weight", &[d, d], Init::std(cfg.seed_layer + 1, std))
            .split_at(1, features)
            .build(&proj)?;
        let pb = ShardedParam::new("bias", &[d], Init::Constant(0.0)).build(&proj)?;
        Ok(ParallelAttention {
            ctx: ctx.clone(),
            c_attn: Linear::new(w, Some(b)).with_bf16(cfg.bf16),
            c_proj: Linear::new(pw, None).with_bf16(cfg.bf16),
            c_proj_bias: pb,
            heads: mine.len(),
            sequence_parallel: cfg.sequence_parallel,
        })
    }

    /// This rank's parameters.
    pub fn params(&self) -> Vec<Param> {
        let mut p = self.c_attn.params();
        p.extend(self.c_proj.params());
        p.push(self.c_proj_bias.clone());
        p
    }

    /// Attention over `x` (B, T, D), the same on every rank: (B, T, D);
    /// under sequence parallelism each rank's positions (B, T_r, D) in and
    /// out.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = self.branch(x)?;
        with_bias(y, Some(bias))
    }

    /// [`Self::forward`] without the output bias, and that bias (the block
    /// adds it with the residual).
    fn branch(&self, x: &Tensor) -> Result<(Tensor, &Param)> {
        let sp = self.sequence_parallel;
        // (B, T, D) → (B, T, 3·H_r·d_h) → (B, T, H_r·d_h) → (B, T, D).
        let qkv = enter_linear(&self.ctx, x, &self.c_attn, sp)?;
        // A rank without a head has no features: its share of the sum is
        // zero, and it still takes part in the region's communication.
        let y = if self.heads == 0 {
            qkv
        } else {
            causal_self_attention(&qkv, self.heads)?
        };
        Ok((
            exit_linear(&self.ctx, &y, &self.c_proj, sp)?,
            &self.c_proj_bias,
        ))
    }
}

/// The block's MLP, c_fc → GELU → c_proj, its hidden features split over
/// the ranks (see the module doc).
#[derive(Clone)]
pub struct ParallelMlp {
    ctx: Context,
    c_fc: ColumnParallelLinear,
    c_proj: RowParallelLinear,
    sequence_parallel: bool,
}

impl ParallelMlp {
    /// This rank's features of the MLP of `cfg` (4D hidden), its parameters
    /// in `store` (scope it: `store.pp("mlp")`): `c_fc.weight`,
    /// `c_fc.bias`, `c_proj.weight`, `c_proj.bias`.
    pub fn new(ctx: &Context, store: &ParamStore, cfg: &BlockConfig) -> Result<Self> {
        let (d, f) = (cfg.dim, 4 * cfg.dim);
        let sharded = LinearConfig::new().with_features(Features::Sharded);
        let mut c_fc = ColumnParallelLinear::new(
            ctx,
            &store.pp("c_fc"),
            d,
            f,
            sharded.with_layer(cfg.seed_layer + 2).with_std(INIT_STD),
        )?;
        let mut c_proj = RowParallelLinear::new(
            ctx,
            &store.pp("c_proj"),
            f,
            d,
            sharded
                .with_layer(cfg.seed_layer + 3)
                .with_std(cfg.residual_std()),
        )?;
        c_fc.linear = c_fc.linear.with_bf16(cfg.bf16);
        c_proj.linear = c_proj.linear.with_bf16(cfg.bf16);
        Ok(ParallelMlp {
            ctx: ctx.clone(),
            c_fc,
            c_proj,
            sequence_parallel: cfg.sequence_parallel,
        })
    }

    /// The MLP of `x` (B, T, D), the same on every rank: (B, T, D); under
    /// sequence parallelism each rank's positions (B, T_r, D) in and out.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = self.branch(x)?;
        with_bias(y, bias)
    }

    /// [`Self::forward`] without the output bias, and that bias: the
    /// layers' own GEMMs between the region ops (copy-to and reduce-from,
    /// or the sequence's allgather and reduce-scatter).
    fn branch(&self, x: &Tensor) -> Result<(Tensor, Option<&Param>)> {
        let sp = self.sequence_parallel;
        let h = gelu(&enter_linear(&self.ctx, x, &self.c_fc.linear, sp)?)?;
        Ok((
            exit_linear(&self.ctx, &h, &self.c_proj.linear, sp)?,
            self.c_proj.bias.as_ref(),
        ))
    }
}

/// GPT-2's block (pre-LN): x + attn(ln_1(x)), then h + mlp(ln_2(h)), split
/// Megatron's way over the ranks of a tensor-parallel group: attention by
/// heads, the MLP by its hidden features, built from the region ops of
/// [`crate::functions`].
///
/// Every rank of the group holds the block's input x (B, T, D) whole and
/// computes the same output; H heads of size d_h = D / H, F = 4D hidden
/// features; rank r of n holds heads H_r = `chunk_range(H, n, r)` and
/// features F_r = `chunk_range(F, n, r)`, so heads and features that do not
/// divide the ranks work (a rank may hold no head).
///
/// | part | rank r holds | forward | backward |
/// |------|--------------|---------|----------|
/// | `ln_1`, `ln_2` | γ, β whole | on the whole x | the same gradient on every rank |
/// | `attn.c_attn` | q, k, v rows of H_r: W (3, H_r·d_h, D), b (3, H_r·d_h) | copy-to(x) W_rᵀ + b_r ([`enter_linear`]) | dx: allreduce (copy-to) |
/// | attention | its heads | [`causal_self_attention`] | local |
/// | `attn.c_proj` | W's columns of H_r (D, H_r·d_h), b whole | reduce-from(y_r W_rᵀ) ([`exit_linear`]) + b with the residual ([`add_residual`]) | local |
/// | `mlp.c_fc` | rows F_r of (F, D), b_r | copy-to(x) W_rᵀ + b_r ([`enter_linear`]) | dx: allreduce |
/// | `mlp.c_proj` | columns F_r of (D, F), b whole | reduce-from(h_r W_rᵀ) ([`exit_linear`]) + b with the residual | local |
///
/// Two allreduces forward and two backward per block, as Megatron's. With
/// [`BlockConfig::sequence_parallel`] (Korthikanti et al. 2022) the block
/// holds each rank's positions between the regions: copy-to becomes an
/// allgather along the sequence (backward: reduce-scatter) and
/// reduce-from a reduce-scatter (backward: allgather) — the same bytes,
/// and one allgather more in backward: the entries keep their input
/// before the allgather and gather it again —, so the layer norms,
/// residuals and every activation outside the regions are 1/n per rank;
/// the layer norms' and the output biases' gradients are then partial
/// ([`GptBlock::sequence_partial`]). On one rank the regions are the
/// layers alone.
/// `c_attn`'s weight is nanoGPT's (3·D, D) seen as (3, D, D) (the same
/// bytes): q, k, v, each (D, D) with head h in rows h·d_h .., so a head's
/// rows of all three are one range along dimension 1 and the split is a
/// [`Shard`](crate::nn::Shard) like any other; checkpoints reshard it to
/// any number of ranks.
///
/// Initialisation is GPT-2's with uniform draws of the same standard
/// deviation: weights 0.02 (the residual projections 0.02/√(2L)), biases
/// 0, from (seed, layer), so every split trains the same model.
#[derive(Clone)]
pub struct GptBlock {
    seed_layer: usize,
    ln_1: LayerNorm,
    attn: ParallelAttention,
    ln_2: LayerNorm,
    mlp: ParallelMlp,
}

impl GptBlock {
    /// This rank's part of a block of `cfg`, its parameters in `store`
    /// (scope it: `store.pp("h").pp("0")`): `ln_1.*`, `attn.*`, `ln_2.*`,
    /// `mlp.*`.
    pub fn new(ctx: &Context, store: &ParamStore, cfg: &BlockConfig) -> Result<Self> {
        Ok(GptBlock {
            seed_layer: cfg.seed_layer,
            ln_1: LayerNorm::new(&store.pp("ln_1"), cfg.dim, LN_EPS)?,
            attn: ParallelAttention::new(ctx, &store.pp("attn"), cfg)?,
            ln_2: LayerNorm::new(&store.pp("ln_2"), cfg.dim, LN_EPS)?,
            mlp: ParallelMlp::new(ctx, &store.pp("mlp"), cfg)?,
        })
    }

    /// The whole parameters whose gradient, under sequence parallelism,
    /// each rank holds only its positions' part of: γ and β of both layer
    /// norms and the two output projections' biases. The caller sums their
    /// gradients over the group after backward (Megatron's
    /// `allreduce_layernorm_grads`).
    pub fn sequence_partial(&self) -> Vec<Param> {
        let mut p = self.ln_1.params();
        p.extend(self.ln_2.params());
        p.push(self.attn.c_proj_bias.clone());
        p.extend(self.mlp.c_proj.bias.clone());
        p
    }

    /// The block on `x` (B, T, D), the same on every rank: (B, T, D); under
    /// sequence parallelism each rank's positions (B, T_r, D) in and out.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, None)
    }

    /// [`Self::forward`] with dropout on both residual branches (training).
    pub fn forward_with(&self, x: &Tensor, dropout: Option<&BlockDropout>) -> Result<Tensor> {
        // x + dropout(y + b), or in one pass without dropout.
        let residual = |x: &Tensor, (y, b): (Tensor, Option<&Param>), which: u64| match dropout {
            Some(d) => Ok((x + d.apply(&with_bias(y, b)?, self.seed_layer, which)?)?),
            None => add_residual(x, &y, b),
        };
        let (y, b) = self.attn.branch(&self.ln_1.forward(x)?)?;
        let h = residual(x, (y, Some(b)), 0)?;
        let y = self.mlp.branch(&self.ln_2.forward(&h)?)?;
        residual(&h, y, 1)
    }
}
