//! What every MPI call of the backend shares: the header a rank sends
//! before each operation, and the check of MPI's return codes.

use crate::desc::HEADER_WORDS;
use crate::{Error, Result};
use std::os::raw::c_int;

/// The words a rank sends ahead of an operation ([`crate::desc`]).
pub(super) type Header = [u64; HEADER_WORDS];

/// An error naming `what` unless MPI returned success (0).
pub(super) fn ok(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Mpi(format!(
            "{what} failed with MPI error code {code}"
        )))
    }
}
