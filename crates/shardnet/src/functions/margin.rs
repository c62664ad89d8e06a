//! Margin losses: the target logit's function ψ(cos θ) of the face-recognition
//! heads, applied on the shard that owns the label.
//!
//! With normalised features x̂ and class centres ŵ_c, cos θ_c = x̂·ŵ_c. The
//! logits are s·cos θ_c for every class but the target y, whose logit is
//! s·ψ(cos θ_y):
//!
//! | margin | ψ(cos θ) |
//! |--------|----------|
//! | [`Margin::CosFace`] (AM-softmax) | cos θ − m |
//! | [`Margin::ArcFace`] | cos(θ + m) while θ + m ≤ π; past it, cos θ − m·sin m (InsightFace's fallback, which keeps ψ decreasing) |
//! | [`Margin::SphereFace`] | (−1)^k cos(mθ) − 2k for θ ∈ [kπ/m, (k+1)π/m], integer m: cos(mθ) made monotonic |
//! | [`Margin::Combined`] | cos(m1·θ + m2) − m3 |
//!
//! [`Margin::None`] is the plain fully connected layer: logits x·w_c,
//! no normalisation, no scale. ψ is evaluated in f64 on B values per step,
//! so θ = acos(cos θ) costs nothing; its derivative ψ' is what backward uses.
//!
//! ```
//! use shardnet::functions::Margin;
//!
//! let arc = Margin::ArcFace { m: 0.5 };
//! let theta = 1.0f64;
//! assert!((arc.psi(theta.cos()) - (theta + 0.5).cos()).abs() < 1e-12);
//! assert_eq!("cosface".parse::<Margin>()?, Margin::CosFace { m: 0.35 });
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::Error;
use std::f64::consts::PI;

/// The margin of a classifier head (see the module doc for the formulas).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Margin {
    /// Plain logits x·w_c (no normalisation, no scale): the plain layer.
    None,
    /// Normalised softmax with no margin: ψ(c) = c.
    Normalized,
    /// CosFace / AM-softmax: ψ(c) = c − m.
    CosFace {
        /// The additive cosine margin.
        m: f64,
    },
    /// ArcFace: ψ = cos(θ + m), with the fallback c − m·sin m past θ + m = π.
    ArcFace {
        /// The additive angular margin.
        m: f64,
    },
    /// SphereFace: monotonic cos(mθ).
    SphereFace {
        /// The multiplicative angular margin (an integer ≥ 1).
        m: u32,
    },
    /// Combined (InsightFace): cos(m1·θ + m2) − m3.
    Combined {
        /// Multiplicative angular margin.
        m1: f64,
        /// Additive angular margin.
        m2: f64,
        /// Additive cosine margin.
        m3: f64,
    },
}

impl Margin {
    /// Whether features and class centres are normalised (every margin but
    /// [`Margin::None`]).
    pub fn normalizes(&self) -> bool {
        !matches!(self, Margin::None)
    }

    /// The scale s usually paired with it: 1 for the plain layer, 64 for
    /// the margins (InsightFace's default), 30 for normalised softmax.
    pub fn default_scale(&self) -> f64 {
        match self {
            Margin::None => 1.0,
            Margin::Normalized => 30.0,
            _ => 64.0,
        }
    }

    /// ψ(c), the target's cosine after the margin, for c ∈ [−1, 1].
    pub fn psi(&self, c: f64) -> f64 {
        self.psi_and_derivative(c).0
    }

    /// ψ(c) and dψ/dc. At c = ±1 (θ = 0 or π), where dθ/dc is infinite,
    /// sin θ is held at 1e-12 so the derivative stays finite.
    pub fn psi_and_derivative(&self, c: f64) -> (f64, f64) {
        let c = c.clamp(-1.0, 1.0);
        let sin = (1.0 - c * c).sqrt().max(1e-12);
        match *self {
            Margin::None | Margin::Normalized => (c, 1.0),
            Margin::CosFace { m } => (c - m, 1.0),
            Margin::ArcFace { m } => {
                if c > (PI - m).cos() {
                    (c * m.cos() - sin * m.sin(), m.cos() + c * m.sin() / sin)
                } else {
                    (c - m * m.sin(), 1.0)
                }
            }
            Margin::SphereFace { m } => {
                // k = ⌊mθ/π⌋: the number of j in 1..=m with θ ≥ jπ/m.
                let k = (1..=m)
                    .filter(|&j| c <= (j as f64 * PI / m as f64).cos())
                    .count();
                let k = k.min(m as usize - 1);
                let sign = if k % 2 == 0 { 1.0 } else { -1.0 };
                let (t, dt) = chebyshev(m, c);
                (sign * t - 2.0 * k as f64, sign * dt)
            }
            Margin::Combined { m1, m2, m3 } => {
                let theta = c.acos();
                let a = m1 * theta + m2;
                (a.cos() - m3, a.sin() * m1 / sin)
            }
        }
    }
}

