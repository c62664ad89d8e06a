//! What a rank says it is doing when it enters a collective, and the check
//! that every rank says the same thing.
//!
//! Both backends exchange one [`Desc`] per rank before moving data (the local
//! backend as a struct, MPI as a fixed 128-byte header), then run the same
//! [`check`]. Ranks that disagree all get the same [`Error::Mismatch`], which
//! lists what each rank passed, and the communicator stays usable. The
//! `Desc` also carries the variable shapes (allgather's first dimensions,
//! gather's and alltoall's per-rank shapes), so no receiver needs to know a
//! shape in advance.

use super::ReduceOp;
use crate::{Error, Result};
use candle_core::DType;

/// The collectives (point-to-point messages carry a `Desc` too, as `Send`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Send,
    Bcast,
    Gather,
    Scatter,
    Allgather,
    Alltoall,
    Allreduce,
    ReduceScatter,
    Barrier,
    Split,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Send => "send",
            Kind::Bcast => "bcast",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Allgather => "allgather",
            Kind::Alltoall => "alltoall",
            Kind::Allreduce => "allreduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Barrier => "barrier",
            Kind::Split => "split",
        }
    }
    const ALL: [Kind; 10] = [
        Kind::Send,
        Kind::Bcast,
        Kind::Gather,
        Kind::Scatter,
        Kind::Allgather,
        Kind::Alltoall,
        Kind::Allreduce,
        Kind::ReduceScatter,
        Kind::Barrier,
        Kind::Split,
    ];
}

/// One rank's description of its call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Desc {
    pub kind: Kind,
    pub root: Option<usize>,
    pub reduce: Option<ReduceOp>,
    pub dtype: Option<DType>,
    /// How many tensors the rank passed (alltoall: one per rank; scatter: root passes one per rank).
    pub count: usize,
    /// The shape of the single tensor, for single-tensor operations.
    pub shape: Option<Vec<usize>>,
    /// `split` only: colour (negative: no new communicator) and key.
    pub color: i64,
    pub key: i64,
}

