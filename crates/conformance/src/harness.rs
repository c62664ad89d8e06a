//! The case runner every suite shares: failed expectations recorded, not
//! returned ([`miss`], [`check`], [`expect_eq`]); [`run_case`], where the
//! ranks agree on each case's outcome; the [`Tally`] of a suite; the
//! relative error the exactness tests state their tolerances in
//! ([`max_rel`]); and [`run_local`], the differentiable suites on thread
//! ranks.

use candle_core::{DType, Tensor};
use shardnet::comm::Communicator;
use shardnet::{Error, Result};

pub(super) fn fail(what: String) -> Error {
    Error::Usage(format!("conformance: {what}"))
}

thread_local! {
    /// This rank's failed expectations in the running case (each rank is one
    /// thread: a thread of the local backend, or an MPI process's main thread).
    static MISSES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Record a failed expectation of the running case and go on, so that this
/// rank keeps making the same calls as the others; [`run_case`] reports it.
pub fn miss(what: String) {
    MISSES.with(|m| m.borrow_mut().push(what));
}

/// How many times [`run_case`] repeats an agreement that met a rank still
/// inside the case (see there).
const AGREEMENT_TRIES: usize = 8;

/// The failures of one case, agreed by every rank: (rank, message), in rank
/// order; empty when the case passed everywhere.
pub type Outcome = Vec<(usize, String)>;

/// Run one case's `body` on this rank, then agree with every rank on the
/// outcome (one `allgather_obj`), so that all ranks report the same failures
/// and start the next case together. An error of the agreement itself means
/// the ranks are no longer in step: the suite must stop.
pub fn run_case(comm: &Communicator, body: impl FnOnce() -> Result<()>) -> Result<Outcome> {
    MISSES.with(|m| m.borrow_mut().clear());
    let res = body();
    let mut mine: Vec<String> = MISSES.with(|m| m.borrow_mut().drain(..).collect());
    if let Err(e) = res {
        mine.push(e.to_string());
    }
    let mine = (!mine.is_empty()).then(|| mine.join("; "));
    // A rank whose body stopped early (a local error) meets the others
    // here while they are still inside a collective of the body: that
    // collective and this agreement fail with a mismatch on every rank, the
    // others' bodies return it, and they arrive here. So a mismatched
    // agreement is tried again (bounded: a body that goes on communicating
    // after an error cannot be caught up with).
    let mut tries = 0;
    let all: Vec<Option<String>> = loop {
        match comm.allgather_obj(&mine) {
            Ok(all) => break all,
            Err(Error::Mismatch { .. }) if tries < AGREEMENT_TRIES => tries += 1,
            Err(e) => {
                return Err(fail(format!(
                    "the ranks are out of step after a case ({e}); this rank's own result: {}",
                    mine.as_deref().unwrap_or("passed")
                )))
            }
        }
    };
    Ok(all
        .into_iter()
        .enumerate()
        .filter_map(|(r, m)| m.map(|m| (r, m)))
        .collect())
}

/// The running tally of a suite: cases passed, and (name, message) of each
/// failure, the message naming the ranks.
#[derive(Default)]
pub struct Tally {
    /// Cases that passed on every rank.
    pub passed: usize,
    /// Failed cases: (name, "rank r: message; …").
    pub failed: Vec<(String, String)>,
}

impl Tally {
    /// Run case `name` ([`run_case`]) and count its outcome.
    pub fn run(
        &mut self,
        comm: &Communicator,
        name: &str,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let outcome = run_case(comm, body)?;
        if std::env::var_os("TMP_TIMES").is_some() && comm.rank() == 0 {
            eprintln!("{name} {:.3}", t0.elapsed().as_secs_f64());
        }
        if outcome.is_empty() {
            self.passed += 1;
        } else {
            let msg = outcome
                .iter()
                .map(|(r, m)| format!("rank {r}: {m}"))
                .collect::<Vec<_>>()
                .join("; ");
            self.failed.push((name.to_string(), msg));
        }
        Ok(())
    }
}

/// max |got − want| / max |want| over all elements (f64): the relative error
/// in which the exactness tests state their tolerances; 0 for two empty
/// tensors of one shape.
pub fn max_rel(got: &Tensor, want: &Tensor) -> Result<f64> {
    if want.elem_count() == 0 && got.shape() == want.shape() {
        // Nothing to compare (max_all of nothing is an error); shapes that
        // differ fail in the difference below, as for any other tensors.
        return Ok(0.0);
    }
    let f = |t: Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    let diff = f((got - want)?.abs()?.max_all()?)?;
    let scale = f(want.abs()?.max_all()?)?;
    Ok(diff / scale.max(1e-300))
}

/// Run every case of `cases` (differentiable ones: each rank's body gets a
/// fresh [`Context`](shardnet::functions::Context), whose tape must be empty
/// afterwards) on 1 to `max_ranks` thread ranks; the failures, one line each.
pub fn run_local(
    cases: impl Fn() -> Vec<super::autograd::Case>,
    max_ranks: usize,
    timeout: std::time::Duration,
) -> Vec<String> {
    let mut failures = Vec::new();
    for n in 1..=max_ranks {
        for (name, body) in cases() {
            failures.extend(run_case_local(&name, &*body, n, timeout));
        }
    }
    failures
}

/// Run one differentiable case, `name`, on `n` thread ranks (a fresh
/// [`Context`](shardnet::functions::Context) each, whose tape must be empty
/// afterwards); the failures, one line each.
pub fn run_case_local(
    name: &str,
    body: &(dyn Fn(&shardnet::functions::Context) -> Result<()> + Send + Sync),
    n: usize,
    timeout: std::time::Duration,
) -> Vec<String> {
    let res = shardnet::comm::launch_with_timeout(n, timeout, |c| {
        let cx = shardnet::functions::Context::new(&c);
        run_case(&c, || {
            body(&cx)?;
            match cx.pending_backward() {
                0 => Ok(()),
                k => Err(fail(format!("{k} ops left on the tape"))),
            }
        })
    });
    match res {
        Err(e) => vec![format!("{name} on {n} ranks: {e}")],
        // Every rank agreed on the same outcome; report it once.
        Ok(outcomes) => outcomes
            .into_iter()
            .next()
            .unwrap_or_default()
            .into_iter()
            .map(|(r, m)| format!("{name} on {n} ranks: rank {r}: {m}"))
            .collect(),
    }
}

/// Compare `got` with `want` (same shape; tolerance by dtype as in the module
/// doc); a difference is recorded ([`miss`]), not returned.
pub fn expect_eq(what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    if got.dims() != want.dims() || got.dtype() != want.dtype() {
        miss(format!(
            "{what}: got {:?} {:?}, want {:?} {:?}",
            got.dtype(),
            got.dims(),
            want.dtype(),
            want.dims()
        ));
        return Ok(());
    }
    let tol = match want.dtype() {
        DType::F16 | DType::BF16 => 1e-2,
        DType::F32 | DType::F64 => 1e-6,
        _ => 0.0,
    };
    let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if let Some((i, (a, b))) = g
        .iter()
        .zip(&w)
        .enumerate()
        .find(|(_, (a, b))| !within((*a - *b).abs(), tol * b.abs().max(1.0)))
    {
        miss(format!("{what}: element {i} is {a}, want {b}"));
    }
    Ok(())
}

/// `err ≤ bound`, false for NaN: a NaN result never passes.
pub(crate) fn within(err: f64, bound: f64) -> bool {
    err <= bound
}

/// Record `what()` as a failed expectation ([`miss`]) unless `cond` holds.
pub fn check(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if !cond {
        miss(what());
    }
    Ok(())
}
