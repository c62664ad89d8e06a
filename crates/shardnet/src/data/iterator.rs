//! Iterators: which examples form each batch, on each rank.
//!
//! - [`SerialIterator`]: batches in order or shuffled by a seed, epoch after
//!   epoch; the last batch of an epoch may be short.
//! - [`synchronized_iterator`]: the root's seed broadcast once, so every rank
//!   draws the same shuffle (model parallelism where every rank reads its own
//!   copy of the data).
//! - [`MultiNodeIterator`]: one rank reads, every batch is broadcast to the
//!   others (ranks that need the same batch but have no data).

use super::dataset::{Batch, Dataset};
use crate::comm::Communicator;
use crate::rng::shuffle;
use crate::{Error, Result};

/// Batches of indices over `len` examples, epoch after epoch.
#[derive(Clone, Debug)]
pub struct SerialIterator {
    len: usize,
    batch_size: usize,
    seed: Option<u64>,
    order: Vec<usize>,
    position: usize,
    epoch: usize,
}

impl SerialIterator {
    /// Batches of `batch_size` over `len` examples; shuffled each epoch when
    /// `seed` is given (epoch e uses seed + e).
    pub fn new(len: usize, batch_size: usize, seed: Option<u64>) -> Result<Self> {
        if batch_size == 0 || len == 0 {
            return Err(Error::Usage(format!(
                "iterator: needs examples and a batch size (got {len} examples, batch size {batch_size})"
            )));
        }
        if batch_size > len {
            return Err(Error::Usage(format!(
                "--batch-size {batch_size}: more than the {len} training examples; give at most \
                 {len}"
            )));
        }
        let mut it = SerialIterator {
            len,
            batch_size,
            seed,
            order: Vec::new(),
            position: 0,
            epoch: 0,
        };
        it.reorder();
        Ok(it)
    }

    fn reorder(&mut self) {
        self.order = (0..self.len).collect();
        if let Some(s) = self.seed {
            shuffle(&mut self.order, s.wrapping_add(self.epoch as u64));
        }
    }

    /// Completed epochs.
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    /// Where it stands: (completed epochs, examples of this epoch already
    /// taken). The shuffle follows from the seed and the epoch, so this is
    /// all a checkpoint needs.
    pub fn position(&self) -> (usize, usize) {
        (self.epoch, self.position)
    }

    /// Continue from `position` (a checkpoint's [`SerialIterator::position`]).
    pub fn set_position(&mut self, (epoch, position): (usize, usize)) -> Result<()> {
        if position >= self.len {
            return Err(Error::Usage(format!(
                "iterator position {position} is beyond the {} examples of an epoch",
                self.len
            )));
        }
        self.epoch = epoch;
        self.position = position;
        self.reorder();
        Ok(())
    }

    /// Batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.len.div_ceil(self.batch_size)
    }

    /// The next batch's indices; an epoch ends with its last (maybe short) batch.
    pub fn next_indices(&mut self) -> Vec<usize> {
        let end = (self.position + self.batch_size).min(self.len);
        let idx = self.order[self.position..end].to_vec();
        self.position = end;
        if self.position == self.len {
            self.position = 0;
            self.epoch += 1;
            self.reorder();
        }
        idx
    }

    /// The next batch of `ds`.
    pub fn next_batch(&mut self, ds: &dyn Dataset) -> Result<Batch> {
        if ds.len() != self.len {
            return Err(Error::Usage(format!(
                "iterator over {} examples used with a dataset of {}",
                self.len,
                ds.len()
            )));
        }
        ds.batch(&self.next_indices())
    }
}

/// A [`SerialIterator`] whose shuffle seed is rank 0's `seed`, broadcast:
/// every rank draws the same batches. Collective.
pub fn synchronized_iterator(
    comm: &Communicator,
    len: usize,
    batch_size: usize,
    seed: u64,
) -> Result<SerialIterator> {
    let seed = comm.bcast_obj(Some(&seed), 0)?;
    SerialIterator::new(len, batch_size, Some(seed))
}

/// One rank (the root) reads; each batch is broadcast to every rank.
pub struct MultiNodeIterator {
    comm: Communicator,
    root: usize,
    inner: Option<SerialIterator>,
}

impl MultiNodeIterator {
    /// On the root, `inner` iterates the dataset; other ranks pass `None`.
    pub fn new(comm: &Communicator, root: usize, inner: Option<SerialIterator>) -> Result<Self> {
        if (comm.rank() == root) != inner.is_some() {
            return Err(Error::Usage(format!(
                "MultiNodeIterator: the root (rank {root}) and only the root passes an iterator"
            )));
        }
        Ok(MultiNodeIterator {
            comm: comm.clone(),
            root,
            inner,
        })
    }

    /// The next batch on every rank (the root reads `ds`; others pass `None`).
    /// Collective.
    pub fn next_batch(&mut self, ds: Option<&dyn Dataset>) -> Result<Batch> {
        let mine = match (&mut self.inner, ds) {
            (Some(it), Some(ds)) => Some(it.next_batch(ds)?),
            (Some(_), None) => {
                return Err(Error::Usage(
                    "MultiNodeIterator: the root must pass its dataset".into(),
                ))
            }
            _ => None,
        };
        let pick = |f: fn(&Batch) -> Option<&candle_core::Tensor>| -> Result<_> {
            mine.as_ref()
                .map(|b| {
                    f(b).ok_or_else(|| {
                        Error::Usage("MultiNodeIterator: the root's dataset has no data".into())
                    })
                })
                .transpose()
        };
        let x = self.comm.bcast(pick(|b| b.x.as_ref())?, self.root)?;
        let t = self.comm.bcast(pick(|b| b.t.as_ref())?, self.root)?;
        let len = t.dims()[0];
        Ok(Batch {
            x: Some(x),
            t: Some(t),
            len,
        })
    }

    /// Completed epochs (broadcast from the root). Collective.
    pub fn epoch(&self) -> Result<usize> {
        self.comm
            .bcast_obj(self.inner.as_ref().map(|i| i.epoch()).as_ref(), self.root)
    }
}
