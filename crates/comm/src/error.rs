//! The one error type of shardnet.
//!
//! Communication errors name the operation, the ranks involved and what each
//! rank passed, so that a wiring mistake in a multi-rank program reads like a
//! type error instead of a hang.
//!
//! An error raised inside a custom op's backward travels through candle as
//! text; `Error` keeps the original (a thread-local hand-over), so a
//! `PeerFailed` or `Mismatch` in backward reaches the caller as itself.

use std::fmt;

/// Every fallible shardnet call returns this.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong, with enough detail to fix it.
#[derive(Debug, Clone)]
pub enum Error {
    /// Ranks called the same collective with arguments that do not agree
    /// (different operations, roots, dtypes or shapes).
    Mismatch {
        /// The operation the reporting rank was in.
        op: String,
        /// One line per rank: what that rank passed.
        details: String,
    },
    /// Another rank returned an error, panicked or finished early, so this
    /// rank's communication can never complete.
    PeerFailed {
        /// The operation this rank was in.
        op: String,
        /// The (world) rank that failed first.
        rank: usize,
        /// What that rank reported.
        message: String,
    },
    /// A wait ran past the timeout (`SHARDNET_TIMEOUT`, seconds).
    Timeout {
        /// The operation this rank was waiting in.
        op: String,
        /// The ranks that never arrived.
        missing: Vec<usize>,
        /// The timeout that expired, in seconds.
        secs: f64,
    },
    /// The caller used the API wrongly (send to itself, a root out of range, …).
    Usage(String),
    /// The MPI backend could not be started or was started wrongly.
    Mpi(String),
    /// A tensor operation failed.
    Candle(String),
    /// Reading or writing a file failed, or a file is malformed.
    Io(String),
    /// A GPU or NCCL call failed, or a GPU was asked for where there is none.
    Gpu(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Mismatch { op, details } => {
                write!(f, "{op}: ranks disagree on the arguments:\n{details}")
            }
            Error::PeerFailed { op, rank, message } if op == "launch" => {
                write!(f, "rank {rank} failed: {message}")
            }
            Error::PeerFailed { op, rank, message } => {
                write!(f, "{op}: rank {rank} failed, so this call cannot complete (rank {rank}: {message})")
            }
            Error::Timeout { op, missing, secs } => write!(
                f,
                "{op}: timed out after {secs:.1} s; ranks that never arrived: {missing:?} \
                 (set SHARDNET_TIMEOUT=<seconds> to wait longer)"
            ),
            Error::Usage(m) => write!(f, "{m}"),
            Error::Mpi(m) => write!(f, "MPI: {m}"),
            Error::Candle(m) => write!(f, "tensor error: {m}"),
            Error::Io(m) => write!(f, "{m}"),
            Error::Gpu(m) => write!(f, "GPU: {m}"),
        }
    }
}

impl std::error::Error for Error {}

thread_local! {
    /// The last shardnet error that went out through candle (a custom op's
    /// backward), so that it comes back with its variant intact.
    static THROUGH_CANDLE: std::cell::RefCell<Option<(String, Error)>> =
        const { std::cell::RefCell::new(None) };
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        let mut inner = &e;
        while let candle_core::Error::WithBacktrace { inner: i, .. } = inner {
            inner = i;
        }
        if let candle_core::Error::Msg(m) = inner {
            let passed = THROUGH_CANDLE.with(|p| p.borrow_mut().take());
            if let Some((_, original)) = passed.filter(|(msg, _)| msg == m) {
                return original;
            }
        }
        Error::Candle(e.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        let m = e.to_string();
        THROUGH_CANDLE.with(|p| *p.borrow_mut() = Some((m.clone(), e)));
        candle_core::Error::Msg(m)
    }
}
