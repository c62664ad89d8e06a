//! Datasets: numbered examples that iterators read in batches.

use crate::comm::{chunk_sizes, Communicator};
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// A batch: features `x` (rows × features, f32) and labels `t` (rows, u32).
/// Both are `None` for an [`EmptyDataset`].
#[derive(Clone, Debug)]
pub struct Batch {
    /// Features, one row per example.
    pub x: Option<Tensor>,
    /// Class labels.
    pub t: Option<Tensor>,
    /// Number of examples.
    pub len: usize,
}

/// Numbered examples.
pub trait Dataset: Send + Sync {
    /// The number of examples.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The examples at `indices`, in that order.
    fn batch(&self, indices: &[usize]) -> Result<Batch>;
}

/// Features and labels held as tensors (rows are examples).
#[derive(Clone, Debug)]
pub struct TensorDataset {
    /// Features: examples × features, f32.
    pub x: Tensor,
    /// Labels: examples, u32.
    pub t: Tensor,
}

impl TensorDataset {
    /// Pair features and labels, which must have the same number of rows.
    pub fn new(x: Tensor, t: Tensor) -> Result<Self> {
        if x.dims().first() != t.dims().first() {
            return Err(Error::Usage(format!(
                "dataset: {:?} features but {:?} labels",
                x.dims(),
                t.dims()
            )));
        }
        Ok(TensorDataset { x, t })
    }

    /// The examples `start..start + len`.
    pub fn slice(&self, start: usize, len: usize) -> Result<Self> {
        Ok(TensorDataset {
            x: self.x.narrow(0, start, len)?,
            t: self.t.narrow(0, start, len)?,
        })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.t.dims()[0]
    }
    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let n = self.len();
        if let Some(bad) = indices.iter().find(|i| **i >= n) {
            return Err(Error::Usage(format!(
                "dataset: index {bad} out of range ({n} examples)"
            )));
        }
        let idx = Tensor::from_vec(
            indices.iter().map(|i| *i as u32).collect::<Vec<_>>(),
            indices.len(),
            &crate::comm::HOST,
        )?;
        Ok(Batch {
            x: Some(self.x.index_select(&idx, 0)?),
            t: Some(self.t.index_select(&idx, 0)?),
            len: indices.len(),
        })
    }
}

/// A dataset of `len` examples with no data (ChainerMN's empty dataset): a
/// rank whose model receives its input from another rank iterates it to take
/// part in the same number of steps.
#[derive(Clone, Copy, Debug)]
pub struct EmptyDataset {
    len: usize,
}

impl EmptyDataset {
    /// `len` examples with no data (for a rank that knows only the length).
    pub fn new(len: usize) -> Self {
        EmptyDataset { len }
    }
}

impl Dataset for EmptyDataset {
    fn len(&self) -> usize {
        self.len
    }
    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        Ok(Batch {
            x: None,
            t: None,
            len: indices.len(),
        })
    }
}

/// A dataset as long as `ds`, with no data.
pub fn create_empty_dataset(ds: &dyn Dataset) -> EmptyDataset {
    EmptyDataset { len: ds.len() }
}

/// Data parallelism: the root's dataset cut into one contiguous shard per
/// rank (sizes from [`chunk_sizes`], shuffled first when `shuffle_seed` is
/// given), sent to each rank. With `equal_length` every shard has
/// `ceil(n / size)` examples, the short ones padded by repeating their
/// first examples, so that every rank runs the same number of steps.
/// Other ranks pass `None`.
pub fn scatter_dataset(
    comm: &Communicator,
    ds: Option<&TensorDataset>,
    root: usize,
    shuffle_seed: Option<u64>,
    equal_length: bool,
) -> Result<TensorDataset> {
    let parts = match (comm.rank() == root, ds) {
        (true, Some(ds)) => {
            let n = ds.len();
            let mut order: Vec<usize> = (0..n).collect();
            if let Some(seed) = shuffle_seed {
                crate::rng::shuffle(&mut order, seed);
            }
            let sizes = chunk_sizes(n, comm.size());
            let longest = sizes.iter().copied().max().unwrap_or(0);
            let mut at = 0;
            let mut xs = Vec::new();
            let mut ts = Vec::new();
            for k in sizes {
                let mut idx: Vec<usize> = order[at..at + k].to_vec();
                at += k;
                if equal_length && k > 0 {
                    let pad: Vec<usize> = idx.iter().cycle().take(longest - k).copied().collect();
                    idx.extend(pad);
                }
                let b = ds.batch(&idx)?;
                xs.push(b.x.ok_or_else(|| Error::Usage("scatter_dataset: no data".into()))?);
                ts.push(b.t.ok_or_else(|| Error::Usage("scatter_dataset: no data".into()))?);
            }
            Some((xs, ts))
        }
        (true, None) => {
            return Err(Error::Usage(format!(
                "scatter_dataset: rank {root} is the root and must pass the dataset"
            )))
        }
        _ => None,
    };
    let x = comm.scatter(parts.as_ref().map(|p| p.0.as_slice()), root)?;
    let t = comm.scatter(parts.as_ref().map(|p| p.1.as_slice()), root)?;
    TensorDataset::new(x, t.to_dtype(DType::U32)?)
}
