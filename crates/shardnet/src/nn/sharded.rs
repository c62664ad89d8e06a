//! One parameter of a parallel layer, described once ([`ShardedParam`]):
//! its name under the store's prefix, its global shape, the dimension the
//! ranks split (or none: whole on every rank) and where its values come
//! from. Every parallel layer builds its parameters with it, so a
//! parameter's placement ([`Shard`]), name and values are made one way.

use super::init;
use super::param::{Param, Shard};
use super::store::ParamStore;
use crate::{Error, Result};
use candle_core::Tensor;
use std::ops::Range;

/// Where a sharded parameter's values come from.
#[derive(Clone, Copy, Debug)]
pub enum Init<'a> {
    /// Uniform in ±`bound`, drawn from the store's seed for (`layer`,
    /// `which`: 0 the weight, 1 the bias) over the global tensor, so that
    /// every split of it over any number of ranks holds the same values
    /// ([`init::uniform_block`]).
    Uniform {
        /// The layer's index in its model (its seed).
        layer: usize,
        /// Which of the layer's tensors: 0 the weight, 1 the bias.
        which: u64,
        /// The bound: 1/√fan_in for the usual linear and convolution
        /// layers.
        bound: f64,
    },
    /// A user's whole tensor, the same on every rank: each rank keeps its
    /// part.
    Whole(&'a Tensor),
    /// Every element `value` (f32): batch norm's γ = 1 and β = 0.
    Constant(f64),
}

impl Init<'_> {
    /// [`Init::Uniform`] of standard deviation `std` (the bound √3·std) for
    /// (`layer`, 0): GPT-2's N(0, std) initialisation with a uniform draw.
    pub fn std(layer: usize, std: f64) -> Init<'static> {
        Init::Uniform {
            layer,
            which: 0,
            bound: 3f64.sqrt() * std,
        }
    }

    /// [`Init::Uniform`] with the bound of a layer whose fan-in is
    /// `fan_in`: 1/√fan_in (PyTorch's `Linear` and `Conv2d` default).
    pub fn fan_in(layer: usize, which: u64, fan_in: usize) -> Init<'static> {
        Init::Uniform {
            layer,
            which,
            bound: 1.0 / (fan_in.max(1) as f64).sqrt(),
        }
    }
}

/// A parameter of global shape `shape`, split along one dimension over the
/// ranks (balanced: [`Shard::balanced`]) or whole on every rank.
///
/// ```
/// use shardnet::nn::{Init, ParamStore, ShardedParam};
/// # use candle_core::Device;
/// let store = ParamStore::new(&Device::Cpu, 7).pp("up");
/// // Rank 1 of 3: rows 4..7 of a (10, 5) weight.
/// let w = ShardedParam::new("weight", &[10, 5], Init::fan_in(0, 0, 5))
///     .split(0, 3, 1)
///     .build(&store)?;
/// assert_eq!(w.name(), "up.weight");
/// assert_eq!(w.value().dims(), &[3, 5]);
/// # Ok::<(), shardnet::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ShardedParam<'a> {
    name: &'a str,
    shape: Vec<usize>,
    init: Init<'a>,
    /// (dim, this rank's range along it, the ranks): None for whole.
    split: Option<(usize, Range<usize>)>,
}

impl<'a> ShardedParam<'a> {
    /// Parameter `name` (under the store's prefix) of global `shape`,
    /// whole on every rank until [`Self::split`].
    pub fn new(name: &'a str, shape: &[usize], init: Init<'a>) -> Self {
        ShardedParam {
            name,
            shape: shape.to_vec(),
            init,
            split: None,
        }
    }

    /// Split along `dim` over `ranks`: rank `rank` keeps its balanced
    /// chunk ([`crate::comm::chunk_range`]).
    pub fn split(self, dim: usize, ranks: usize, rank: usize) -> Self {
        let global = self.shape.get(dim).copied().unwrap_or(0);
        let own = crate::comm::chunk_range(global, ranks.max(1), rank);
        self.split_at(dim, own)
    }

