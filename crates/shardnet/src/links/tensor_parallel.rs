//! Tensor-parallel layers in the Megatron-LM style: one layer's weight split
//! over the ranks of a communicator, built only from the differentiable
//! region ops of [`crate::functions`].
//!
//! Every rank holds the layer's input whole (replicated) unless it says
//! otherwise, and every rank computes the same loss from the output.
//! W is (O, I), y = x Wᵀ + b; rank r of n holds chunk r ([`chunk_range`]) of
//! the split dimension, so uneven splits (and ranks with nothing) work.
//!
//! | layer | rank r holds | forward | backward |
//! |-------|--------------|---------|----------|
//! | [`ColumnParallelLinear`] | rows O_r of W, b_r | copy-to(x) W_rᵀ + b_r; output [`Features::Whole`]: gather-from along the features | dx: allreduce (copy-to); output whole: dy_r, its slice (no communication) |
//! | [`RowParallelLinear`] | columns I_r of W, b whole | reduce-from(x_r W_rᵀ) + b, x_r = x itself on a [`Features::Sharded`] input, else scatter-to(x) | dx_r = dy W_r, no communication; on a whole input, allgather of the slices |
//! | [`VocabParallelEmbedding`] | rows V_r of E (V, D) | reduce-from(E_r[ids] for ids in V_r, 0 elsewhere) | dE_r: the rows of its ids |
//!
//! Region ops (forward / backward): copy-to = [`copy_to_shards`] (identity /
//! allreduce), reduce-from = [`allreduce_replicated`] (allreduce /
//! identity), gather-from = [`allgather_replicated`] (allgather / slice),
//! scatter-to = [`split_to_shards`] (slice / allgather). A column-parallel
//! layer followed by a row-parallel one, the features between them
//! [`Features::Sharded`] (Megatron's `gather_output = False`,
//! `input_is_parallel = True`), costs one allreduce forward and one backward.
//!
//! Weights are initialised from the *global* tensor's seed
//! ([`ShardedParam`], [`Init`]), so every split over any number of ranks
//! trains the same model as one rank does. A layer's parameters are named
//! under the store's prefix (`store.pp("up")`: `up.weight`, `up.bias`), so
//! two layers of one model never clash.
//!
//! ```
//! use candle_core::{DType, Tensor};
//! use shardnet::functions::Context;
//! use shardnet::links::{ColumnParallelLinear, Features, LinearConfig, RowParallelLinear};
//! use shardnet::nn::ParamStore;
//!
//! let outs = shardnet::comm::launch(2, |comm| {
//!     let ctx = Context::new(&comm);
//!     let store = ParamStore::new(comm.device(), 7);
//!     let between = LinearConfig::new().with_features(Features::Sharded);
//!     let up = ColumnParallelLinear::new(&ctx, &store.pp("up"), 4, 6, between)?;
//!     let down = RowParallelLinear::new(&ctx, &store.pp("down"), 6, 3, between.with_layer(1))?;
//!     let x = Tensor::ones((2, 4), DType::F32, comm.device())?;
//!     let y = down.forward(&up.forward(&x)?.relu()?)?; // (2, 3) on every rank
//!     y.sum_all()?.backward()?;
//!     // The gradients are in the parameters, on either path.
//!     assert!(store.params().iter().all(|p| p.grad().is_some()));
//!     Ok(y.dims().to_vec())
//! })?;
//! assert_eq!(outs, vec![vec![2, 3], vec![2, 3]]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::comm::chunk_range;
use crate::functions::{
    allgather_replicated, allreduce_replicated, copy_to_shards, split_to_shards, Context,
};
use crate::nn::{Init, Linear, Param, ParamStore, ShardedParam, WeightsFrom, Whole};
use crate::{Error, ReduceOp, Result};
use candle_core::{DType, Tensor};

/// Where a tensor-parallel layer's features are, on its output (a
/// [`ColumnParallelLinear`]) or its input (a [`RowParallelLinear`]): whole
/// on every rank, or each rank its slice (Megatron's `gather_output` and
/// `input_is_parallel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Features {
    /// Every feature on every rank.
    Whole,
    /// Rank r holds its chunk of the features (B, F_r).
    Sharded,
}

