//! Stages to chunks by cost: `--balance auto`.

use crate::{Error, Result};

/// Cut `costs` (one per stage, in order) into `parts` contiguous runs of at
/// least one stage each so that the costliest run costs least; returns the
/// run lengths. Among equally good cuts, earlier runs take fewer stages
/// (rank 0 also reads the data). Exact (dynamic programming over the cut
/// points, O(parts · n²)).
///
/// ```
/// use shardnet::links::balance;
/// // The first layer is cheap: it shares its rank with a second one.
/// assert_eq!(balance(&[0.2, 1.0, 1.0, 1.0], 3)?, vec![2, 1, 1]);
/// # Ok::<(), shardnet::Error>(())
/// ```
pub fn balance(costs: &[f64], parts: usize) -> Result<Vec<usize>> {
    let n = costs.len();
    if parts == 0 || parts > n {
        return Err(Error::Usage(format!(
            "balance: {n} stages cannot fill {parts} chunks of at least one stage each"
        )));
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let run = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][j]: the least max cost of the first j stages in k runs.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for j in k..=n {
            // The last run is stages i..j; the earliest cut point wins a
            // tie, so the last runs take the stages and earlier runs stay
            // short.
            for i in k - 1..j {
                let v = best[k - 1][i].max(run(i, j));
                let now = best[k][j];
                if !now.is_finite() || v < now - 1e-12 * now.abs().max(1.0) {
                    best[k][j] = v;
                    cut[k][j] = i;
                }
            }
        }
    }
    let mut lens = vec![0; parts];
    let mut j = n;
    for k in (1..=parts).rev() {
        let i = cut[k][j];
        lens[k - 1] = j - i;
        j = i;
    }
    Ok(lens)
}

/// How a model's stages (layers, blocks) are cut into a pipeline's chunks
/// (`--balance`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balance {
    /// As even counts as can be (earlier chunks one more).
    Counts,
    /// By each stage's estimated cost (its multiply-adds), so that the
    /// costliest chunk costs least ([`balance`]).
    Auto,
}

impl std::str::FromStr for Balance {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "counts" => Ok(Balance::Counts),
            "auto" => Ok(Balance::Auto),
            _ => Err(Error::Usage(format!(
                "--balance {s}: give counts (even stage counts) or auto (by cost)"
            ))),
        }
    }
}

impl Balance {
    /// Stages of costs `costs` (one each, in order) cut into `parts`
    /// contiguous chunks of at least one stage: even counts (earlier
    /// chunks one more) or by cost ([`balance`]).
    pub fn cut(self, costs: &[f64], parts: usize) -> Result<Vec<std::ops::Range<usize>>> {
        let n = costs.len();
        if parts == 0 || parts > n {
            return Err(Error::Usage(format!(
                "a pipeline of {parts} chunks needs at least as many stages; there are {n}"
            )));
        }
        let lens: Vec<usize> = match self {
            Balance::Counts => (0..parts)
                .map(|c| crate::comm::chunk_range(n, parts, c).len())
                .collect(),
            Balance::Auto => balance(costs, parts)?,
        };
        let mut at = 0;
        Ok(lens
            .into_iter()
            .map(|k| {
                at += k;
                at - k..at
            })
            .collect())
    }
}
