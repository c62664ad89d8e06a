//! Layers and containers built from differentiable communication.
//!
//! - [`MultiNodeChainList`]: seed 001's container; components on this rank,
//!   wired to other ranks by `rank_in` / `rank_out`.

mod multi_node_chain_list;

pub use multi_node_chain_list::{ChainLink, ChainOutput, MultiNodeChainList};
