//! MNIST or Fashion-MNIST for the MLPs whose input enters on rank 0
//! (`mnist-mlp`, `mnist-mlp-parallel`): which set ([`Digits`]) and the data
//! read on rank 0 only, the other ranks iterating an empty dataset in step.

use crate::comm::Communicator;
use crate::data::{
    fashion_mnist, mnist, synchronized_iterator, Dataset, EmptyDataset, SerialIterator,
    TensorDataset,
};
use crate::{Error, Result};

/// The datasets this model trains on (same shapes, 10 classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Digits {
    /// MNIST handwritten digits.
    Mnist,
    /// Fashion-MNIST (Debian's `dataset-fashion-mnist`, or `--data DIR`).
    FashionMnist,
}

impl std::str::FromStr for Digits {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mnist" => Ok(Digits::Mnist),
            "fashion-mnist" => Ok(Digits::FashionMnist),
            other => Err(Error::Usage(format!(
                "unknown dataset '{other}' (use mnist or fashion-mnist)"
            ))),
        }
    }
}

/// MNIST or Fashion-MNIST read on rank 0 only: the other ranks learn its
/// sizes and iterate an empty dataset of the same length, in step (the
/// same shuffle). Shared by the MLPs whose input enters on rank 0.
pub(crate) struct RankZeroData {
    /// Rank 0's (train, test) sets; `None` elsewhere.
    data: Option<(TensorDataset, TensorDataset)>,
    /// What the other ranks iterate: as many examples, no data.
    empty: EmptyDataset,
    /// Examples in the training set (on every rank).
    pub train_len: usize,
    /// Examples in the test set (on every rank).
    pub test_len: usize,
}

impl RankZeroData {
    /// Read `dataset` from `dir` on rank 0; every rank gets the iterator
    /// over batches of `batch` examples shuffled by `seed`. Collective.
    pub fn read(
        comm: &Communicator,
        dataset: Digits,
        dir: Option<&std::path::Path>,
        batch: usize,
        seed: u64,
    ) -> Result<(Self, SerialIterator)> {
        let data = match (comm.rank(), dataset) {
            (0, Digits::Mnist) => Some(mnist(dir)?),
            (0, Digits::FashionMnist) => Some(fashion_mnist(dir)?),
            _ => None,
        };
        let sizes = comm.bcast_obj(
            data.as_ref().map(|(tr, te)| (tr.len(), te.len())).as_ref(),
            0,
        )?;
        let it = synchronized_iterator(comm, sizes.0, batch, seed)?;
        let data = RankZeroData {
            data,
            empty: EmptyDataset::new(sizes.0),
            train_len: sizes.0,
            test_len: sizes.1,
        };
        Ok((data, it))
    }

    /// The next training batch from `it` (examples on rank 0, only the
    /// length elsewhere).
    pub fn next_batch(&self, it: &mut SerialIterator) -> Result<crate::data::Batch> {
        let train: &dyn Dataset = match &self.data {
            Some((tr, _)) => tr,
            None => &self.empty,
        };
        it.next_batch(train)
    }

    /// Rank 0's test set.
    pub fn test(&self) -> Option<&TensorDataset> {
        self.data.as_ref().map(|(_, te)| te)
    }
}
