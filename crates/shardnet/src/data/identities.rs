//! Seeded synthetic identities (`face-head`): C classes, each a centre in
//! U(−1, 1)^d, and samples that are their class's centre plus uniform noise
//! of standard deviation 1/2 per dimension. A stand-in for face embeddings,
//! which cannot be had here; learnable, and the same on any number of ranks
//! (a sample is a function of the seed, the batch and its index in it).

use crate::rng::{splitmix64, unit};
use crate::Result;
use candle_core::{Device, Tensor};

/// The synthetic identities of one run: `classes` classes in `dim`
/// dimensions, drawn from `seed`.
#[derive(Clone, Copy, Debug)]
pub struct Identities {
    /// The run's seed.
    pub seed: u64,
    /// Number of classes (identities).
    pub classes: usize,
    /// Dimension of a sample.
    pub dim: usize,
}

impl Identities {
    /// Class `c`'s centre.
    fn centre(&self, c: u32) -> impl Iterator<Item = f32> {
        let mut s =
            self.seed ^ 0xA076_1D64_78BD_642F ^ u64::from(c).wrapping_mul(0xE703_7ED1_A0B4_28DB);
        (0..self.dim).map(move |_| unit(&mut s) as f32)
    }

    /// Batch `step` of `batch` samples: every sample's label, and the
    /// features of the samples `rows` (a rank's share), on `device`.
    pub fn batch(
        &self,
        step: u64,
        batch: usize,
        rows: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<(Tensor, Vec<u32>)> {
        let key = |i: usize| {
            self.seed
                ^ step.wrapping_mul(0x8EBC_6AF0_9C88_C6E3)
                ^ (i as u64).wrapping_mul(0x5899_65CC_7537_4CC3)
        };
        let labels: Vec<u32> = (0..batch)
            .map(|i| {
                let mut s = key(i);
                (splitmix64(&mut s) % self.classes as u64) as u32
            })
            .collect();
        let mut x = Vec::with_capacity(rows.len() * self.dim);
        // Uniform in ±√3/2: standard deviation 1/2.
        let noise = 0.5 * 3f64.sqrt();
        for i in rows.clone() {
            let mut s = key(i) ^ 0x1234_5678_9ABC_DEF1;
            x.extend(
                self.centre(labels[i])
                    .map(|m| m + (unit(&mut s) * noise) as f32),
            );
        }
        Ok((Tensor::from_vec(x, (rows.len(), self.dim), device)?, labels))
    }
}
