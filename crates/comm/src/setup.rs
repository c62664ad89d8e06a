//! Where each rank computes (`--device`) and which communicator joins the
//! ranks (`--communicator`): checked before any rank starts, applied on
//! every rank as it starts.
//!
//! | `--device` | rank r computes on | needs |
//! |------------|--------------------|-------|
//! | `cpu` | the host's CPU | — |
//! | `cuda` | `cuda:<intra_rank>`: its index among the ranks of its node, as ChainerMN's model-parallel MLP picks its GPU | feature `cuda`, a GPU per rank on each node |
//!
//! | `--communicator` | collectives | needs |
//! |------------------|-------------|-------|
//! | `host` | the local or MPI backend itself; GPU tensors travel through host memory | — |
//! | `nccl` | NCCL on the GPUs (ChainerMN's `pure_nccl`); send/recv through the host backend | feature `nccl`, `--device cuda` |
//! | `hierarchical` | allreduce: NCCL in the node, the host backend (MPI) across nodes, broadcast in the node; the rest through the host backend (ChainerMN's `hierarchical`) | `--device cuda` with feature `nccl` for NCCL in the node; on the CPU the node level is the host backend too |

use super::Communicator;
use crate::{Error, Result};
use candle_core::Device;

/// Where a rank computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// The host's CPU (the default).
    #[default]
    Cpu,
    /// The GPU `cuda:<intra_rank>`.
    Cuda,
}

/// The communicator the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CommKind {
    /// The launch's own backend (local threads or MPI processes).
    #[default]
    Host,
    /// NCCL, one rank per GPU.
    Nccl,
    /// NCCL inside a node, the host backend between nodes.
    Hierarchical,
}

/// A rank's device and communicator, from `--device` and `--communicator`.
///
/// ```
/// use shardnet_comm::{launch, Setup};
/// let setup = Setup::new("cpu", "hierarchical")?;
/// let sums = launch(2, |comm| {
///     let comm = setup.apply(comm)?;
///     let x = candle_core::Tensor::new(&[1f32, 2.0], comm.device())?;
///     Ok(comm.allreduce(&x, shardnet_comm::ReduceOp::Sum)?.to_vec1::<f32>()?)
/// })?;
/// assert_eq!(sums, vec![vec![2.0, 4.0]; 2]);
/// # Ok::<(), shardnet_comm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Setup {
    /// Where each rank computes.
    pub device: DeviceKind,
    /// Which communicator joins them.
    pub communicator: CommKind,
}

impl Setup {
    /// Parse and check the two flags' values against what this build has:
    /// an error says which feature is missing and how to build it.
    pub fn new(device: &str, communicator: &str) -> Result<Setup> {
        let device = match device {
            "cpu" => DeviceKind::Cpu,
            "cuda" if cfg!(feature = "cuda") => DeviceKind::Cuda,
            "cuda" => {
                return Err(Error::Usage(
                    "--device cuda: this shardnet was built without the `cuda` feature; \
                     build it with scripts/build-cuda.sh (pinned CUDA wheels, no CUDA install needed)"
                        .into(),
                ))
            }
            other => {
                return Err(Error::Usage(format!(
                    "--device {other}: unknown device (use cpu or cuda)"
                )))
            }
        };
        let communicator = match communicator {
            "host" => CommKind::Host,
            "nccl" if device != DeviceKind::Cuda => {
                return Err(Error::Usage(
                    "--communicator nccl needs every rank on a GPU: add --device cuda".into(),
                ))
            }
            "nccl" if !cfg!(feature = "nccl") => {
                return Err(Error::Usage(
                    "--communicator nccl: this shardnet was built without the `nccl` feature; \
                     build it with scripts/build-cuda.sh"
                        .into(),
                ))
            }
            "nccl" => CommKind::Nccl,
            "hierarchical" => CommKind::Hierarchical,
            other => {
                return Err(Error::Usage(format!(
                    "--communicator {other}: unknown communicator (use host, nccl or hierarchical)"
                )))
            }
        };
        Ok(Setup {
            device,
            communicator,
        })
    }

    /// This rank on its device, through the chosen communicator.
    /// Collective when the communicator is not `host`.
    pub fn apply(&self, comm: Communicator) -> Result<Communicator> {
        let comm = match self.device {
            DeviceKind::Cpu => comm,
            DeviceKind::Cuda => {
                let ordinal = comm.intra_rank();
                let device = Device::new_cuda(ordinal).map_err(|e| {
                    Error::Gpu(format!(
                        "rank {} (rank {ordinal} on its node) has no GPU cuda:{ordinal}: {e}; \
                         start at most as many ranks per node as the node has GPUs",
                        comm.rank()
                    ))
                })?;
                comm.on_device(device)
            }
        };
        match self.communicator {
            CommKind::Host => Ok(comm),
            CommKind::Hierarchical => comm.hierarchical(),
            CommKind::Nccl => nccl(&comm),
        }
    }
}

#[cfg(feature = "nccl")]
fn nccl(comm: &Communicator) -> Result<Communicator> {
    comm.nccl()
}

#[cfg(not(feature = "nccl"))]
fn nccl(_comm: &Communicator) -> Result<Communicator> {
    Err(Error::Usage(
        "the NCCL communicator needs the `nccl` feature: build with scripts/build-cuda.sh".into(),
    ))
}