/// How a tensor-parallel linear layer is built: `LinearConfig::new()`
/// (a bias, whole features, layer 0) and its builder methods.
///
/// ```
/// use shardnet::links::{Features, LinearConfig};
/// let cfg = LinearConfig::new().with_bias(false).with_features(Features::Sharded).with_layer(3);
/// assert_eq!((cfg.bias, cfg.features, cfg.layer), (false, Features::Sharded, 3));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearConfig {
    /// Whether the layer adds a bias.
    pub bias: bool,
    /// A [`ColumnParallelLinear`]'s output, a [`RowParallelLinear`]'s
    /// input: whole on every rank or each rank its slice.
    pub features: Features,
    /// The layer's index in its model: the seed of its initial values.
    pub layer: usize,
    /// The weight's standard deviation, the bias 0 (GPT-2's
    /// initialisation, [`WeightsFrom::Std`]); `None`: uniform in
    /// ±1/√in_features, weight and bias (PyTorch's `Linear`).
    pub std: Option<f64>,
}

impl Default for LinearConfig {
    fn default() -> Self {
        LinearConfig {
            bias: true,
            features: Features::Whole,
            layer: 0,
            std: None,
        }
    }
}

impl LinearConfig {
    /// A bias, whole features, layer 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// With or without a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// The features on the split side (see [`Self::features`]).
    pub fn with_features(mut self, features: Features) -> Self {
        self.features = features;
        self
    }

    /// The layer's index in its model (its seed).
    pub fn with_layer(mut self, layer: usize) -> Self {
        self.layer = layer;
        self
    }

    /// Initialise the weight with standard deviation `std` and the bias
    /// with 0 (GPT-2's way; see [`Self::std`]).
    pub fn with_std(mut self, std: f64) -> Self {
        self.std = Some(std);
        self
    }
}

/// A seeded linear layer's weights: `cfg`'s layer and bias, of `cfg`'s
/// standard deviation or in ±1/√in_features.
fn seeded(in_features: usize, cfg: &LinearConfig) -> WeightsFrom<'static> {
    match cfg.std {
        Some(std) => WeightsFrom::Std {
            layer: cfg.layer,
            std,
            bias: cfg.bias,
        },
        None => WeightsFrom::Seeded {
            layer: cfg.layer,
            fan_in: in_features,
            bias: cfg.bias,
        },
    }
}

/// (rows, cols) of a user's whole 2-D weight, and a bias of `rows`, checked.
fn given(name: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    let [rows, cols] = weight.dims()[..] else {
        return Err(Error::Usage(format!(
            "{name}: a whole weight of shape {:?}; expected 2 dimensions",
            weight.dims()
        )));
    };
    crate::nn::check_bias(name, bias, rows)?;
    Ok((rows, cols))
}

fn features(name: &str, x: &Tensor, want: usize) -> Result<()> {
    match x.dims().split_last() {
        Some((k, lead)) if *k == want && !lead.is_empty() => Ok(()),
        _ => Err(Error::Usage(format!(
            "{name}: input of shape {:?}, expected (batch, {want}) or (…, {want})",
            x.dims()
        ))),
    }
}

/// y = x Wᵀ + b with W's rows (output features) split over the ranks (see
/// the module doc).
#[derive(Clone)]
pub struct ColumnParallelLinear {
    ctx: Context,
    /// This rank's rows of W and b.
    pub linear: Linear,
    /// The output: gathered whole on every rank, or each rank its slice
    /// (for a [`RowParallelLinear`] after it).
    output: Features,
    in_features: usize,
}

