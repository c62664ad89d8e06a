//! Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM.
//!
//! [`install_signal_handlers`] (the `shardnet` command calls it for `train`)
//! turns the first SIGINT or SIGTERM into a stop request; a second one ends
//! the process at once (exit 128 + the signal: 130, 143), and so does the
//! first before training starts (while the data load, the plan is made and
//! the model built: nothing is lost then, and nothing waits for a step). The [training loop](super::train) reads
//! the request after every step and every rank agrees on it, so all ranks
//! stop after the same step; the metrics of the finished epochs are then
//! written as usual, marked `interrupted`.

use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The signal number of the first stop request (0: none).
fn requested() -> &'static Arc<AtomicUsize> {
    static SIGNAL: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    SIGNAL.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Whether no training loop of this process has started yet: a signal
/// then ends the process at once.
fn starting() -> &'static Arc<AtomicBool> {
    static STARTING: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    STARTING.get_or_init(|| Arc::new(AtomicBool::new(true)))
}

/// Say that training has started: from now on a first SIGINT or SIGTERM
/// stops the run after its step (and writes its checkpoint) rather than
/// ending the process.
pub fn training_started() {
    starting().store(false, Ordering::SeqCst);
}

/// Ask every training loop of this process to stop after its current step,
/// as SIGINT/SIGTERM do; `signal` is what the metrics record (its number).
#[doc(hidden)]
pub fn request_stop(signal: i32) {
    let _ = requested().compare_exchange(
        0,
        signal.max(1) as usize,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
}

/// The signal number of a pending stop request, if any.
pub fn stop_requested() -> Option<i32> {
    match requested().load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// Forget a stop request (for a process that trains again afterwards).
#[doc(hidden)]
pub fn clear_stop() {
    requested().store(0, Ordering::SeqCst);
}

/// A signal's name for messages (`SIGINT`, `SIGTERM`, or its number).
pub fn signal_name(signal: i32) -> String {
    match signal {
        signal_hook::consts::SIGINT => "SIGINT".into(),
        signal_hook::consts::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}

/// Make SIGINT and SIGTERM stop requests: the first one is recorded and
/// training stops after the current step; a second ends the process at
/// once with exit status 128 + the signal (130 for SIGINT, 143 for
/// SIGTERM).
pub fn install_signal_handlers() -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let seen = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        let fail = |e: std::io::Error| {
            Error::caused(format!("installing the {} handler", signal_name(sig)), e)
        };
        // Before training starts, at once.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, starting().clone())
            .map_err(fail)?;
        // Registered first, so that it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, seen.clone())
            .map_err(fail)?;
        signal_hook::flag::register(sig, seen.clone()).map_err(fail)?;
        signal_hook::flag::register_usize(sig, requested().clone(), sig as usize).map_err(fail)?;
    }
    Ok(())
}
