//! Feeding ranks: datasets, loaders and iterators.
//!
//! - [`Dataset`]: what an iterator reads; [`TensorDataset`] (features and
//!   labels as tensors) and the [`create_empty_dataset`] of ChainerMN (the
//!   same length and no data, for ranks that receive their input from a
//!   peer).
//! - [`mnist`] / [`fashion_mnist`]: the real datasets, from idx files
//!   ([`read_idx`], [`parse_idx`], [`mnist_from_idx`]).
//! - [`cifar10`]: CIFAR-10 from its binary files, normalised per channel
//!   ([`parse_cifar_batch`]).
//! - [`Identities`]: seeded synthetic identities (`face-head`);
//!   [`synthetic_images`]: seeded, learnable images for benchmarks;
//!   [`pad_images`]: zero borders (MNIST's 28×28 to 32×32).
//! - [`Text`]: a corpus (Debian's fortunes by default) split into
//!   training and validation; [`Tokenizer`]: bytes, or a BPE learned from
//!   the training text; [`Corpus`]: the text as tokens; [`TextWindows`]:
//!   its windows of T + 1 tokens, for a language model.
//! - [`scatter_dataset`]: data parallelism, each rank a shard.
//! - [`SerialIterator`], [`synchronized_iterator`], [`MultiNodeIterator`].

mod cifar;
mod dataset;
mod identities;
mod images;
mod iterator;
mod mnist;
mod text;
mod tokenizer;

pub use cifar::{
    cifar10, parse_cifar_batch, CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_SHAPE, CIFAR10_STD,
};
pub use dataset::{
    create_empty_dataset, scatter_dataset, Batch, Dataset, EmptyDataset, TensorDataset,
};
pub use identities::Identities;
pub use images::{pad_images, synthetic_images};
pub use iterator::{synchronized_iterator, MultiNodeIterator, SerialIterator};
pub use mnist::{fashion_mnist, mnist, mnist_dir, mnist_from_idx, parse_idx, read_idx};
pub use text::{Corpus, Text, TextWindows, BYTE_VOCAB, FORTUNES};
pub use tokenizer::{Tokenizer, TOKENIZER_FILE};
