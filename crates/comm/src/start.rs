//! Starting ranks: [`run`] (threads or an `mpiexec` job, one entry
//! point), [`create_communicator`], and [`end_job`] for a process that
//! fails before it joins.

#[cfg(feature = "mpi")]
use crate::mpi;
use crate::{launch, launcher_size, Communicator, Error, Result};

/// End this process with `msg` (exit status 1), and with it the whole job
/// when `mpiexec` started it with other processes: a process that fails
/// before it joins MPI (a flag that does not parse, a file that cannot be
/// read) still joins, so that the others, waiting for it in
/// `MPI_Init`, end with its error rather than wait for ever.
pub fn end_job(msg: &str) -> ! {
    #[cfg(feature = "mpi")]
    if launcher_size().is_some_and(|n| n > 1) && mpi::world().is_ok() {
        mpi::abort(msg);
    }
    eprintln!("shardnet: {msg}");
    std::process::exit(1)
}

/// Whether the MPI backend was compiled in.
pub fn mpi_available() -> bool {
    cfg!(feature = "mpi")
}

/// Open the world communicator of the named backend for this process.
///
/// `"mpi"` joins the `mpiexec` job. `"local"` ranks exist only inside
/// [`launch`], so here it is an error that says so; see [`run`] for one entry
/// point that covers both.
pub fn create_communicator(name: &str) -> Result<Communicator> {
    match name {
        "mpi" => open_mpi(),
        "local" => Err(Error::Usage("the local backend's ranks are threads: start them with shardnet_comm::launch(n, |comm| ...)".into())),
        other => Err(Error::Usage(format!("unknown communicator backend '{other}' (use 'local' or 'mpi')"))),
    }
}

#[cfg(feature = "mpi")]
fn open_mpi() -> Result<Communicator> {
    mpi::world()
}

#[cfg(not(feature = "mpi"))]
fn open_mpi() -> Result<Communicator> {
    Err(Error::Mpi(match launcher_size() {
        Some(n) => format!(
            "this process was started by mpiexec ({n} processes) but shardnet was built without MPI; \
             rebuild with `cargo build --release --features mpi`"
        ),
        None => "shardnet was built without MPI; rebuild with `cargo build --release --features mpi` and start it under mpiexec".into(),
    }))
}

/// Run `f` on every rank of the named backend and return this process's
/// results: with `"local"`, `n` thread ranks (all results, in rank order); with
/// `"mpi"`, this process's rank (one result; `n` is ignored). `"auto"` picks
/// `mpi` when started by mpiexec, `local` otherwise.
///
/// Under MPI an error or panic on any rank aborts the whole job
/// (`MPI_Abort`), so that no rank is left waiting.
pub fn run<T, F>(backend: &str, n: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    let backend = match backend {
        "auto" if launcher_size().is_some_and(|n| n > 1) => "mpi",
        "auto" => "local",
        b => b,
    };
    match backend {
        "local" => {
            if let Some(k) = launcher_size().filter(|k| *k > 1) {
                return Err(Error::Usage(format!(
                    "started by mpiexec with {k} processes, but the local backend was asked for: \
                     every process would run all {n} ranks; pass --comm mpi"
                )));
            }
            launch(n, f)
        }
        "mpi" => {
            let comm = create_communicator("mpi")?;
            run_mpi(comm, f)
        }
        other => create_communicator(other).map(|_| Vec::new()),
    }
}

/// The stack of a thread that runs a rank (thread ranks, and an MPI
/// process's rank): autograd walks the graph recursively, so a rank that
/// holds a deep model (a pipeline stage of thousands of layers) needs more
/// than a thread's usual 2 MiB. Address space only: pages are used as the
/// stack grows.
pub const RANK_STACK: usize = 1 << 30;

#[cfg(feature = "mpi")]
fn run_mpi<T, F>(comm: Communicator, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Communicator) -> Result<T> + Sync,
{
    let rank = comm.rank();
    // On its own thread, with a rank's stack.
    let out = std::thread::scope(|s| {
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .stack_size(RANK_STACK)
            .spawn_scoped(s, || f(comm))
            .map(|h| h.join())
    });
    match out {
        Ok(Ok(Ok(v))) => Ok(vec![v]),
        Ok(Ok(Err(e))) => mpi::abort(&format!("rank {rank} failed: {e}")),
        Ok(Err(_)) => mpi::abort(&format!("rank {rank} panicked")),
        Err(e) => mpi::abort(&format!("rank {rank} could not start its thread: {e}")),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T, F: Fn(Communicator) -> Result<T> + Sync>(
    _comm: Communicator,
    _f: F,
) -> Result<Vec<T>> {
    open_mpi().map(|_| Vec::new())
}
