//! What must be an error, on every rank and naming every rank: ranks that
//! disagree on a collective's shapes, operations, dtypes or roots, and a
//! misuse that one rank can tell alone.

use super::super::harness::{check, miss};
use super::data;
use candle_core::{DType, Tensor};
use shardnet::comm::{Communicator, ReduceOp};
use shardnet::{Error, Result};

/// Every rank must get the mismatch error, naming every rank; the
/// communicator stays usable afterwards.
pub(super) fn expect_mismatch<T>(c: &Communicator, what: &str, res: Result<T>) -> Result<()> {
    match res {
        Err(Error::Mismatch { details, .. }) => {
            for s in 0..c.size() {
                check(details.contains(&format!("rank {s}:")), || {
                    format!("{what}: error does not name rank {s}: {details}")
                })?;
            }
        }
        Err(e) => miss(format!("{what}: wrong error: {e}")),
        Ok(_) => miss(format!("{what}: no error")),
    }
    c.barrier()
}

pub(super) fn mismatch_shapes(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let cols = if c.rank() == 0 { 2 } else { 3 };
    let res = c.allreduce(&data(c.rank(), 2, cols, DType::F32, 0)?, ReduceOp::Sum);
    expect_mismatch(c, "allreduce shapes", res)?;
    let res = c.allgather(&data(c.rank(), 2, cols, DType::F32, 0)?);
    expect_mismatch(c, "allgather trailing dims", res)
}

pub(super) fn mismatch_ops(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let x = data(c.rank(), 2, 2, DType::F32, 0)?;
    let res = if c.rank() == 0 {
        c.allgather(&x)
    } else {
        c.allreduce(&x, ReduceOp::Sum)
    };
    expect_mismatch(c, "allgather vs allreduce", res)?;
    let res = c.allreduce(
        &x,
        if c.rank() == 0 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        },
    );
    expect_mismatch(c, "max vs sum", res)
}

pub(super) fn mismatch_dtypes(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let dt = if c.rank() == 0 {
        DType::F16
    } else {
        DType::F32
    };
    let res = c.allgather(&data(c.rank(), 2, 2, dt, 0)?);
    expect_mismatch(c, "allgather dtypes", res)
}

pub(super) fn mismatch_roots(c: &Communicator) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let x = data(0, 2, 2, DType::F32, 0)?;
    let res = c.bcast(Some(&x), c.rank());
    expect_mismatch(c, "bcast roots", res)
}

pub(super) fn misuse_is_local_error(c: &Communicator) -> Result<()> {
    let x = data(0, 1, 1, DType::F32, 0)?;
    check(matches!(c.send(&x, c.rank()), Err(Error::Usage(_))), || {
        "send to self accepted".into()
    })?;
    check(matches!(c.recv(c.rank()), Err(Error::Usage(_))), || {
        "recv from self accepted".into()
    })?;
    check(matches!(c.send(&x, c.size()), Err(Error::Usage(_))), || {
        "send out of range accepted".into()
    })?;
    check(
        matches!(c.bcast(Some(&x), c.size()), Err(Error::Usage(_))),
        || "root out of range accepted".into(),
    )?;
    let bad = Tensor::zeros(2, DType::I32, &shardnet::comm::HOST)?;
    check(
        matches!(c.allreduce(&bad, ReduceOp::Sum), Err(Error::Usage(_))),
        || "i32 accepted".into(),
    )
}
