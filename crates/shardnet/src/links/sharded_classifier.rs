//! `ShardedClassifier`: the memory-balanced sharded fully connected head with
//! softmax cross-entropy, sharded by classes.
//!
//! C classes over n ranks: rank r holds W_r (C_r, d), the rows of classes
//! `offset_r .. offset_r + C_r`, with C_r from [`chunk_sizes`] (C / n, plus
//! one on the first C % n ranks). W_r is created, initialised (each row from
//! (seed, global class), so any split starts from the same head), trained
//! and checkpointed on its rank alone: no rank ever holds W or B × C logits.
//!
//! Input: features (B, d), the same on every rank — allgathered from a
//! data-parallel backbone with [`functions::allgather`](crate::functions::allgather),
//! or replicated and passed through [`functions::copy_to_shards`](crate::functions::copy_to_shards);
//! either way backward sums each sample's feature gradient back to where it
//! came from. Labels: global class indices (B). Output: the mean loss over
//! B, identical on every rank, and top-1 accuracy; the loss is
//! [`sharded_softmax_cross_entropy`] (its doc has the communication).
//!
//! **Partial FC** (`sample_rate` r < 1, training only): each step each shard
//! keeps the classes of its labels in the batch and a random sample of the
//! others, ⌈r·C_r⌉ rows in all; logits, softmax and dW cover those rows only.
//! r = 1 is the full head.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::functions::Margin;
//! use shardnet::links::ShardedClassifier;
//! use shardnet::{functions, launch};
//!
//! launch(2, |comm| {
//!     let ctx = functions::Context::new(&comm);
//!     // 5 classes: rank 0 holds 3, rank 1 holds 2.
//!     let head = ShardedClassifier::new(&comm, 5, 4, Margin::ArcFace { m: 0.5 }, 7)?;
//!     assert_eq!(head.local_classes(), if comm.rank() == 0 { 3 } else { 2 });
//!     // Each rank's own two samples; the head sees all four.
//!     let x = Tensor::ones((2, 4), candle_core::DType::F32, comm.device())?;
//!     let x = functions::allgather(&ctx, &x, 0)?;
//!     let out = head.forward(&x, &[0, 1, 3, 4])?;
//!     out.loss.backward()?;
//!     assert!(head.weight.grad().is_some());
//!     Ok(())
//! })?;
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::comm::{chunk_range, Communicator};
use crate::functions::Margin;
use crate::functions::{sharded_softmax_cross_entropy, CrossEntropyConfig};
use crate::nn::Param;
use crate::nn::{init, Shard, Whole};
use crate::rng::splitmix64;
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A classifier head sharded by classes over a communicator's ranks.
pub struct ShardedClassifier {
    comm: Communicator,
    /// W_r, (C_r, d): this rank's class centres.
    pub weight: Param,
    classes: usize,
    offset: usize,
    /// The margin (and whether features and weights are normalised).
    pub margin: Margin,
    /// s, the logit scale of normalised heads.
    pub scale: f64,
    /// The precision of logits: F32, BF16 or F16.
    pub logits: DType,
    /// Partial FC's r in (0, 1]; 1 is the full head.
    pub sample_rate: f64,
    seed: u64,
    step: AtomicU64,
}

/// What one [`ShardedClassifier::forward`] returns.
#[derive(Debug)]
pub struct HeadOutput {
    /// Mean cross-entropy over the batch (a scalar), identical on every rank.
    pub loss: Tensor,
    /// Samples whose label has the largest raw logit among the classes that
    /// took part.
    pub correct: usize,
    /// The batch size B.
    pub count: usize,
    /// Under Partial FC, the global classes of this shard that took part.
    pub sample: Option<Vec<u32>>,
}

impl ShardedClassifier {
    /// This rank's shard of a `classes` × `dim` head, each row initialised
    /// uniformly in ±1/√dim from (`seed`, its global class); the scale is the
    /// margin's usual one, logits f32, no sampling. Its weight is named
    /// `head.weight`.
    pub fn new(
        comm: &Communicator,
        classes: usize,
        dim: usize,
        margin: Margin,
        seed: u64,
    ) -> Result<Self> {
        Self::named(comm, "head", classes, dim, margin, seed)
    }

