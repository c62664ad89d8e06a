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
use std::sync::Arc;

/// The error that caused a [`Error::Failed`], shared (an `Error` is
/// `Clone`: every rank's copy of an agreed error keeps it).
pub type Source = Arc<dyn std::error::Error + Send + Sync + 'static>;

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
    /// A file is malformed, or a file cannot be used as it is (the
    /// message names the file and what is wrong).
    Io(String),
    /// Something shardnet called failed: reading or writing a file, a
    /// parser, a tensor operation (candle), the signal handler. `what`
    /// says what shardnet was doing, naming the flag or file (empty where
    /// the cause says it all); `source` is the error itself
    /// ([`std::error::Error::source`]).
    Failed {
        /// What shardnet was doing: the flag, the file.
        what: String,
        /// The error that caused it.
        source: Source,
    },
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
            Error::Io(m) => write!(f, "{m}"),
            Error::Failed { what, source } if what.is_empty() => write!(f, "{source}"),
            Error::Failed { what, source } => write!(f, "{what}: {source}"),
            Error::Gpu(m) => write!(f, "GPU: {m}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Failed { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// A cause with a hint after it (what to do), the cause itself kept as
/// this one's source.
#[derive(Debug)]
struct Hinted {
    cause: Source,
    hint: String,
}

impl fmt::Display for Hinted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.cause, self.hint)
    }
}

impl std::error::Error for Hinted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.cause.as_ref())
    }
}

impl Error {
    /// [`Error::Failed`]: doing `what` (naming the flag or file) failed
    /// because of `source`, which is kept.
    pub fn caused(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error::Failed {
            what: what.into(),
            source: Arc::new(source),
        }
    }

    /// The same error with `more` added to its message (a hint on what
    /// to do); the cause, if any, is kept.
    pub fn with_hint(self, more: &str) -> Error {
        match self {
            Error::Io(m) => Error::Io(m + more),
            Error::Usage(m) => Error::Usage(m + more),
            Error::Failed { what, source } => Error::Failed {
                what,
                source: Arc::new(Hinted {
                    cause: source,
                    hint: more.to_string(),
                }),
            },
            other => other,
        }
    }
}

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
        Error::caused("tensor error", e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::caused("", e)
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::caused("", e)
    }
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        let m = e.to_string();
        THROUGH_CANDLE.with(|p| *p.borrow_mut() = Some((m.clone(), e)));
        candle_core::Error::Msg(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn missing() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file")
    }

    #[test]
    fn a_cause_is_kept_and_named_in_the_message() {
        let e = Error::caused("--log-dir: /x/steps.jsonl", missing());
        assert_eq!(e.to_string(), "--log-dir: /x/steps.jsonl: No such file");
        let io = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(io.map(|e| e.kind()), Some(std::io::ErrorKind::NotFound));
        // A clone (every rank's copy of an agreed error) keeps it too.
        assert!(e.clone().source().is_some());
        // From an io::Error, the message is the cause's own.
        let e = Error::from(missing());
        assert_eq!(e.to_string(), "No such file");
        assert!(e.source().is_some());
        // What shardnet finds wrong by itself has no cause.
        assert!(Error::Io("a.bin: truncated".into()).source().is_none());
    }

    #[test]
    fn a_hint_goes_after_the_message_and_keeps_the_cause() {
        let e = Error::caused("ckpt/step-3", missing()).with_hint("\nresume from step-2");
        assert_eq!(
            e.to_string(),
            "ckpt/step-3: No such file\nresume from step-2"
        );
        let first = e.source().expect("the hinted cause");
        let io = first
            .source()
            .and_then(|s| s.downcast_ref::<std::io::Error>());
        assert!(io.is_some(), "{first:?}");
        let e = Error::Usage("bad".into()).with_hint("; try this");
        assert_eq!(e.to_string(), "bad; try this");
    }

    #[test]
    fn a_candle_error_is_kept_as_the_cause() {
        let e = Error::from(candle_core::Error::Msg("shape mismatch".into()));
        assert_eq!(e.to_string(), "tensor error: shape mismatch");
        assert!(e
            .source()
            .and_then(|s| s.downcast_ref::<candle_core::Error>())
            .is_some());
    }
}
