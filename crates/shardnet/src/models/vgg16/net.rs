//! The network on one rank: each convolution as the split makes it (whole,
//! ChainerMN's grouped layer, or the exact output/input splits), batch norm
//! across the channel group, ReLU, pooling, dropout and the classifier.

use super::*;

/// One convolution as this rank holds it.
pub(super) enum Conv {
    /// The drop-in forms (whole, ChainerMN's grouped): replicated
    /// activations in and out.
    Replicated(ChannelConv2d),
    /// Exact, output channels: the whole input in, this rank's output
    /// channels out.
    Output(OutputParallelConv2d),
    /// Exact, input channels on channel-sharded activations: this rank's
    /// channels in and out.
    Input(InputParallelConv2d),
}

impl Conv {
    /// The convolution this rank runs (`None`: ChainerMN's grouped layer,
    /// which runs one per group).
    fn conv_mut(&mut self) -> Option<&mut crate::nn::Conv2d> {
        match self {
            Conv::Replicated(ChannelConv2d::Whole(c)) => Some(c),
            Conv::Replicated(ChannelConv2d::Output(c)) | Conv::Output(c) => Some(&mut c.conv),
            Conv::Replicated(ChannelConv2d::Input(c)) | Conv::Input(c) => Some(&mut c.conv),
            Conv::Replicated(ChannelConv2d::Grouped(_)) => None,
        }
    }
}

/// The network on one rank.
pub(super) struct Net {
    pub(super) ctx: Context,
    pub(super) split: ChannelSplit,
    pub(super) convs: Vec<Conv>,
    pub(super) norms: Vec<Option<BatchNorm2d>>,
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    pub(super) fn new(
        cfg: &Config,
        cc: &Context,
        dp: Option<&Context>,
        store: &ParamStore,
    ) -> Result<Self> {
        let (mut convs, mut norms) = (Vec::new(), Vec::new());
        let mut cin = cfg.dataset.channels();
        let (n, r) = (cc.size(), cc.rank());
        for (k, &c) in VGG16.iter().filter(|c| **c > 0).enumerate() {
            let cout = cfg.scaled(c);
            let name = format!("conv{}", k + 1);
            let ch = (cin, cout);
            // 3×3 "same" convolutions, a bias only without batch norm.
            let conv = ConvConfig::new().with_bias(!cfg.batch_norm).with_layer(k);
            let at = &store.pp(&name);
            let conv = match cfg.split {
                ChannelSplit::Output => {
                    Conv::Output(OutputParallelConv2d::new(cc, at, ch, conv)?.sharded_output())
                }
                ChannelSplit::Input => {
                    Conv::Input(InputParallelConv2d::new_sharded(cc, at, ch, conv)?)
                }
                split => Conv::Replicated(ChannelConv2d::new(cc, at, split, ch, conv)?),
            };
            convs.push(conv);
            let bn_name = format!("bn{}", k + 1);
            norms.push(if cfg.batch_norm {
                // Sharded activations: each rank normalises its channels.
                let bn = match cfg.split {
                    ChannelSplit::Output | ChannelSplit::Input => {
                        BatchNorm2d::new_shard(store, &bn_name, chunk_range(cout, n, r), cout)?
                    }
                    _ => BatchNorm2d::new(store, &bn_name, cout)?,
                };
                // Statistics of the whole global batch: across the groups.
                Some(match dp {
                    Some(dp) if cfg.batch_norm_slices.is_none() => bn.multi_node(dp.clone()),
                    _ => bn,
                })
            } else {
                None
            });
            cin = cout;
        }
        let hidden = cfg.scaled(512);
        Ok(Net {
            ctx: cc.clone(),
            split: cfg.split,
            convs,
            norms,
            fc1: store.linear("fc1", 13, cin, hidden)?,
            fc2: store.linear("fc2", 14, hidden, 10)?,
        })
    }

    /// The network sharded over the replicas of `dp`: built in `whole`
    /// (the unsharded model's values), every parameter registered in
    /// `store` in its order, each convolution's weight as this replica's
    /// share (chunk r along the dimension its channel split shards, or
    /// dimension 0) with its [`Shard`](crate::nn::Shard) of the global
    /// tensor; each convolution gradient-sharded (`keep_whole`: its weight
    /// gathered once a step) or fully sharded (gathered for each pass).
    /// Returns the shares' names.
    pub(super) fn sharded(
        mut self,
        dp: &Context,
        whole: &ParamStore,
        store: &ParamStore,
        keep_whole: bool,
    ) -> Result<(Self, std::collections::HashSet<String>)> {
        use crate::nn::Shard;
        let mut shares = std::collections::HashMap::new();
        for conv in &mut self.convs {
            let Some(c) = conv.conv_mut() else {
                return Err(Error::Usage(
                    "--shard-state: ChainerMN's grouped layer is not sharded".into(),
                ));
            };
            let w = c.weight().clone();
            let (dim, offset, global) = match w.shard() {
                Some(s) => (s.dim, s.offset, s.global),
                None => (0, 0, w.value().dims()[0]),
            };
            let len = w.value().dims()[dim];
            let own = chunk_range(len, dp.size(), dp.rank());
            let value = w.value().narrow(dim, own.start, own.len())?.contiguous()?;
            // A copy: the whole tensor goes with `whole`.
            let value = value.copy()?;
            let at = offset + own.start..offset + own.end;
            let share = Param::new(w.name(), &value)?.with_shard(Shard::along(dim, &at, global));
            *c = if keep_whole {
                c.gradient_sharded(dp, share.clone(), dim)?
            } else {
                c.fully_sharded(dp, share.clone(), dim)?
            };
            shares.insert(w.name().to_string(), share);
        }
        let names = shares.keys().cloned().collect();
        for p in whole.params() {
            store.register(shares.remove(p.name()).unwrap_or(p))?;
        }
        Ok((self, names))
    }