    /// [`ShardedClassifier::new`] with its weight named `{name}.weight`: a
    /// model with two heads (two towers, two tasks) names each, since
    /// checkpoints and optimizers know a parameter by its name.
    pub fn named(
        comm: &Communicator,
        name: &str,
        classes: usize,
        dim: usize,
        margin: Margin,
        seed: u64,
    ) -> Result<Self> {
        if dim == 0 {
            return Err(Error::Usage(
                "ShardedClassifier: feature dimension 0 (it must be at least 1)".into(),
            ));
        }
        let (offset, rows) = shard(comm, classes)?;
        let bound = 1.0 / (dim as f64).sqrt();
        // Made as a Var: the shard is never copied (C_r·d·4 bytes at once).
        let w = init::uniform_rows_var(seed, offset..offset + rows, dim, bound, comm.device())?;
        let weight = Param::from_var(format!("{name}.weight"), w)?.with_shard(Shard::along(
            0,
            &(offset..offset + rows),
            classes,
        ));
        Self::from_weight(comm, classes, weight, margin, seed)
    }

    /// A head from a ready shard (C_r, d), which must have this rank's
    /// [`chunk_sizes`](crate::comm::chunk_sizes) row count.
    pub fn from_weight(
        comm: &Communicator,
        classes: usize,
        weight: Param,
        margin: Margin,
        seed: u64,
    ) -> Result<Self> {
        let (offset, rows) = shard(comm, classes)?;
        match weight.value().dims() {
            [r, _] if *r == rows => {}
            other => {
                return Err(Error::Usage(format!(
                    "ShardedClassifier: rank {} of {} holds {rows} of {classes} classes, but its \
                     weight has shape {other:?}",
                    comm.rank(),
                    comm.size()
                )))
            }
        }
        // Placed in the global (C, d), for checkpoints and `whole`.
        let weight = match weight.shard() {
            Some(_) => weight,
            None => weight.with_shard(Shard::along(0, &(offset..offset + rows), classes)),
        };
        Ok(ShardedClassifier {
            comm: comm.clone(),
            weight,
            classes,
            offset,
            scale: margin.default_scale(),
            margin,
            logits: DType::F32,
            sample_rate: 1.0,
            seed,
            step: AtomicU64::new(0),
        })
    }

    /// The whole weight (C, d) and its gradient (`None` where backward
    /// applied the fused step instead, or before backward) on rank `root`
    /// (every rank with `None`; `None` on the others). Collective.
    pub fn whole(&self, root: Option<usize>) -> Result<Option<Whole>> {
        Whole::gather(&self.comm, &self.weight, None, root)
    }

    /// C, all classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// C_r, this rank's classes.
    pub fn local_classes(&self) -> usize {
        self.weight.value().dims()[0]
    }