    /// Split along `dim`, this rank keeping `own` (global indices).
    pub fn split_at(mut self, dim: usize, own: Range<usize>) -> Self {
        self.split = Some((dim, own));
        self
    }

    /// This rank's part: registered in `store` as `name` with its
    /// [`Shard`] (none when whole), its values from the [`Init`].
    pub fn build(self, store: &ParamStore) -> Result<Param> {
        // A value given to the store by name: no initialiser to run.
        let value = match store.preset(self.name) {
            Some(v) => v,
            None => self.value(store)?,
        };
        let shard = self
            .split
            .as_ref()
            .map(|(d, r)| Shard::along(*d, r, self.shape[*d]));
        store.add(self.name, &value, shard)
    }

    /// This rank's part's values, not registered (for a layer that keeps
    /// a selection of them under a name of its own).
    pub fn value(&self, store: &ParamStore) -> Result<Tensor> {
        let what = || format!("parameter {:?} of shape {:?}", self.name, self.shape);
        let (dim, own) = match &self.split {
            Some((d, r)) => (*d, r.clone()),
            None => (0, 0..self.shape.first().copied().unwrap_or(1)),
        };
        if self.shape.is_empty() || dim >= self.shape.len() || own.end > self.shape[dim] {
            return Err(Error::Usage(format!(
                "{}: split along {dim} at {own:?} does not fit",
                what()
            )));
        }
        let mut part = self.shape.clone();
        part[dim] = own.len();
        Ok(match self.init {
            Init::Whole(t) => {
                if t.dims() != self.shape.as_slice() {
                    return Err(Error::Usage(format!(
                        "{}: the whole tensor given has shape {:?}",
                        what(),
                        t.dims()
                    )));
                }
                t.narrow(dim, own.start, own.len())?.contiguous()?
            }
            Init::Constant(v) => Tensor::full(v as f32, part.as_slice(), store.device())?,
            Init::Uniform {
                layer,
                which,
                bound,
            } => {
                // The global tensor seen as (shape[0], the rest); a split
                // along dim 1 is a contiguous run of columns of it.
                let seed = init::layer_seed(store.seed(), layer, which);
                let rows = self.shape[0];
                let cols: usize = self.shape[1..].iter().product();
                let inner: usize = self.shape.get(2..).map_or(1, |d| d.iter().product());
                let (r, c) = match dim {
                    0 => (own.clone(), 0..cols),
                    1 => (0..rows, own.start * inner..own.end * inner),
                    _ => {
                        return Err(Error::Usage(format!(
                            "{}: a seeded parameter splits along dimension 0 or 1, not {dim}",
                            what()
                        )))
                    }
                };
                init::uniform_block(seed, r, c, cols.max(1), bound, store.device())?
                    .reshape(part.as_slice())?
            }
        })
    }
}

/// Where a layer's weight and bias come from: seeded from the store (the
/// layer's index, the fan-in of the bound 1/√fan_in, with a bias or not),
/// or a user's whole tensors, the same on every rank.
#[derive(Clone, Copy, Debug)]
pub enum WeightsFrom<'a> {
    /// [`Init::fan_in`] for (`layer`, 0) the weight and (`layer`, 1) the
    /// bias.
    Seeded {
        /// The layer's index in its model (its seed).
        layer: usize,
        /// The fan-in of the bound.
        fan_in: usize,
        /// Whether the layer has a bias.
        bias: bool,
    },
    /// GPT-2's initialisation with a uniform draw: the weight of standard
    /// deviation `std` (uniform in ±√3·std, from (`layer`, 0)), the bias 0.
    Std {
        /// The layer's index in its model (its seed).
        layer: usize,
        /// The weight's standard deviation.
        std: f64,
        /// Whether the layer has a bias.
        bias: bool,
    },
    /// [`Init::Whole`]: the user's weight and bias.
    Given {
        /// The whole weight.
        weight: &'a Tensor,
        /// The whole bias, if any.
        bias: Option<&'a Tensor>,
    },
}