impl ColumnParallelLinear {
    /// `in_features` → `out_features`, its parameters `weight` and `bias`
    /// in `store` (scope it: `store.pp("up")`): this rank's rows of the
    /// global weight and bias; its output as `cfg.features` says.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        in_features: usize,
        out_features: usize,
        cfg: LinearConfig,
    ) -> Result<Self> {
        let dims = (out_features, in_features);
        Self::build(ctx, store, dims, seeded(in_features, &cfg), cfg.features)
    }

    /// The layer from a user's whole weight (O, I) and bias (O), the same
    /// on every rank: rank r keeps rows O_r of both.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        weight: &Tensor,
        bias: Option<&Tensor>,
        output: Features,
    ) -> Result<Self> {
        let dims = given("ColumnParallelLinear::from_weights", weight, bias)?;
        Self::build(
            ctx,
            store,
            dims,
            WeightsFrom::Given { weight, bias },
            output,
        )
    }

    fn build(
        ctx: &Context,
        store: &ParamStore,
        (o, i): (usize, usize),
        src: WeightsFrom,
        output: Features,
    ) -> Result<Self> {
        let (n, r) = (ctx.size(), ctx.rank());
        let (w, b) = src.params(&[o, i]);
        let w = w.split(0, n, r).build(store)?;
        let b = b.map(|b| b.split(0, n, r).build(store)).transpose()?;
        Ok(ColumnParallelLinear {
            ctx: ctx.clone(),
            linear: Linear::new(w, b),
            output,
            in_features: i,
        })
    }

    /// The whole weight (O, I) and bias (O) and their gradients on rank
    /// `root` (every rank with `None`; `None` on the others). Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.ctx, self.linear.weight(), self.linear.bias(), root)
    }

    /// y (B, O) on every rank with a whole output, else this rank's
    /// features (B, O_r); `x` (B, I) the same on every rank (or (…, I),
    /// its leading dimensions as rows).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        features("ColumnParallelLinear", x, self.in_features)?;
        let y = self.linear.forward(&copy_to_shards(&self.ctx, x)?)?;
        if self.output == Features::Whole {
            allgather_replicated(&self.ctx, &y, y.rank() - 1)
        } else {
            Ok(y)
        }
    }
}

/// y = x Wᵀ + b with W's columns (input features) split over the ranks (see
/// the module doc).
#[derive(Clone)]
pub struct RowParallelLinear {
    ctx: Context,
    /// This rank's columns of W (no bias: it is added once, after the sum).
    pub linear: Linear,
    /// b, whole on every rank (if the layer has one).
    pub bias: Option<Param>,
    /// The input: already this rank's slice of the features (a
    /// [`ColumnParallelLinear`] with a sharded output before it), or whole,
    /// each rank taking its slice.
    input: Features,
    in_features: usize,
}

impl RowParallelLinear {
    /// `in_features` → `out_features`, its parameters `weight` and `bias`
    /// in `store` (scope it: `store.pp("down")`): this rank's columns of
    /// the global weight, and the whole bias; its input as `cfg.features`
    /// says.
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        in_features: usize,
        out_features: usize,
        cfg: LinearConfig,
    ) -> Result<Self> {
        let dims = (out_features, in_features);
        Self::build(ctx, store, dims, seeded(in_features, &cfg), cfg.features)
    }

    /// The layer from a user's whole weight (O, I) and bias (O), the same
    /// on every rank: rank r keeps columns I_r of the weight, and the whole
    /// bias.
    pub fn from_weights(
        ctx: &Context,
        store: &ParamStore,
        weight: &Tensor,
        bias: Option<&Tensor>,
        input: Features,
    ) -> Result<Self> {
        let dims = given("RowParallelLinear::from_weights", weight, bias)?;
        Self::build(ctx, store, dims, WeightsFrom::Given { weight, bias }, input)
    }

    fn build(
        ctx: &Context,
        store: &ParamStore,
        (o, i): (usize, usize),
        src: WeightsFrom,
        input: Features,
    ) -> Result<Self> {
        let (w, b) = src.params(&[o, i]);
        let w = w.split(1, ctx.size(), ctx.rank()).build(store)?;
        let bias = b.map(|b| b.build(store)).transpose()?;
        Ok(RowParallelLinear {
            ctx: ctx.clone(),
            linear: Linear::new(w, None),
            bias,
            input,
            in_features: i,
        })
    }

    /// The whole weight (O, I) and bias (O) and their gradients on rank
    /// `root` (every rank with `None`; `None` on the others). Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.ctx, self.linear.weight(), self.bias.as_ref(), root)
    }

    /// y (B, O) on every rank; `x` is (B, I_r) on a sharded input,
    /// else (B, I) the same on every rank (or (…, I_r), (…, I): the
    /// leading dimensions are rows).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.input == Features::Sharded {
            let mine = chunk_range(self.in_features, self.ctx.size(), self.ctx.rank()).len();
            features("RowParallelLinear (sharded input)", x, mine)?;
            x.clone()
        } else {
            features("RowParallelLinear", x, self.in_features)?;
            split_to_shards(&self.ctx, x, x.rank() - 1)?
        };
        let partial = self.linear.forward(&x)?;
        let y = allreduce_replicated(&self.ctx, &partial, ReduceOp::Sum)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(&b.tracked()?)?,
            None => y,
        })
    }
}