    /// The first global class of this shard.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The training step the next [`ShardedClassifier::forward`] is (Partial
    /// FC draws its sample from (seed, step, rank)); it counts on by one per
    /// forward. A trainer sets it from its own step, so that a resumed run
    /// draws what the uninterrupted one drew.
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }

    /// The training loss of `x` (B, d), identical on every rank, against
    /// global `labels` (B); under Partial FC over this step's sample.
    pub fn forward(&self, x: &Tensor, labels: &[u32]) -> Result<HeadOutput> {
        if !(self.sample_rate > 0.0 && self.sample_rate <= 1.0) {
            return Err(Error::Usage(format!(
                "ShardedClassifier: sample rate {} is not in (0, 1]",
                self.sample_rate
            )));
        }
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        let sample = (self.sample_rate < 1.0).then(|| self.sample(labels, step));
        self.loss(x, labels, sample, true)
    }

    /// The loss and accuracy over the full head (no sampling), e.g. for
    /// evaluation under [`Context::no_grad`](crate::functions::Context::no_grad).
    /// No logits are kept (one class block's at a time): its loss has no
    /// backward.
    pub fn evaluate(&self, x: &Tensor, labels: &[u32]) -> Result<HeadOutput> {
        self.loss(x, labels, None, false)
    }

    fn loss(
        &self,
        x: &Tensor,
        labels: &[u32],
        sample: Option<Vec<u32>>,
        backward: bool,
    ) -> Result<HeadOutput> {
        let cfg = CrossEntropyConfig {
            margin: self.margin,
            scale: self.scale,
            logits: self.logits,
            backward,
        };
        let out = sharded_softmax_cross_entropy(
            &self.comm,
            x,
            &self.weight,
            self.offset,
            self.classes,
            labels,
            sample.as_deref(),
            cfg,
        )?;
        Ok(HeadOutput {
            loss: out.loss.mean_all()?,
            correct: out.correct,
            count: labels.len(),
            sample: sample.map(|s| s.iter().map(|&c| c + self.offset as u32).collect()),
        })
    }

    /// This step's local rows: every local label of the batch and a uniform
    /// sample of the others, ⌈r·C_r⌉ in all, sorted.
    fn sample(&self, labels: &[u32], step: u64) -> Vec<u32> {
        let cr = self.local_classes();
        let mut keep = vec![false; cr];
        let mut kept = 0;
        for &l in labels {
            if let Some(c) = (l as usize).checked_sub(self.offset).filter(|&c| c < cr) {
                kept += usize::from(!keep[c]);
                keep[c] = true;
            }
        }
        let want = ((self.sample_rate * cr as f64).ceil() as usize).clamp(kept, cr);
        let mut s = self.seed
            ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (self.comm.rank() as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        // Draw the smaller of the two sets: the negatives to add, or those to
        // leave out.
        let add = want - kept;
        let leave = cr - want;
        let mut mark = vec![false; cr];
        let (target, count_marked) = if add <= leave {
            (add, true)
        } else {
            (leave, false)
        };
        let mut n = 0;
        while n < target {
            let c = (splitmix64(&mut s) % cr as u64) as usize;
            if !keep[c] && !mark[c] {
                mark[c] = true;
                n += 1;
            }
        }
        (0..cr)
            .filter(|&c| keep[c] || (mark[c] == count_marked))
            .map(|c| c as u32)
            .collect()
    }

    /// Write this rank's shard to `{prefix}.rank{r}-of-{n}.safetensors`:
    /// `head.weight` (C_r, d) and `head.classes` [offset, C_r, C] (u32).
    /// Every rank writes its own file; none holds the whole head.
    pub fn save(&self, prefix: &Path) -> Result<std::path::PathBuf> {
        let path = shard_path(prefix, self.comm.rank(), self.comm.size());
        let range = [
            self.offset as u32,
            self.local_classes() as u32,
            self.classes as u32,
        ];
        let tensors = HashMap::from([
            ("head.weight".to_string(), self.weight.value().clone()),
            (
                "head.classes".to_string(),
                Tensor::new(&range, &crate::comm::HOST)?,
            ),
        ]);
        candle_core::safetensors::save(&tensors, &path)?;
        Ok(path)
    }

    /// Load this rank's shard written by [`ShardedClassifier::save`] with the
    /// same number of ranks.
    /// Collective: every rank reads its own file, and if any rank cannot,
    /// every rank fails with the first (lowest) failing rank's message.
    pub fn load(comm: &Communicator, prefix: &Path, margin: Margin, seed: u64) -> Result<Self> {
        let path = shard_path(prefix, comm.rank(), comm.size());
        let mine = read_shard(&path, comm.device());
        let failed: Vec<Option<String>> =
            comm.allgather_obj(&mine.as_ref().err().map(|e| e.to_string()))?;
        if let Some(first) = failed.into_iter().flatten().next() {
            return Err(Error::Usage(first));
        }
        let (w, offset, classes) = mine?;
        let head = Self::from_weight(
            comm,
            classes,
            Param::new("head.weight", &w)?.with_shard(Shard::along(
                0,
                &(offset..offset + w.dim(0)?),
                classes,
            )),
            margin,
            seed,
        )?;
        if head.offset != offset {
            return Err(Error::Usage(format!(
                "{}: written for classes from {offset}, this rank starts at {}",
                path.display(),
                head.offset
            )));
        }
        Ok(head)
    }
}

/// The weight, first class and class count of one shard file.
fn read_shard(path: &Path, device: &candle_core::Device) -> Result<(Tensor, usize, usize)> {
    let bad = |why: String| Error::Usage(format!("{}: {why}", path.display()));
    let mut t = candle_core::safetensors::load(path, device)
        .map_err(|e| bad(format!("cannot read the head shard ({e})")))?;
    let (Some(w), Some(range)) = (t.remove("head.weight"), t.remove("head.classes")) else {
        return Err(bad(
            "not a shardnet head shard (no head.weight / head.classes)".into(),
        ));
    };
    let range = range.to_vec1::<u32>()?;
    let [offset, _, classes] = range[..] else {
        return Err(bad(format!(
            "head.classes has {} values, expected 3",
            range.len()
        )));
    };
    Ok((w, offset as usize, classes as usize))
}

/// (offset, C_r) of this rank's shard of `classes`.
fn shard(comm: &Communicator, classes: usize) -> Result<(usize, usize)> {
    if classes == 0 {
        return Err(Error::Usage("ShardedClassifier: no classes".into()));
    }
    let mine = chunk_range(classes, comm.size(), comm.rank());
    Ok((mine.start, mine.len()))
}

fn shard_path(prefix: &Path, rank: usize, size: usize) -> std::path::PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!(".rank{rank}-of-{size}.safetensors"));
    p.into()
}
