//! This process's MPI: initialisation (once, with `MPI_THREAD_MULTIPLE`),
//! the world communicator and the node-local ranks, finalisation (after the
//! sends still in flight), `MPI_Abort` on an error or a panic, and the wait
//! that polls a request against the timeout.

use super::buf::Bytes;
use super::codes::Header;
use super::MpiComm;
use crate::Communicator;
use crate::{Error, Result};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

pub(super) struct Process {
    world: ffi::MPI_Comm,
    world_rank: usize,
    pub(super) intra_rank: usize,
    pub(super) intra_size: usize,
}

pub(super) static PROCESS: OnceLock<std::result::Result<Process, String>> = OnceLock::new();

/// What keeps the buffer of a send in flight alive.
pub(super) enum Keep {
    Header(#[allow(dead_code)] Box<Header>),
    Data(#[allow(dead_code)] Bytes),
    /// A small message: its header and payload in one buffer.
    Packed(#[allow(dead_code)] Vec<u8>),
}

/// Sends in flight: the request and what keeps its buffer alive.
pub(super) static PENDING: Mutex<Vec<(ffi::MPI_Request, Keep)>> = Mutex::new(Vec::new());

/// Initialise MPI once for this process and return the world communicator.
pub(crate) fn world() -> Result<Communicator> {
    // Refuse a bad SHARDNET_TIMEOUT before the first wait needs it.
    crate::timeout()?;
    let p = PROCESS
        .get_or_init(init)
        .as_ref()
        .map_err(|e| Error::Mpi(e.clone()))?;
    let size = comm_size(p.world);
    Ok(Communicator::from_backend(Arc::new(MpiComm {
        comm: p.world,
        rank: p.world_rank,
        members: (0..size).collect(),
        shared: std::sync::Mutex::new(super::shared::Shared::Unknown),
    })))
}

fn comm_size(c: ffi::MPI_Comm) -> usize {
    let mut n: c_int = 0;
    unsafe { ffi::MPI_Comm_size(c, &mut n) };
    n as usize
}

fn init() -> std::result::Result<Process, String> {
    unsafe {
        let mut provided: c_int = 0;
        let mut initialized: c_int = 0;
        ffi::MPI_Initialized(&mut initialized);
        if initialized == 0 {
            let code = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            );
            if code != 0 {
                return Err(format!("MPI_Init_thread failed with code {code}"));
            }
            atexit(finalize);
        }
        let mut world: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
        ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut world);
        let size = comm_size(world);
        if let Some(asked) = crate::launcher_size() {
            if asked != size {
                return Err(format!(
                    "the launcher started {asked} processes but MPI sees a world of {size}: the mpiexec used \
                     does not belong to the MPI shardnet was built with (MPICH); launch with mpiexec.mpich"
                ));
            }
        }
        let mut rank: c_int = 0;
        ffi::MPI_Comm_rank(world, &mut rank);
        let mut node: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
        ffi::MPI_Comm_split_type(
            world,
            ffi::RSMPI_COMM_TYPE_SHARED,
            rank,
            ffi::RSMPI_INFO_NULL,
            &mut node,
        );
        let (mut irank, mut isize): (c_int, c_int) = (0, 0);
        ffi::MPI_Comm_rank(node, &mut irank);
        ffi::MPI_Comm_size(node, &mut isize);
        install_panic_abort();
        Ok(Process {
            world,
            world_rank: rank as usize,
            intra_rank: irank as usize,
            intra_size: isize as usize,
        })
    }
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
}

extern "C" fn finalize() {
    let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    for (req, _) in pending.iter_mut() {
        unsafe { ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE) };
    }
    pending.clear();
    unsafe { ffi::MPI_Finalize() };
}

/// End every rank of the job: print `msg` and call `MPI_Abort`.
pub(crate) fn abort(msg: &str) -> ! {
    eprintln!("shardnet: {msg}; aborting every rank (MPI_Abort)");
    // Give the launcher a moment to forward the message before it kills the job.
    std::thread::sleep(std::time::Duration::from_millis(200));
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    std::process::exit(1)
}

fn install_panic_abort() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        let rank = PROCESS
            .get()
            .and_then(|p| p.as_ref().ok())
            .map_or(0, |p| p.world_rank);
        abort(&format!("rank {rank} panicked"));
    }));
}

/// Whether this node runs more of the job's processes than it has cores.
fn oversubscribed() -> bool {
    static OVER: OnceLock<bool> = OnceLock::new();
    *OVER.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        crate::launcher_local_size().is_some_and(|n| n > cores)
    })
}

/// Poll one request until it completes; abort the job at the timeout.
pub(super) fn wait(req: &mut ffi::MPI_Request, op: &str) {
    wait_named(req, || op.to_string())
}

/// [`wait`], the operation's name made only if it does not complete at
/// once (a small message already there costs no clock, limit or string).
pub(super) fn wait_named(req: &mut ffi::MPI_Request, op: impl Fn() -> String) {
    let mut flag: c_int = 0;
    unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    if flag != 0 {
        return;
    }
    let op = op();
    let start = Instant::now();
    // Checked when the world was opened ([`world`]); read once.
    static LIMIT: OnceLock<std::time::Duration> = OnceLock::new();
    let limit = *LIMIT.get_or_init(|| {
        crate::timeout().unwrap_or(std::time::Duration::from_secs_f64(crate::DEFAULT_TIMEOUT_S))
    });
    let mut spins: u64 = 0;
    loop {
        let mut flag: c_int = 0;
        unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if flag != 0 {
            return;
        }
        spins += 1;
        // More processes than cores on this node: give the core away on
        // every poll, since the peer this one waits for may need it.
        if spins.is_multiple_of(1024) || oversubscribed() {
            let waited = start.elapsed();
            if waited > limit {
                let rank = PROCESS
                    .get()
                    .and_then(|p| p.as_ref().ok())
                    .map_or(0, |p| p.world_rank);
                abort(&format!(
                    "rank {rank}: {op} timed out after {:.1} s: a rank never reached it (set SHARDNET_TIMEOUT=<seconds> to wait longer)",
                    limit.as_secs_f64()
                ));
            }
            if waited.as_millis() > 100 {
                std::thread::sleep(std::time::Duration::from_micros(200));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Complete sends whose data has left.
pub(super) fn progress() {
    PENDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain_mut(|(req, _)| {
            let mut flag: c_int = 0;
            unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            flag == 0
        });
}
