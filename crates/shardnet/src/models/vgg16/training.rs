//! [`Vgg16Training`]: the network on one rank of the G × P grid with its
//! images (read on rank 0, each batch broadcast and split over the groups),
//! gradients summed across the groups, and the optimizer, whose state the
//! groups share out (each rank steps its rows, [`sharded_step`]; or the
//! convolutions' gradients and weights too, sharded by the layers): what
//! the loop drives.

use super::*;

/// The model on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct Vgg16Training {
    cfg: Config,
    world: Communicator,
    /// The channel-parallel group (this rank's P ranks).
    cc: Context,
    /// The ranks holding the same channels in the other groups.
    dp: Option<Context>,
    group: usize,
    groups: usize,
    net: Net,
    /// The parameters this replica holds a share of (`--shard-state
    /// gradients` or `parameters`): their gradients are summed over the
    /// replicas by the layers themselves.
    shares: std::collections::HashSet<String>,
    data: Option<(TensorDataset, TensorDataset)>,
    empty: EmptyDataset,
    test_len: usize,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
}

/// Read the images on rank 0.
pub(super) fn read(cfg: &Config) -> Result<(TensorDataset, TensorDataset)> {
    let dir = cfg.data.as_deref();
    Ok(match cfg.dataset {
        ImageSet::Cifar10 => {
            let d = dir.ok_or_else(|| {
                Error::Usage(
                    "--dataset cifar10 needs --data DIR, the directory holding CIFAR-10's binary \
                     files (data_batch_1.bin … test_batch.bin)"
                        .into(),
                )
            })?;
            cifar10(d)?
        }
        ImageSet::Synthetic => {
            let n = cfg.synthetic_examples;
            (
                synthetic_images(n, 3, 32, 10, cfg.seed)?,
                synthetic_images(n.div_ceil(5), 3, 32, 10, cfg.seed ^ 0x7E57)?,
            )
        }
        ImageSet::Mnist => {
            let (tr, te) = mnist(dir)?;
            (pad_images(&tr, 28, 2)?, pad_images(&te, 28, 2)?)
        }
        ImageSet::FashionMnist => {
            let (tr, te) = fashion_mnist(dir)?;
            (pad_images(&tr, 28, 2)?, pad_images(&te, 28, 2)?)
        }
    })
}