/// T_m(c) = cos(m·acos c) and its derivative m·U_{m−1}(c), by recurrence.
fn chebyshev(m: u32, c: f64) -> (f64, f64) {
    // T_0 = 1, T_1 = c; U_0 = 1, U_1 = 2c.
    let (mut t0, mut t1) = (1.0, c);
    let (mut u0, mut u1) = (1.0, 2.0 * c);
    if m == 0 {
        return (1.0, 0.0);
    }
    for _ in 1..m {
        (t0, t1) = (t1, 2.0 * c * t1 - t0);
        (u0, u1) = (u1, 2.0 * c * u1 - u0);
    }
    (t1, m as f64 * u0)
}

impl std::str::FromStr for Margin {
    type Err = Error;
    /// `none`, `normalized`, `cosface`, `arcface`, `sphereface`, `combined`,
    /// with InsightFace's default margins (0.35; 0.5; 4; 1.0, 0.3, 0.2).
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "none" => Margin::None,
            "normalized" => Margin::Normalized,
            "cosface" | "am-softmax" => Margin::CosFace { m: 0.35 },
            "arcface" => Margin::ArcFace { m: 0.5 },
            "sphereface" => Margin::SphereFace { m: 4 },
            "combined" => Margin::Combined {
                m1: 1.0,
                m2: 0.3,
                m3: 0.2,
            },
            other => {
                return Err(Error::Usage(format!(
                    "unknown margin {other:?}: use none, normalized, cosface, arcface, sphereface \
                     or combined"
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Margin> {
        vec![
            Margin::None,
            Margin::CosFace { m: 0.35 },
            Margin::ArcFace { m: 0.5 },
            Margin::SphereFace { m: 1 },
            Margin::SphereFace { m: 3 },
            Margin::SphereFace { m: 4 },
            Margin::Combined {
                m1: 1.0,
                m2: 0.3,
                m3: 0.2,
            },
            Margin::Combined {
                m1: 0.9,
                m2: 0.4,
                m3: 0.15,
            },
        ]
    }

    #[test]
    fn derivative_matches_central_differences() {
        let h = 1e-6;
        for margin in all() {
            for i in 1..400 {
                let c = -1.0 + i as f64 / 200.0;
                let (_, d) = margin.psi_and_derivative(c);
                let fd = (margin.psi(c + h) - margin.psi(c - h)) / (2.0 * h);
                // Skip the ArcFace/SphereFace branch points, where ψ' jumps.
                let near_kink = match margin {
                    Margin::ArcFace { m } => (c - (PI - m).cos()).abs() < 2.0 * h,
                    Margin::SphereFace { m } => {
                        (1..m).any(|j| (c - (j as f64 * PI / m as f64).cos()).abs() < 2.0 * h)
                    }
                    _ => false,
                };
                if !near_kink {
                    assert!(
                        (d - fd).abs() < 1e-5 * (1.0 + d.abs()),
                        "{margin:?} at {c}: {d} vs {fd}"
                    );
                }
            }
        }
    }

    #[test]
    fn closed_forms() {
        for i in 0..=300 {
            let theta = PI * i as f64 / 300.0;
            let c = theta.cos();
            assert!((Margin::CosFace { m: 0.35 }.psi(c) - (c - 0.35)).abs() < 1e-12);
            let arc = Margin::ArcFace { m: 0.5 }.psi(c);
            if theta + 0.5 <= PI - 1e-9 {
                assert!(
                    (arc - (theta + 0.5).cos()).abs() < 1e-9,
                    "arcface at θ = {theta}"
                );
            } else {
                assert!((arc - (c - 0.5 * 0.5f64.sin())).abs() < 1e-12);
            }
            let comb = Margin::Combined {
                m1: 0.9,
                m2: 0.4,
                m3: 0.15,
            }
            .psi(c);
            assert!((comb - ((0.9 * theta + 0.4).cos() - 0.15)).abs() < 1e-9);
            let m = 4u32;
            let k = ((m as f64 * theta / PI).floor() as i32).min(m as i32 - 1);
            let want = (-1f64).powi(k) * (m as f64 * theta).cos() - 2.0 * k as f64;
            let got = Margin::SphereFace { m }.psi(c);
            assert!(
                (got - want).abs() < 1e-9,
                "sphereface at θ = {theta}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn every_margin_decreases_with_the_angle() {
        for margin in all() {
            let mut last = f64::INFINITY;
            for i in 0..=1000 {
                let v = margin.psi((PI * i as f64 / 1000.0).cos());
                let monotonic = !matches!(margin, Margin::Combined { .. });
                assert!(
                    !monotonic || v <= last + 1e-12,
                    "{margin:?} rises at step {i}"
                );
                last = v;
            }
        }
    }
}