/// An embedding table E (V, D) with its rows (the vocabulary) split over the
/// ranks (see the module doc).
#[derive(Clone)]
pub struct VocabParallelEmbedding {
    ctx: Context,
    /// This rank's rows of E.
    pub weight: Param,
    /// This rank's first row (global index).
    pub offset: usize,
    vocab: usize,
}

impl VocabParallelEmbedding {
    /// `vocab` rows of `dim`, its table `weight` in `store` (scope it:
    /// `store.pp("embed")`), seeded as layer `layer`; values in ±1 (N(0, 1)
    /// is usual; the bound is the caller's to scale).
    pub fn new(
        ctx: &Context,
        store: &ParamStore,
        vocab: usize,
        dim: usize,
        layer: usize,
    ) -> Result<Self> {
        let init = Init::Uniform {
            layer,
            which: 0,
            bound: 1.0,
        };
        Self::with_init(ctx, store, vocab, dim, init)
    }

    /// [`Self::new`] with the table's values from `init` (a GPT's
    /// [`Init::std`]).
    pub fn with_init(
        ctx: &Context,
        store: &ParamStore,
        vocab: usize,
        dim: usize,
        init: Init,
    ) -> Result<Self> {
        Self::build(
            ctx,
            store,
            ShardedParam::new("weight", &[vocab, dim], init),
            vocab,
        )
    }

    /// The global row of this rank's first row and the table's rows:
    /// (offset, vocabulary).
    pub fn rows(&self) -> (usize, usize) {
        (self.offset, self.vocab)
    }

    /// The table from a user's whole E (V, D), the same on every rank:
    /// rank r keeps rows V_r.
    pub fn from_weights(ctx: &Context, store: &ParamStore, table: &Tensor) -> Result<Self> {
        let (vocab, dim) = given("VocabParallelEmbedding::from_weights", table, None)?;
        let p = ShardedParam::new("weight", &[vocab, dim], Init::Whole(table));
        Self::build(ctx, store, p, vocab)
    }

    fn build(ctx: &Context, store: &ParamStore, p: ShardedParam, vocab: usize) -> Result<Self> {
        let weight = p.split(0, ctx.size(), ctx.rank()).build(store)?;
        let offset = weight.shard().map_or(0, |s| s.offset);
        Ok(VocabParallelEmbedding {
            ctx: ctx.clone(),
            weight,
            offset,
            vocab,
        })
    }

    /// The whole table E (V, D) and its gradient on rank `root` (every
    /// rank with `None`; `None` on the others). Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.ctx, &self.weight, None, root)
    }

    /// The rows of `ids` (integer ids of any shape S, as candle-nn's
    /// `Embedding` takes), shaped S × D, on every rank.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let shape = ids.dims().to_vec();
        if ids.dtype().is_float() {
            return Err(Error::Usage(format!(
                "VocabParallelEmbedding: ids of dtype {:?}; give integer ids (u8, u32 or i64)",
                ids.dtype()
            )));
        }
        let flat = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        if let Some(bad) = flat.iter().find(|&&i| i < 0 || i as usize >= self.vocab) {
            return Err(Error::Usage(format!(
                "VocabParallelEmbedding: id {bad} is out of range for {} rows",
                self.vocab
            )));
        }
        let w = self.weight.tracked()?;
        let (rows, dim) = w.dims2()?;
        let device = w.device();
        let (local, keep): (Vec<u32>, Vec<f32>) = flat
            .iter()
            .map(|&i| {
                let i = i as usize;
                if i >= self.offset && i < self.offset + rows {
                    ((i - self.offset) as u32, 1.0)
                } else {
                    (0, 0.0)
                }
            })
            .unzip();
        let b = flat.len();
        let mine = if rows == 0 {
            // No rows here: zeros, the (empty) table still in the graph so
            // that its gradient arrives as on any other rank.
            crate::functions::zero_of(&w)?.broadcast_as((b, dim))?
        } else {
            let idx = Tensor::from_vec(local, b, device)?;
            let keep = Tensor::from_vec(keep, (b, 1), device)?;
            w.index_select(&idx, 0)?
                .broadcast_mul(&keep.to_dtype(w.dtype())?)?
        };
        let out: Vec<usize> = shape.iter().copied().chain([dim]).collect();
        Ok(allreduce_replicated(&self.ctx, &mine.contiguous()?, ReduceOp::Sum)?.reshape(out)?)
    }
}

crate::nn::candle_module!(
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding
);