impl Vgg16Training {
    /// Build this rank's part, read the data on rank 0 (the others learn
    /// its sizes or its error), set up the shuffle and Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let (groups, p) = cfg.grid(comm.size())?;
        let world = Context::new(comm);
        let group = comm.rank() / p;
        let split = |color: usize| -> Result<Context> {
            world
                .split(Some(color as u32), comm.rank() as i64)?
                .ok_or_else(|| Error::Usage("vgg16: a rank was left out of its group".into()))
        };
        let cc = if groups == 1 {
            world.clone()
        } else {
            split(group)?
        };
        let dp = if groups == 1 {
            None
        } else {
            Some(split(groups + comm.rank() % p)?)
        };
        let store = ParamStore::new(comm.device(), cfg.seed);
        let sharded = matches!(
            cfg.shard_state,
            ShardState::Gradients | ShardState::Parameters
        );
        let (net, shares) = match dp.as_ref().filter(|_| sharded) {
            Some(replicas) => {
                // Built whole (the unsharded model's values), then each
                // convolution's weight shared out over the replicas.
                let whole = ParamStore::new(comm.device(), cfg.seed);
                let net = Net::new(cfg, &cc, dp.as_ref(), &whole)?;
                let keep_whole = cfg.shard_state == ShardState::Gradients;
                net.sharded(replicas, &whole, &store, keep_whole)?
            }
            None => (Net::new(cfg, &cc, dp.as_ref(), &store)?, Default::default()),
        };
        // Rank 0 reads; every rank learns the sizes, or rank 0's error.
        let data = if comm.rank() == 0 {
            Some(read(cfg))
        } else {
            None
        };
        let shared: std::result::Result<(usize, usize, usize), String> = comm.bcast_obj(
            data.as_ref()
                .map(|d| match d {
                    Ok((tr, te)) => Ok((tr.len(), te.len(), tr.x.dims()[1])),
                    Err(e) => Err(e.to_string()),
                })
                .as_ref(),
            0,
        )?;
        let (train_len, test_len, features) = shared.map_err(|e| match comm.rank() {
            0 => Error::Io(e),
            _ => Error::Io(format!("rank 0 could not read the images: {e}")),
        })?;
        let want = cfg.dataset.channels() * 32 * 32;
        if features != want {
            return Err(Error::Io(format!(
                "vgg16: the images have {features} values each, expected {want}"
            )));
        }
        let data = data.transpose()?;
        let it = synchronized_iterator(comm, train_len, cfg.batch_size, cfg.seed)?;
        let mut parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        if let Some(dp) = dp
            .as_ref()
            .filter(|_| cfg.shard_state == ShardState::Optimizer)
        {
            // Each replica keeps and steps its rows of the optimizer's state
            // (ZeRO stage 1): the same parameters, a 1 / groups share of
            // Adam's memory and time on each rank.
            parts.opt.shard_state(dp.comm().size(), dp.comm().rank())?;
        }
        Ok(Vgg16Training {
            cfg: cfg.clone(),
            world: comm.clone(),
            cc,
            dp,
            group,
            groups,
            net,
            shares,
            data,
            empty: EmptyDataset::new(train_len),
            test_len,
            parts,
        })
    }

    /// This rank's parameters.
    pub fn params(&self) -> Vec<Param> {
        self.parts.store.params()
    }

    /// Rank 0's global batch (x, labels) on every rank, and this group's
    /// rows of it.
    fn share(
        &self,
        x: Option<&Tensor>,
        t: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, std::ops::Range<usize>, usize)> {
        let dev = self.cc.device();
        let x = self.world.bcast(x, 0)?.to_device(dev)?;
        let t = self.world.bcast(t, 0)?.to_device(dev)?;
        let global = x.dims()[0];
        let rows = chunk_range(global, self.groups, self.group);
        let c = self.cfg.dataset.channels();
        let x = x
            .narrow(0, rows.start, rows.len())?
            .reshape((rows.len(), c, 32, 32))?;
        let t = t.narrow(0, rows.start, rows.len())?;
        Ok((x, t, rows, global))
    }

    /// Each replica's running statistics (batch norm over its own images)
    /// replaced by their mean over the replicas: one allreduce a step, after
    /// which evaluation and checkpoints see the same statistics on every
    /// rank. Their update is linear, so this is the mean of what each
    /// replica's statistics would be alone.
    fn average_running_stats(&self) -> Result<()> {
        let Some(dp) = &self.dp else { return Ok(()) };
        let norms: Vec<&BatchNorm2d> = self.net.norms.iter().flatten().collect();
        let mut all = Vec::new();
        for bn in &norms {
            let (m, v) = bn.running_stats();
            all.extend(m.to_vec1::<f32>()?);
            all.extend(v.to_vec1::<f32>()?);
        }
        // A fresh host tensor: thread ranks read each other's inputs.
        let len = all.len();
        let all = Tensor::from_vec(all, len, &crate::comm::HOST)?;
        let mean = dp.comm().allreduce(&all, ReduceOp::Mean)?;
        let mut at = 0;
        for bn in norms {
            let (c, dev) = (bn.channels(), bn.weight.value().device().clone());
            let part = |at: usize| mean.narrow(0, at, c)?.to_device(&dev);
            bn.set_running_stats(part(at)?, part(at + c)?)?;
            at += 2 * c;
        }
        Ok(())
    }

    /// The ranks whose parameters make the whole model: the channel group
    /// (the groups hold copies), or every rank when the replicas hold
    /// shares of it.
    fn holders(&self) -> &Communicator {
        if self.shares.is_empty() {
            self.cc.comm()
        } else {
            &self.world
        }
    }

    /// (loss sum over the global batch, hits) from every group: the same
    /// on every rank.
    fn across_groups(&self, loss_sum: f64, hits: usize) -> Result<(f64, usize)> {
        match &self.dp {
            Some(dp) => dp
                .comm()
                .allreduce_obj(&(loss_sum, hits), |a, b| (a.0 + b.0, a.1 + b.1)),
            None => Ok((loss_sum, hits)),
        }
    }
}

