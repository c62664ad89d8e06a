//! The local backend's in-place allreduce ([`crate::comm::Backend::allreduce_in_place`]):
//! the ranks are threads of one process, so each hands the others the
//! addresses of its buffers, sums its share of every buffer from all of
//! them and writes it into all of them. No copies; sound because a round
//! completes for all of its ranks or none, and the closing barrier keeps
//! every rank (and its borrowed buffers) in the call until all are written.

use super::{Limit, LocalComm};
use crate::comm::desc::{Desc, Kind};
use crate::comm::{ReduceOp, HOST};
use crate::{Error, Result};
use candle_core::Tensor;

impl LocalComm {
    /// [`crate::comm::Backend::allreduce_in_place`]: the ranks are threads of this
    /// process, so each passes the addresses of its buffers; rank r combines
    /// its share (`chunk_range`) of every buffer, reading every rank's and
    /// writing the result into every rank's; a closing barrier keeps every
    /// rank in the call (its buffers borrowed, untouched by it) until all
    /// are written.
    pub(super) fn shared_allreduce(&self, bufs: &mut [&mut [f32]], op: ReduceOp) -> Result<()> {
        let n = self.members.len();
        // The lengths first: once the addresses are out, `bufs` is not
        // touched again until the closing barrier.
        let sizes: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let desc = Desc::new(Kind::Allreduce)
            .reduce(op)
            .buffers(candle_core::DType::F32, &sizes);
        // (address, length) of each buffer, as i64 pairs.
        let addrs: Vec<i64> = bufs
            .iter_mut()
            .flat_map(|b| [b.as_mut_ptr() as usize as i64, b.len() as i64])
            .collect();
        let len = addrs.len();
        let all = self.exchange(desc, vec![Tensor::from_vec(addrs, len, &HOST)?])?;
        let lists: Vec<Vec<i64>> = all
            .iter()
            .map(|(_, ts)| ts[0].to_vec1::<i64>())
            .collect::<candle_core::Result<_>>()?;
        // The header's digest of the lengths already agreed; memory safety
        // rests on this exact check.
        let lens = |l: &Vec<i64>| l.iter().skip(1).step_by(2).copied().collect::<Vec<i64>>();
        if let Some(r) = lists.iter().position(|l| lens(l) != lens(&lists[0])) {
            return Err(Error::Usage(format!(
                "allreduce_slices: rank {} passed buffers of lengths {:?}, rank {} of {:?} (every \
                 rank must pass the same lengths in the same order)",
                self.members[0],
                lens(&lists[0]),
                self.members[r],
                lens(&lists[r])
            )));
        }
        for (b, &size) in sizes.iter().enumerate() {
            let mine = crate::comm::reduce::chunk_range(size, n, self.rank);
            let ptrs: Vec<*mut f32> = lists
                .iter()
                .map(|l| l[2 * b] as usize as *mut f32)
                .collect();
            // SAFETY: every rank is inside this call until the closing
            // barrier, holding its buffers mutably borrowed and touching
            // them only here, and the lengths agree (checked above); rank r
            // reads and writes only elements `mine` of buffer b, a range no
            // other rank touches, so these slices alias nothing.
            let mut parts: Vec<&mut [f32]> = ptrs
                .iter()
                .map(|p| unsafe { std::slice::from_raw_parts_mut(p.add(mine.start), mine.len()) })
                .collect();
            crate::comm::reduce::combine(&mut parts, (op == ReduceOp::Mean).then_some(n));
        }
        // Every rank passed the first exchange (a round completes for all
        // or none), so every rank is in the loop above, which cannot fail:
        // all will come, and none may leave before (the others write its
        // buffers), whatever fails elsewhere meanwhile.
        self.exchange_within(Desc::new(Kind::Barrier), Vec::new(), Limit::Settle)
            .map(|_| ())
    }
}
