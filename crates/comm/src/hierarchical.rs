//! ChainerMN's `hierarchical` communicator: the gradient allreduce in two
//! levels, a fast one inside each node and MPI between nodes.
//!
//! | op | how | bytes each rank moves |
//! |----|-----|-----------------------|
//! | allreduce | reduce to the node's first rank (NCCL on GPUs), allreduce among the nodes' first ranks (the world's backend: MPI), broadcast in the node | in-node: b up, b down; between nodes: 2b(m−1)/m on m nodes' first ranks only |
//! | everything else | the world's backend (local or MPI), through host memory | as that backend |
//!
//! As in ChainerMN, only the allreduce (what `allreduce_grads` and the
//! multi-node batch norm call) takes the two levels; a model's other
//! communication goes through the world's backend. The in-node communicator
//! is NCCL when the rank computes on a GPU and shardnet has the `nccl`
//! feature, the world's backend split by node otherwise (what the CPU tests
//! run: [`Communicator::hierarchical_on`] with nodes made up). Nodes are
//! found by host name unless given. The allreduce first exchanges a header
//! over the whole world, so a mismatch is reported on every node.
//!
//! Sums are taken in a different order than the flat backends' rank-order
//! fold (in the node first, then across nodes), so a float allreduce can
//! differ from theirs in its last bits.

use super::desc::{Desc, Kind};
use super::{Backend, Communicator, ReduceOp, HOST};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

impl Communicator {
    /// ChainerMN's `hierarchical` communicator over these ranks: its
    /// allreduce reduces inside each node (NCCL when the ranks compute on
    /// GPUs and shardnet has the `nccl` feature), allreduces among the
    /// nodes' first ranks over this communicator's backend (MPI), and
    /// broadcasts in the node; every other operation is this communicator's.
    /// Ranks are on one node when their host names agree. Collective.
    pub fn hierarchical(&self) -> Result<Communicator> {
        let node = self.node_index()?;
        self.hierarchical_on(node)
    }

    /// [`hierarchical`](Self::hierarchical) with this rank's node given:
    /// ranks passing the same `node` are one node (to try the two levels on
    /// one machine, or where host names do not tell nodes apart). Collective.
    pub fn hierarchical_on(&self, node: u32) -> Result<Communicator> {
        let backend = Hierarchical::new(self, node)?;
        Ok(Communicator {
            inner: Arc::new(backend),
            device: self.device.clone(),
            received: self.received.clone(),
        })
    }

    /// The index of this rank's host among the ranks' distinct host names,
    /// in the order of their first rank. Collective.
    fn node_index(&self) -> Result<u32> {
        const LEN: usize = 256;
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_default();
        let mut bytes = name.into_bytes();
        bytes.resize(LEN, 0);
        let all = self
            .allgather(&Tensor::from_vec(bytes, (1, LEN), &HOST)?)?
            .to_vec2::<u8>()?;
        let mut seen: Vec<&Vec<u8>> = Vec::new();
        for n in &all {
            if !seen.contains(&n) {
                seen.push(n);
            }
        }
        let mine = &all[self.rank()];
        Ok(seen.iter().position(|n| *n == mine).unwrap_or(0) as u32)
    }
}

/// The two-level backend over `world`'s ranks.
pub(crate) struct Hierarchical {
    /// The flat world communicator (local or MPI): agreement and every
    /// operation but allreduce.
    world: Communicator,
    /// The ranks of this rank's node (NCCL on GPUs).
    intra: Communicator,
    /// The first ranks of all nodes, on the node's first rank only.
    inter: Option<Communicator>,
    /// Where tensors live: the rank's device.
    device: Device,
}

impl Hierarchical {
    /// Collective over `world`: this rank's node is `node` (any number the
    /// ranks of one node share).
    pub(crate) fn new(world: &Communicator, node: u32) -> Result<Self> {
        let rank = world.rank() as i64;
        let host = world.split(Some(node), rank)?.ok_or_else(|| {
            Error::Usage("hierarchical: the node split returned no communicator".into())
        })?;
        // Each sub-communicator counts its own bytes: the outer one counts
        // what the caller asked for, once.
        let host = host.fresh_counter();
        let intra = in_node(&host)?;
        let first = intra.rank() == 0;
        let inter = world
            .split(first.then_some(0), i64::from(node))?
            .map(|c| c.fresh_counter());
        Ok(Hierarchical {
            world: world.fresh_counter(),
            intra,
            inter,
            device: world.device().clone(),
        })
    }

    /// Every rank says what it is doing (one header each over the world's
    /// backend) and runs the same check, so a mismatch is reported on every
    /// rank of every node, not only inside one node.
    fn agree(&self, desc: Desc) -> Result<()> {
        self.world.agree_desc(desc).map(|_| ())
    }
}

/// The in-node communicator: NCCL over the node's ranks when they compute
/// on GPUs (feature `nccl`), the host backend itself otherwise.
fn in_node(host: &Communicator) -> Result<Communicator> {
    #[cfg(feature = "nccl")]
    if host.device().is_cuda() {
        return host.nccl();
    }
    Ok(host.clone())
}

impl Backend for Hierarchical {
    fn name(&self) -> &'static str {
        "hierarchical"
    }
    fn rank(&self) -> usize {
        self.world.rank()
    }
    fn size(&self) -> usize {
        self.world.size()
    }
    fn intra_rank(&self) -> usize {
        self.intra.rank()
    }
    fn intra_size(&self) -> usize {
        self.intra.size()
    }
    fn world_ranks(&self) -> Vec<usize> {
        self.world.world_ranks()
    }
    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.world.send(t, dst)
    }
    fn recv(&self, src: usize) -> Result<Tensor> {
        self.world.recv(src)
    }
    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor> {
        self.world.bcast(t, root)
    }
    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        self.world.gather(t, root)
    }
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        self.world.scatter(ts, root)
    }
    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        self.world.allgather_counts(t)
    }
    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>> {
        self.world.alltoall(ts)
    }
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.agree(Desc::new(Kind::Allreduce).reduce(op).tensor(t))?;
        // A mean is a sum over every rank, divided once at the end.
        let level = if op == ReduceOp::Mean {
            ReduceOp::Sum
        } else {
            op
        };
        let in_node = self.intra.reduce(t, level, 0)?;
        let across = match (&self.inter, in_node) {
            (Some(inter), Some(s)) => Some(inter.allreduce(&s, level)?),
            (None, None) => None,
            _ => {
                return Err(Error::Usage(
                    "hierarchical: a node's first rank has no link to the other nodes".into(),
                ))
            }
        };
        let y = self.intra.bcast(across.as_ref(), 0)?;
        if op == ReduceOp::Mean {
            let n = self.size() as f64;
            return Ok(match y.dtype() {
                DType::F16 | DType::BF16 => (y.to_dtype(DType::F32)? / n)?.to_dtype(y.dtype())?,
                _ => (y / n)?,
            });
        }
        Ok(y)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.world.reduce_scatter(t, op)
    }
    fn barrier(&self) -> Result<()> {
        self.world.barrier()
    }
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>> {
        // A part of the ranks is one flat communicator of the world's backend.
        Ok(self.world.split(color, key)?.map(|c| c.inner))
    }
    fn home(&self) -> Option<Device> {
        Some(self.device.clone())
    }
}