impl Vgg16Training {
    /// Step `step`'s forward and backward on the next global batch, the
    /// gradients summed over the groups when `sum` (else each group keeps
    /// its own, for [`sharded_step`]): (loss summed over the global batch,
    /// hits, examples), the same on every rank.
    fn forward_backward(
        &mut self,
        step: usize,
        trace: &mut Trace,
        sum: bool,
    ) -> Result<(f64, usize, usize)> {
        let train: &dyn Dataset = match &self.data {
            Some((tr, _)) => tr,
            None => &self.empty,
        };
        trace.start();
        // Weights kept whole (sharded gradients) are gathered afresh from
        // the shares the last step updated (or a checkpoint restored).
        self.net.forget_gathered();
        let b = self.parts.iterator()?.next_batch(train)?;
        let (x, t, rows, global) = self.share(b.x.as_ref(), b.t.as_ref())?;
        trace.lap("batch");
        // Dropout's seed: the run's and the step's, the same on every rank.
        let seed = crate::rng::splitmix64(&mut (self.cfg.seed ^ (step as u64) << 20));
        let drop = Some((self.cfg.dropout, seed, rows.clone(), global));
        // Batch norm's own slices of this group's rows: the group's rows
        // (one replica each), or every slice of the batch on one replica.
        let slices: Option<Vec<std::ops::Range<usize>>> = self.cfg.batch_norm_slices.map(|k| {
            if self.groups == 1 {
                (0..k).map(|i| chunk_range(global, k, i)).collect()
            } else {
                std::iter::once(0..rows.len()).collect()
            }
        });
        let y = self.net.forward(&x, true, drop, slices.as_deref())?;
        trace.lap("forward");
        // The mean over the global batch: this group's sum / global (a
        // group may hold no rows: the last batch of an epoch can be
        // shorter than the groups; its sum is 0, and it still runs the
        // backward, whose batch norms are collective).
        let nll = if y.dims()[0] == 0 {
            // No rows: a zero still connected to the graph (candle's
            // log-softmax cannot reduce an empty row set).
            y.sum_all()?
        } else {
            candle_nn::ops::log_softmax(&y, 1)?
                .gather(&t.unsqueeze(1)?, 1)?
                .sum_all()?
                .neg()?
        };
        let local = nll.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        let hits = f::top1_hits(&y, &t)?;
        let mut grads = (nll / global as f64)?.backward()?;
        self.parts.store.absorb(&mut grads)?;
        if rows.is_empty() {
            // No images here: a zero gradient where candle's backward over
            // empty tensors reached no parameter.
            for p in self.parts.store.params() {
                if p.grad().is_none() {
                    p.set_grad(&p.value().zeros_like()?)?;
                }
            }
        }
        trace.lap("backward");
        if self.cfg.batch_norm_slices.is_some() {
            self.average_running_stats()?;
        }
        if let Some(dp) = self.dp.as_ref().filter(|_| sum) {
            let params: Vec<Param> = self
                .parts
                .store
                .params()
                .into_iter()
                .filter(|p| p.value().elem_count() > 0 && !self.shares.contains(p.name()))
                .collect();
            allreduce_grads(dp.comm(), &params, ReduceOp::Sum)?;
            trace.lap("allreduce");
        }
        let (loss_sum, hits) = self.across_groups(local, hits)?;
        Ok((loss_sum, hits, b.len))
    }

    /// The gradients of step `step` (forward and backward on the next
    /// batch, no update), whole, on rank 0: what tests compare between
    /// splits, since Adam's update hides a gradient's scale. Collective.
    pub fn gradients(&mut self, step: usize) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.forward_backward(step, &mut Trace::new(self.world.rank()), true)?;
        let whole = self.parts.store.gather_grads_whole(self.holders())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }
}

impl TrainModel for Vgg16Training {
    fn resume_from_ranks(&self, _ranks: usize) -> Result<()> {
        if self.cfg.split == ChannelSplit::Grouped {
            return Err(Error::Usage(
                "ChainerMN's grouped convolution (--parallel-conv grouped) is another function on \
                 another number of ranks (its groups are the ranks): resume it on the same number"
                    .into(),
            ));
        }
        Ok(())
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    /// Batch norm's running statistics.
    fn extra_state(&self) -> Vec<StateTensor> {
        self.net
            .norms
            .iter()
            .flatten()
            .flat_map(|bn| bn.state())
            .collect()
    }

    /// Every parameter whole (shards joined), and batch norm's running
    /// statistics (`bn1.running_mean`, …), on rank 0 (groups hold copies;
    /// the first group's are gathered); `None` elsewhere. The
    /// grouped split's convolutions are each group's own weights, not
    /// shards of one tensor: they are kept by their names
    /// (`conv1.group0of2.weight`, …), as the grouped model holds them.
    /// Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let whole = self
            .parts
            .store
            .gather_whole_with(self.holders(), &self.extra_state())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }

    fn name(&self) -> &str {
        "vgg16"
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let zero1 = self.cfg.shard_state == ShardState::Optimizer && self.dp.is_some();
        let (loss_sum, hits, samples) = self.forward_backward(step, trace, !zero1)?;
        match self.dp.as_ref().filter(|_| zero1) {
            // The groups' gradients summed into each rank's rows, those
            // rows stepped, the parameters gathered.
            Some(dp) => sharded_step(dp.comm(), &mut self.parts.opt, ReduceOp::Sum)?,
            // Summed already (allreduced, or reduce-scattered into the
            // shares), or one group.
            None => self.parts.opt.step()?,
        }
        trace.lap("step");
        Ok(StepOutput {
            loss: loss_sum / samples as f64,
            correct: hits,
            samples,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.cc.no_grad();
        self.net.forget_gathered();
        let test = self.data.as_ref().map(|(_, te)| te);
        let (len, mut hits, mut at) = (self.test_len, 0usize, 0usize);
        while at < len {
            let k = 500.min(len - at);
            let part = test.map(|t| t.slice(at, k)).transpose()?;
            let (x, t, _, _) =
                self.share(part.as_ref().map(|p| &p.x), part.as_ref().map(|p| &p.t))?;
            let y = self.net.forward(&x, false, None, None)?;
            hits += f::top1_hits(&y, &t)?;
            at += k;
        }
        let (_, hits) = self.across_groups(0.0, hits)?;
        Ok(hits as f64 / len.max(1) as f64)
    }
}
