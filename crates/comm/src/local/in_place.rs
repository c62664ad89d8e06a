//! The local backend's in-place collectives over host buffers
//! ([`crate::Backend::allreduce_in_place`],
//! [`crate::Backend::rows_in_place`]): the ranks are threads of one
//! process, so each hands the others the addresses of its buffers, sums its
//! share of every buffer from all of them and writes it into all of them
//! (an allreduce), into its own (a reduce-scatter), or copies its own share
//! into all of them (an allgather). No copies; sound because a round
//! completes for all of its ranks or none, and the closing barrier keeps
//! every rank (and its borrowed buffers) in the call until all are written.

use super::{Limit, LocalComm};
use crate::desc::{Desc, Kind};
use crate::reduce::{combine_into, row_share};
use crate::{Error, Result};
use crate::{InPlace, ReduceOp, HOST};
use candle_core::Tensor;

impl LocalComm {
    /// [`crate::Backend::allreduce_in_place`] and
    /// [`crate::Backend::rows_in_place`]: the ranks are threads of
    /// this process, so each passes the addresses of its buffers; rank r
    /// works on its share ([`row_share`]) of every buffer, reading and
    /// writing the ranks' buffers as `what` says; a closing barrier keeps
    /// every rank in the call (its buffers borrowed, untouched by it) until
    /// all are written.
    pub(super) fn shared(
        &self,
        bufs: &mut [&mut [f32]],
        units: &[usize],
        what: InPlace,
    ) -> Result<()> {
        let n = self.members.len();
        // The lengths first: once the addresses are out, `bufs` is not
        // touched again until the closing barrier.
        let sizes: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let (desc, name) = (what.desc(&sizes, units), what.name());
        // (address, length, unit) of each buffer, as i64 triples.
        let addrs: Vec<i64> = bufs
            .iter_mut()
            .zip(units)
            .flat_map(|(b, &u)| [b.as_mut_ptr() as usize as i64, b.len() as i64, u as i64])
            .collect();
        let len = addrs.len();
        let all = self.exchange(desc, vec![Tensor::from_vec(addrs, len, &HOST)?])?;
        let lists: Vec<Vec<i64>> = all
            .iter()
            .map(|(_, ts)| ts[0].to_vec1::<i64>())
            .collect::<candle_core::Result<_>>()?;
        // The header's digest of the lengths already agreed; memory safety
        // rests on this exact check.
        let shape = |l: &Vec<i64>| {
            l.chunks(3)
                .map(|c| (c[1], c[2]))
                .collect::<Vec<(i64, i64)>>()
        };
        if let Some(r) = lists.iter().position(|l| shape(l) != shape(&lists[0])) {
            return Err(Error::Usage(format!(
                "{name}: rank {} passed buffers of (length, row) {:?}, rank {} of {:?} (every \
                 rank must pass the same lengths in the same order)",
                self.members[0],
                shape(&lists[0]),
                self.members[r],
                shape(&lists[r])
            )));
        }
        let me = self.rank;
        for (b, (&size, &unit)) in sizes.iter().zip(units).enumerate() {
            let mine = row_share(size, unit, n, me);
            let ptrs: Vec<*mut f32> = lists
                .iter()
                .map(|l| l[3 * b] as usize as *mut f32)
                .collect();
            // SAFETY: every rank is inside this call until the closing
            // barrier, holding its buffers mutably borrowed and touching
            // them only here, and the lengths and rows agree (checked
            // above); rank r reads and writes only elements `mine` of
            // buffer b, a range no other rank touches, so these slices
            // alias nothing.
            let mut parts: Vec<&mut [f32]> = ptrs
                .iter()
                .map(|p| unsafe { std::slice::from_raw_parts_mut(p.add(mine.start), mine.len()) })
                .collect();
            let mean = |op| (op == ReduceOp::Mean).then_some(n);
            match what {
                InPlace::Allreduce(op) => combine_into(&mut parts, mean(op), None),
                InPlace::ReduceScatter(op) => combine_into(&mut parts, mean(op), Some(me)),
                InPlace::Allgather => {
                    let (before, rest) = parts.split_at_mut(me);
                    let (own, after) = rest.split_at_mut(1);
                    for p in before.iter_mut().chain(after.iter_mut()) {
                        p.copy_from_slice(own[0]);
                    }
                }
            }
        }
        // Every rank passed the first exchange (a round completes for all
        // or none), so every rank is in the loop above, which cannot fail:
        // all will come, and none may leave before (the others write its
        // buffers), whatever fails elsewhere meanwhile.
        self.exchange_within(Desc::new(Kind::Barrier), Vec::new(), Limit::Settle)
            .map(|_| ())
    }
}
