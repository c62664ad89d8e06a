//! Feeding ranks: datasets, loaders and iterators.
//!
//! - [`Dataset`]: what an iterator reads; [`TensorDataset`] (features and
//!   labels as tensors) and the [`create_empty_dataset`] of ChainerMN (the
//!   same length and no data, for ranks that receive their input from a
//!   peer).
//! - [`mnist`] / [`fashion_mnist`]: the real datasets, from idx files.
//! - [`scatter_dataset`]: data parallelism, each rank a shard.
//! - [`SerialIterator`], [`synchronized_iterator`], [`MultiNodeIterator`].

mod dataset;
mod iterator;
mod mnist;

pub use dataset::{
    create_empty_dataset, scatter_dataset, Batch, Dataset, EmptyDataset, TensorDataset,
};
pub(crate) use iterator::splitmix64;
pub use iterator::{synchronized_iterator, MultiNodeIterator, SerialIterator};
pub use mnist::{fashion_mnist, mnist, mnist_dir, read_idx};