    /// Drop the whole weights gradient-sharded convolutions keep: the next
    /// pass gathers the shares again.
    pub(super) fn forget_gathered(&mut self) {
        for conv in &mut self.convs {
            if let Some(c) = conv.conv_mut() {
                c.forget_gathered();
            }
        }
    }

    /// Logits of this group's images `x` (b, C, 32, 32); dropout masks are
    /// rows `rows` of the global batch's (`global` rows), drawn from `seed`.
    /// In training, `slices` (rows of `x`) are normalised alone when given
    /// (local or ghost batch norm, [`Config::batch_norm_slices`]); else the
    /// whole batch is, across the groups.
    ///
    /// With an exact split the activations stay split by channels between
    /// the convolutions (batch norm, ReLU and pooling are per channel, so
    /// each rank runs them on its own): `output` gathers them after each
    /// block (after the pooling, where there is one), `input` never until
    /// the classifier.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        train: bool,
        drop: Option<(f64, u64, std::ops::Range<usize>, usize)>,
        slices: Option<&[std::ops::Range<usize>]>,
    ) -> Result<Tensor> {
        let ctx = &self.ctx;
        // The images need no gradient: each rank takes its channels locally.
        let mut h = match self.split {
            ChannelSplit::Input => {
                let own = chunk_range(x.dims()[1], ctx.size(), ctx.rank());
                if x.elem_count() == 0 {
                    // No images: a fresh empty tensor (an empty narrow's
                    // offset can lie past its storage, which candle's CPU
                    // ops index).
                    let (b, _, hh, ww) = x.dims4()?;
                    Tensor::zeros((b, own.len(), hh, ww), x.dtype(), x.device())?
                } else {
                    x.narrow(1, own.start, own.len())?
                }
            }
            _ => x.clone(),
        };
        let mut layer = 0;
        for (at, &c) in VGG16.iter().enumerate() {
            if c == 0 {
                continue;
            }
            h = match &self.convs[layer] {
                Conv::Replicated(conv) => conv.forward(&h)?,
                Conv::Output(conv) => conv.forward(&h)?,
                Conv::Input(conv) => conv.forward(&h)?,
            };
            let pooled = VGG16.get(at + 1) == Some(&0);
            h = match (&self.norms[layer], pooled) {
                (Some(bn), _) => match slices.filter(|_| train) {
                    Some(slices) => norm_slices(bn, &h, pooled, slices)?,
                    None => norm(bn, &h, train, pooled)?,
                },
                (None, true) => max_pool2d(&relu(&h)?, 2)?,
                (None, false) => relu(&h)?,
            };
            let last = layer + 1 == self.convs.len();
            h = match &self.convs[layer] {
                Conv::Output(_) => f::allgather_replicated(ctx, &h, 1)?,
                Conv::Input(_) if last => f::allgather_replicated(ctx, &h, 1)?,
                _ => h,
            };
            layer += 1;
        }
        let mut h = h.flatten_from(1)?;
        let masked = |h: &Tensor, which: u64| -> Result<Tensor> {
            match (&drop, train) {
                (Some((p, seed, rows, global)), true) if *p > 0.0 => {
                    // The global batch's mask, this group's rows: any grid
                    // drops the same elements of the same example.
                    let ones = Tensor::ones((*global, h.dims()[1]), h.dtype(), h.device())?;
                    let mask = dropout(&ones, *p, seed ^ which.wrapping_mul(0x9E37_79B9))?;
                    Ok(h.mul(&mask.narrow(0, rows.start, rows.len())?)?)
                }
                _ => Ok(h.clone()),
            }
        };
        h = masked(&h, 1)?;
        h = relu(&self.fc1.forward(&h)?)?;
        h = masked(&h, 2)?;
        self.fc2.forward(&h)
    }
}

/// ReLU(batch norm(h)), pooled 2 × 2 when `pooled`.
fn norm(bn: &BatchNorm2d, h: &Tensor, train: bool, pooled: bool) -> Result<Tensor> {
    if pooled {
        // Batch norm, ReLU and the pooling after them in one pass each way
        // (the activation before the pooling never written).
        bn.forward_relu_pool(h, train, 2)
    } else {
        // Batch norm and ReLU in one pass each way.
        bn.forward_relu(h, train)
    }
}

/// [`norm`] in training with each of `slices` (rows of `h`, in order,
/// covering them) normalised by its own statistics; the running statistics
/// become the mean of what each slice makes of them. An empty slice (a
/// replica the epoch's last batch left without images) is normalised by
/// the running statistics and leaves them as they were.
fn norm_slices(
    bn: &BatchNorm2d,
    h: &Tensor,
    pooled: bool,
    slices: &[std::ops::Range<usize>],
) -> Result<Tensor> {
    if let [one] = slices {
        return norm(bn, h, !one.is_empty(), pooled);
    }
    let before = bn.running_stats();
    let (mut ys, mut sum): (Vec<Tensor>, Option<(Tensor, Tensor)>) = (Vec::new(), None);
    for s in slices {
        bn.set_running_stats(before.0.clone(), before.1.clone())?;
        ys.push(norm(
            bn,
            &h.narrow(0, s.start, s.len())?,
            !s.is_empty(),
            pooled,
        )?);
        let (m, v) = bn.running_stats();
        sum = Some(match sum {
            Some((sm, sv)) => ((sm + m)?, (sv + v)?),
            None => (m, v),
        });
    }
    if let Some((m, v)) = sum {
        let k = slices.len() as f64;
        bn.set_running_stats((m / k)?, (v / k)?)?;
    }
    Ok(Tensor::cat(&ys, 0)?)
}
