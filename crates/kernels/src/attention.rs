//! Causal attention of one head in f32, a block of queries at a time, on
//! GEMMs: never more than [`QUERY_BLOCK`] × T scores at once.
//!
//! For queries i0 .. i0 + R (R ≤ [`QUERY_BLOCK`]) the keys that matter are
//! 0 .. L = i0 + R. With scale s = 1/√d:
//!
//! | pass | per block | GEMMs |
//! |------|-----------|-------|
//! | forward | S = Q_b K_Lᵀ; P = softmax(s·S) over each row's keys j ≤ i (the rest 0); O_b = P V_L; lse_i = log Σ_j exp(s·S_ij) | 2 |
//! | backward | P again from S and lse; dP = G_b V_Lᵀ; dS = P ⊙ (dP − δ_i)·s with δ_i = Σ_x G_ix O_ix; dQ_b = dS K_L; dK_L += dSᵀ Q_b; dV_L += Pᵀ G_b | 5 |
//!
//! The softmax's exp is [`vector::exp_sub_sum`](super::vector::exp_sub_sum)'s
//! polynomial; sums of a row run in f32 (the GEMMs' own order), δ in f64.
//! The GEMMs run on the calling thread ([`serial`](super::serial)'s rule
//! is the caller's): heads are the parallel unit.

use super::dot::Abt;
use super::{matmul, vector, Float};

/// Queries per block: a block's scores are QUERY_BLOCK × L floats.
pub const QUERY_BLOCK: usize = 64;

/// One head's forward: `out` (T × d) and each row's log-sum-exp `lse` (T)
/// from `q`, `k`, `v` (T × d each, rows contiguous).
pub fn forward(
    (q, k, v): (&[f32], &[f32], &[f32]),
    d: usize,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let t = lse.len();
    let mut s = vec![0f32; QUERY_BLOCK * t];
    for i0 in (0..t).step_by(QUERY_BLOCK) {
        let rows = QUERY_BLOCK.min(t - i0);
        let l = i0 + rows;
        let s = &mut s[..rows * l];
        f32::matmul_abt(
            Abt {
                m: rows,
                n: l,
                k: d,
                a: &q[i0 * d..],
                lda: d,
                b: k,
                ldb: d,
            },
            s,
            l,
            false,
        );
        for r in 0..rows {
            let i = i0 + r;
            let row = &mut s[r * l..(r + 1) * l];
            let (keys, masked) = row.split_at_mut(i + 1);
            vector::scale(keys, scale);
            let m = vector::max(keys);
            let sum = vector::exp_sub_sum(keys, m);
            vector::scale(keys, 1.0 / sum);
            masked.fill(0.0);
            lse[i] = m + sum.ln();
        }
        matmul(
            rows,
            d,
            l,
            &mut out[i0 * d..l * d],
            false,
            (s, l, 1),
            (v, d, 1),
        );
    }
}

/// One head's backward: `dq`, `dk`, `dv` (T × d each, overwritten) from the
/// upstream gradient `g` and the forward's `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    (q, k, v): (&[f32], &[f32], &[f32]),
    out: &[f32],
    g: &[f32],
    lse: &[f32],
    d: usize,
    scale: f32,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let t = lse.len();
    let delta: Vec<f32> = (0..t)
        .map(|i| {
            let (gi, oi) = (&g[i * d..(i + 1) * d], &out[i * d..(i + 1) * d]);
            gi.iter()
                .zip(oi)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32
        })
        .collect();
    dk.fill(0.0);
    dv.fill(0.0);
    let mut p = vec![0f32; QUERY_BLOCK * t];
    let mut ds = vec![0f32; QUERY_BLOCK * t];
    for i0 in (0..t).step_by(QUERY_BLOCK) {
        let rows = QUERY_BLOCK.min(t - i0);
        let l = i0 + rows;
        let (p, ds) = (&mut p[..rows * l], &mut ds[..rows * l]);
        let abt = |a: &[f32], b: &[f32], c: &mut [f32]| {
            f32::matmul_abt(
                Abt {
                    m: rows,
                    n: l,
                    k: d,
                    a,
                    lda: d,
                    b,
                    ldb: d,
                },
                c,
                l,
                false,
            )
        };
        abt(&q[i0 * d..], k, p);
        abt(&g[i0 * d..], v, ds);
        for r in 0..rows {
            let i = i0 + r;
            let (pr, dr) = (&mut p[r * l..(r + 1) * l], &mut ds[r * l..(r + 1) * l]);
            let (keys, masked) = pr.split_at_mut(i + 1);
            vector::scale(keys, scale);
            vector::exp_sub_sum(keys, lse[i]);
            masked.fill(0.0);
            for (x, pv) in dr.iter_mut().zip(pr.iter()) {
                *x = pv * (*x - delta[i]) * scale;
            }
        }
        let (gb, qb) = (&g[i0 * d..l * d], &q[i0 * d..l * d]);
        matmul(
            rows,
            d,
            l,
            &mut dq[i0 * d..l * d],
            false,
            (ds, l, 1),
            (k, d, 1),
        );
        matmul(l, d, rows, &mut dk[..l * d], true, (ds, 1, l), (qb, d, 1));
        matmul(l, d, rows, &mut dv[..l * d], true, (p, 1, l), (gb, d, 1));
    }
}