impl<'a> WeightsFrom<'a> {
    /// The layer's `weight` of global `shape` and its `bias` of
    /// `shape[0]`, whole until the layer splits them its way.
    pub fn params(self, shape: &[usize]) -> (ShardedParam<'a>, Option<ShardedParam<'a>>) {
        let rows = shape.first().copied().unwrap_or(0);
        match self {
            WeightsFrom::Seeded {
                layer,
                fan_in,
                bias,
            } => (
                ShardedParam::new("weight", shape, Init::fan_in(layer, 0, fan_in)),
                bias.then(|| ShardedParam::new("bias", &[rows], Init::fan_in(layer, 1, fan_in))),
            ),
            WeightsFrom::Std { layer, std, bias } => (
                ShardedParam::new("weight", shape, Init::std(layer, std)),
                bias.then(|| ShardedParam::new("bias", &[rows], Init::Constant(0.0))),
            ),
            WeightsFrom::Given { weight, bias } => (
                ShardedParam::new("weight", shape, Init::Whole(weight)),
                bias.map(|b| ShardedParam::new("bias", &[rows], Init::Whole(b))),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn store() -> ParamStore {
        ParamStore::new(&Device::Cpu, 11)
    }

    /// Every split of a seeded parameter, along either dimension and over
    /// 1–5 ranks (uneven, some ranks with nothing), joins into the whole:
    /// the values do not depend on the split.
    #[test]
    fn seeded_splits_join_into_the_whole() {
        for shape in [vec![7usize, 5], vec![3, 4, 2, 3], vec![6]] {
            let init = Init::fan_in(2, 0, 5);
            let whole = ShardedParam::new("w", &shape, init)
                .value(&store())
                .unwrap();
            for dim in 0..shape.len().min(2) {
                for ranks in 1..=5 {
                    let parts: Vec<Tensor> = (0..ranks)
                        .map(|r| {
                            ShardedParam::new("w", &shape, init)
                                .split(dim, ranks, r)
                                .value(&store())
                                .unwrap()
                        })
                        .collect();
                    let joined = Tensor::cat(&parts, dim).unwrap();
                    let same = joined.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                        == whole.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    assert!(same, "{shape:?} split along {dim} over {ranks}");
                }
            }
        }
    }

    /// A part is registered with its placement, and a given whole tensor
    /// is narrowed to it.
    #[test]
    fn a_part_keeps_its_shard_and_a_given_tensor_is_narrowed() {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        let p = ShardedParam::new("w", &[4, 3], Init::Whole(&t))
            .split(0, 3, 0)
            .build(&store().pp("fc"))
            .unwrap();
        assert_eq!(p.name(), "fc.w");
        assert_eq!(
            p.shard(),
            Some(Shard {
                dim: 0,
                offset: 0,
                global: 4
            })
        );
        assert_eq!(
            p.value().to_vec2::<f32>().unwrap(),
            vec![vec![0., 1., 2.], vec![3., 4., 5.]]
        );
        let c = ShardedParam::new("b", &[5], Init::Constant(1.0))
            .build(&store())
            .unwrap();
        assert_eq!(
            (c.shard(), c.value().to_vec1::<f32>().unwrap()),
            (None, vec![1.0; 5])
        );
    }

    /// What cannot be built is an error naming the parameter.
    #[test]
    fn bad_descriptions_are_refused() {
        let t = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let cases = [
            ShardedParam::new("a", &[4, 3], Init::Whole(&t)),
            ShardedParam::new("b", &[4, 3], Init::fan_in(0, 0, 3)).split_at(0, 2..6),
            ShardedParam::new("c", &[4, 3], Init::fan_in(0, 0, 3)).split_at(2, 0..1),
            ShardedParam::new("d", &[2, 2, 2], Init::fan_in(0, 0, 3)).split(2, 2, 0),
            ShardedParam::new("e", &[], Init::Constant(0.0)),
        ];
        for (p, name) in cases.into_iter().zip(["a", "b", "c", "d", "e"]) {
            let e = p
                .build(&store())
                .err()
                .unwrap_or_else(|| panic!("{name} built"));
            assert!(
                e.to_string().contains(&format!("\"{name}\"")),
                "{name}: {e}"
            );
        }
    }
}
