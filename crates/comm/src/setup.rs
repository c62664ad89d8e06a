//! Where each rank computes (`--device`) and which communicator joins the
//! ranks (`--communicator`): checked before any rank starts, applied on
//! every rank as it starts.
//!
//! | `--device` | rank r computes on | needs |
//! |------------|--------------------|-------|
//! | `cpu` | the host's CPU | — |
//! | `cuda` | `cuda:(intra_rank mod g)` of its node's g GPUs: its index among the ranks of its node (as ChainerMN's model-parallel MLP picks its GPU), ranks sharing GPUs when a node has more ranks than GPUs | feature `cuda`, a GPU |
//!
//! | `--communicator` | collectives | needs |
//! |------------------|-------------|-------|
//! | `host` | the local or MPI backend itself; GPU tensors travel through host memory | — |
//! | `nccl` | NCCL on the GPUs (ChainerMN's `pure_nccl`); send/recv through the host backend | feature `nccl`, `--device cuda`, a GPU per rank on each node (NCCL refuses one GPU twice in a communicator, so sharing is refused before NCCL is called) |
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
    /// The GPU `cuda:(intra_rank mod g)` of the node's g GPUs ([`gpu_of`]).
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
                let gpus = gpu_count()?;
                let nccl_in_node = match self.communicator {
                    CommKind::Host => false,
                    CommKind::Nccl => true,
                    CommKind::Hierarchical => cfg!(feature = "nccl"),
                };
                if nccl_in_node {
                    nccl_fits(comm.intra_size(), gpus)?;
                }
                if comm.intra_rank() == 0 {
                    eprintln!("shardnet: {}", gpu_placement(comm.intra_size(), gpus));
                }
                let ordinal = gpu_of(comm.intra_rank(), gpus);
                let device = Device::new_cuda(ordinal).map_err(|e| {
                    Error::Gpu(format!(
                        "rank {} (rank {} on its node) could not open cuda:{ordinal}: {e}",
                        comm.rank(),
                        comm.intra_rank()
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

/// The GPU that the rank `intra_rank` of its node computes on, where the
/// node has `gpus` GPUs: `intra_rank mod gpus`, so ranks share GPUs when
/// there are more ranks than GPUs (rank r of a 4-GPU node on `cuda:r`; 3
/// ranks of a 1-GPU node all on `cuda:0`).
///
/// ```
/// use shardnet_comm::gpu_of;
/// assert_eq!((0..5).map(|r| gpu_of(r, 2)).collect::<Vec<_>>(), [0, 1, 0, 1, 0]);
/// ```
pub fn gpu_of(intra_rank: usize, gpus: usize) -> usize {
    intra_rank % gpus.max(1)
}

/// The start-up line of `--device cuda`: which GPU each of a node's
/// `ranks` computes on, and whether they share.
///
/// ```
/// use shardnet_comm::gpu_placement;
/// assert_eq!(gpu_placement(3, 1), "3 ranks on this node's 1 GPU: rank 0 → cuda:0, rank 1 → cuda:0, rank 2 → cuda:0 (ranks share a GPU)");
/// ```
pub fn gpu_placement(ranks: usize, gpus: usize) -> String {
    let each = (0..ranks)
        .map(|r| format!("rank {r} → cuda:{}", gpu_of(r, gpus)))
        .collect::<Vec<_>>()
        .join(", ");
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    format!(
        "{} on this node's {}: {each}{}",
        plural(ranks, "rank"),
        plural(gpus, "GPU"),
        if ranks > gpus {
            " (ranks share a GPU)"
        } else {
            ""
        }
    )
}

/// Refuse NCCL where a node's `ranks` outnumber its `gpus`: NCCL builds a
/// communicator of one rank per GPU and fails a GPU named twice
/// (`ncclInvalidUsage`, "Duplicate GPU detected"), so the refusal comes
/// first, on every rank alike, with what to do instead.
///
/// ```
/// use shardnet_comm::nccl_fits;
/// assert!(nccl_fits(2, 2).is_ok());
/// assert!(nccl_fits(2, 1).unwrap_err().to_string().contains("Duplicate GPU"));
/// ```
pub fn nccl_fits(ranks: usize, gpus: usize) -> Result<()> {
    if ranks <= gpus {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "NCCL (--communicator nccl, and hierarchical's node level) takes one rank per GPU, \
         and {ranks} ranks on a node with {gpus} GPU{} would share one (rank {gpus} on \
         cuda:0 beside rank 0): NCCL fails a GPU named twice in a communicator with \
         ncclInvalidUsage (\"Duplicate GPU detected\"). Use --communicator host (ranks \
         sharing a GPU exchange values through host memory), or start at most {gpus} \
         rank{} per node",
        if gpus == 1 { "" } else { "s" },
        if gpus == 1 { "" } else { "s" },
    )))
}

/// The GPUs this process sees.
#[cfg(feature = "cuda")]
fn gpu_count() -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(Error::Gpu(
            "--device cuda: the CUDA driver sees no GPU (CUDA_VISIBLE_DEVICES?)".into(),
        )),
        Err(e) => Err(Error::Gpu(format!(
            "--device cuda: the CUDA driver could not count the GPUs: {e} \
             (is this a machine with an NVIDIA GPU and its driver?)"
        ))),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_count() -> Result<usize> {
    Err(Error::Usage(
        "--device cuda needs the `cuda` feature: build with scripts/build-cuda.sh".into(),
    ))
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