impl Desc {
    pub(crate) fn new(kind: Kind) -> Self {
        Desc {
            kind,
            root: None,
            reduce: None,
            dtype: None,
            count: 0,
            shape: None,
            color: 0,
            key: 0,
        }
    }
    pub(crate) fn root(mut self, root: usize) -> Self {
        self.root = Some(root);
        self
    }
    pub(crate) fn reduce(mut self, op: ReduceOp) -> Self {
        self.reduce = Some(op);
        self
    }
    /// Describe one tensor (dtype, shape, count 1).
    pub(crate) fn tensor(mut self, t: &candle_core::Tensor) -> Self {
        self.dtype = Some(t.dtype());
        self.shape = Some(t.dims().to_vec());
        self.count = 1;
        self
    }
    /// Describe host buffers of `dtype` of lengths `sizes` (the in-place
    /// allreduce): as the one tensor of all their elements a copy through a
    /// tensor would pass, and a digest of the lengths in `key`, so that
    /// buffers split differently on two ranks are a mismatch too.
    pub(crate) fn buffers(mut self, dtype: DType, sizes: &[usize]) -> Self {
        self.dtype = Some(dtype);
        self.shape = Some(vec![sizes.iter().sum()]);
        self.count = 1;
        // FNV-1a over the lengths.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for s in sizes {
            for byte in (*s as u64).to_le_bytes() {
                h = (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        self.key = h as i64;
        self
    }
    /// Describe a list of tensors (dtype of the first, count).
    pub(crate) fn tensors(mut self, ts: &[candle_core::Tensor]) -> Self {
        self.dtype = ts.first().map(|t| t.dtype());
        self.count = ts.len();
        self
    }

    /// The operation as a user would write it, e.g. `allreduce(sum, root 1)`.
    pub(crate) fn op_name(&self) -> String {
        let mut s = self.kind.name().to_string();
        let mut args = Vec::new();
        if let Some(r) = self.reduce {
            args.push(r.name().to_string());
        }
        if let Some(r) = self.root {
            args.push(format!("root {r}"));
        }
        if !args.is_empty() {
            s.push_str(&format!("({})", args.join(", ")));
        }
        s
    }

    fn what(&self) -> String {
        let mut s = self.op_name();
        if let Some(d) = self.dtype {
            s.push_str(&format!(" {}", d.as_str()));
        }
        match (&self.shape, self.count) {
            (Some(sh), _) => s.push_str(&format!(" {sh:?}")),
            (None, 0) => s.push_str(" (no tensor)"),
            (None, n) => s.push_str(&format!(" ({n} tensors)")),
        }
        s
    }

    /// Encode as the fixed-size header the MPI backend exchanges.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn to_words(&self) -> Result<[u64; HEADER_WORDS]> {
        let mut w = [0u64; HEADER_WORDS];
        w[0] = Kind::ALL.iter().position(|k| *k == self.kind).unwrap_or(0) as u64;
        w[1] = self.root.map_or(0, |r| r as u64 + 1);
        w[2] = self.reduce.map_or(0, |r| r.code() + 1);
        w[3] = match self.dtype {
            Some(d) => dtype_code(d)? + 1,
            None => 0,
        };
        w[4] = self.count as u64;
        w[5] = self.color as u64;
        w[6] = self.key as u64;
        if let Some(sh) = &self.shape {
            if sh.len() > MAX_DIMS {
                return Err(Error::Usage(format!(
                    "{}: tensors of rank {} cannot be communicated (at most {MAX_DIMS} dimensions)",
                    self.op_name(),
                    sh.len()
                )));
            }
            w[7] = sh.len() as u64 + 1;
            for (i, d) in sh.iter().enumerate() {
                w[8 + i] = *d as u64;
            }
        }
        Ok(w)
    }

    /// Decode a header written by [`Desc::to_words`].
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn from_words(w: &[u64]) -> Result<Self> {
        let bad = || Error::Mpi(format!("corrupt message header {w:?}"));
        let kind = *Kind::ALL.get(w[0] as usize).ok_or_else(bad)?;
        let reduce = match w[2] {
            0 => None,
            c => Some(ReduceOp::from_code(c - 1).ok_or_else(bad)?),
        };
        let dtype = match w[3] {
            0 => None,
            c => Some(dtype_from_code(c - 1).ok_or_else(bad)?),
        };
        let shape = match w[7] {
            0 => None,
            n if (n as usize - 1) <= MAX_DIMS => Some(
                w[8..8 + n as usize - 1]
                    .iter()
                    .map(|d| *d as usize)
                    .collect(),
            ),
            _ => return Err(bad()),
        };
        Ok(Desc {
            kind,
            root: w[1].checked_sub(1).map(|r| r as usize),
            reduce,
            dtype,
            count: w[4] as usize,
            shape,
            color: w[5] as i64,
            key: w[6] as i64,
        })
    }
}

/// Words in an MPI header.
pub(crate) const HEADER_WORDS: usize = 16;
/// Most dimensions a communicated tensor may have.
pub(crate) const MAX_DIMS: usize = HEADER_WORDS - 8;

/// The dtypes that can be communicated, in header order.
pub(crate) const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

pub(crate) fn dtype_code(d: DType) -> Result<u64> {
    DTYPES
        .iter()
        .position(|x| *x == d)
        .map(|p| p as u64)
        .ok_or_else(|| unsupported_dtype(d))
}

/// The error for a dtype no backend moves.
pub(crate) fn unsupported_dtype(d: DType) -> Error {
    Error::Usage(format!(
        "dtype {} cannot be communicated (supported: f32, f64, f16, bf16, u8, u32, i64)",
        d.as_str()
    ))
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn dtype_from_code(c: u64) -> Option<DType> {
    DTYPES.get(c as usize).copied()
}

/// Each rank's first dimension (0 for a rank that passed no tensor or a
/// scalar): allgather's rows per rank, for the backends that move bytes.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))]
pub(crate) fn first_dims(descs: &[Desc]) -> Vec<usize> {
    descs
        .iter()
        .map(|d| {
            d.shape
                .as_ref()
                .and_then(|s| s.first().copied())
                .unwrap_or(0)
        })
        .collect()
}

/// Check that the descriptions of all ranks (indexed by rank in the
/// communicator; `ranks[i]` is the rank to name in errors) agree.
pub(crate) fn check(descs: &[Desc], ranks: &[usize]) -> Result<()> {
    let first = &descs[0];
    let size = descs.len();
    let mut problems: Vec<String> = Vec::new();
    if descs
        .iter()
        .any(|d| d.kind != first.kind || d.root != first.root || d.reduce != first.reduce)
    {
        problems.push("the ranks are in different operations".into());
    }
    let dtypes: Vec<DType> = descs.iter().filter_map(|d| d.dtype).collect();
    if dtypes.windows(2).any(|w| w[0] != w[1]) {
        problems.push("dtypes differ".into());
    }
    if problems.is_empty() {
        let root = first.root.unwrap_or(0);
        match first.kind {
            Kind::Allreduce | Kind::ReduceScatter => {
                if descs.iter().any(|d| d.shape != first.shape) {
                    problems.push("shapes must be equal on every rank".into());
                } else if descs.iter().any(|d| d.key != first.key) {
                    problems.push("the buffers' lengths must be equal on every rank".into());
                }
            }
            Kind::Allgather => {
                let tail = |d: &Desc| d.shape.as_ref().map(|s| s.get(1..).unwrap_or(&[]).to_vec());
                if descs.iter().any(|d| tail(d) != tail(first)) {
                    problems
                        .push("all dimensions but the first must be equal on every rank".into());
                }
                if descs
                    .iter()
                    .any(|d| d.shape.as_ref().is_some_and(|s| s.is_empty()))
                {
                    problems.push("allgather needs tensors of at least one dimension".into());
                }
                // Host buffers by rows (`allgather_slices`; a tensor's key
                // is 0 on every rank): their lengths and rows digested.
                if descs.iter().any(|d| d.key != first.key) {
                    problems
                        .push("the buffers' lengths and rows must be equal on every rank".into());
                }
            }
            Kind::Bcast => {
                let want = &descs[root].shape;
                if want.is_none() {
                    problems.push(format!("the root (rank {}) passed no tensor", ranks[root]));
                } else if descs.iter().any(|d| d.shape.is_some() && d.shape != *want) {
                    problems
                        .push("a receiving rank's tensor does not match the root's shape".into());
                }
            }
            Kind::Scatter => {
                if descs[root].count != size {
                    problems.push(format!("the root must pass one tensor per rank ({size})"));
                }
            }
            Kind::Alltoall => {
                if descs.iter().any(|d| d.count != size) {
                    problems.push(format!("every rank must pass one tensor per rank ({size})"));
                }
            }
            Kind::Send | Kind::Gather | Kind::Barrier | Kind::Split => {}
        }
    }
    match problems.first() {
        None => Ok(()),
        Some(p) => {
            let lines: Vec<String> = descs
                .iter()
                .zip(ranks)
                .map(|(d, r)| format!("  rank {r}: {}", d.what()))
                .collect();
            Err(Error::Mismatch {
                op: first.op_name(),
                details: format!("{p}\n{}", lines.join("\n")),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let d = Desc {
            kind: Kind::Allreduce,
            root: Some(2),
            reduce: Some(ReduceOp::Max),
            dtype: Some(DType::BF16),
            count: 1,
            shape: Some(vec![3, 0, 7]),
            color: -1,
            key: 9,
        };
        let w = d.to_words().unwrap();
        assert_eq!(Desc::from_words(&w).unwrap(), d);
    }

    #[test]
    fn mismatch_names_every_rank() {
        let a = Desc::new(Kind::Allreduce).reduce(ReduceOp::Sum);
        let mut b = a.clone();
        b.shape = Some(vec![4]);
        let e = check(&[a, b], &[0, 1]).unwrap_err().to_string();
        assert!(
            e.contains("rank 0") && e.contains("rank 1") && e.contains("[4]"),
            "{e}"
        );
    }
}
