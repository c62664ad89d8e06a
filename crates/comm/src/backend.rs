//! What each backend implements ([`Backend`]): the one trait behind
//! [`crate::Communicator`].

use crate::{InPlace, ReduceOp, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// What each backend implements. Argument checks that need no other rank
/// live in [`Communicator`], so backends see only well-formed calls.
pub(crate) trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn intra_rank(&self) -> usize;
    fn intra_size(&self) -> usize;
    /// The world rank of each rank of this communicator (for error messages).
    fn world_ranks(&self) -> Vec<usize>;
    fn send(&self, t: &Tensor, dst: usize) -> Result<()>;
    fn recv(&self, src: usize) -> Result<Tensor>;
    fn bcast(&self, t: Option<&Tensor>, root: usize) -> Result<Tensor>;
    fn gather(&self, t: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>>;
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> Result<Tensor>;
    fn allgather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>)>;
    fn alltoall(&self, ts: &[Tensor]) -> Result<Vec<Tensor>>;
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Backend>>>;
    /// Where this backend reads and writes tensors: host memory (`None`: the
    /// local and MPI backends; a GPU tensor travels through the host), or
    /// one device (NCCL: the rank's GPU). [`Communicator`] moves the
    /// arguments there and the results back where the caller has them.
    fn home(&self) -> Option<Device> {
        None
    }
    /// Combine equal-shaped tensors from every rank on `root` (`Some` there,
    /// `None` elsewhere). By default an allreduce whose result only the root
    /// keeps; NCCL reduces to the root alone.
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize) -> Result<Option<Tensor>> {
        let y = self.allreduce(t, op)?;
        Ok((self.rank() == root).then_some(y))
    }
    /// Allreduce host buffers in place where the ranks share memory (the
    /// local backend: each rank sums its share of every buffer straight
    /// from the others' and writes it into all of them); `None` where the
    /// backend cannot, and [`Communicator::allreduce_slices`] copies them
    /// through one [`Backend::allreduce`].
    fn allreduce_in_place(&self, _bufs: &mut [&mut [f32]], _op: ReduceOp) -> Option<Result<()>> {
        None
    }
    /// [`Communicator::reduce_scatter_slices`] and
    /// [`Communicator::allgather_slices`] straight between the ranks'
    /// buffers where they share memory (the local backend); `None` where the
    /// backend cannot, and the communicator goes through a copy.
    fn rows_in_place(
        &self,
        _bufs: &mut [&mut [f32]],
        _units: &[usize],
        _what: InPlace,
    ) -> Option<Result<()>> {
        None
    }
}
