//! [`GptTraining`]: this rank's part of the GPT on the t × p × d grid, its
//! text and optimizer, and one step (see the module doc of [`super`]).

use super::net::{Dropout, Loss, Net};
use super::Config;
use crate::comm::{chunk_range, chunk_sizes, split_rows, Communicator};
use crate::data::{synchronized_iterator, Dataset, Text, TextWindows, Tokenizer, TOKENIZER_FILE};
use crate::functions::Context;
use crate::links::{ChainLink, Pipeline};
use crate::nn::{Param, ParamStore};
use crate::optim::{allgather_params, allreduce_grads, reduce_scatter_grads, ShardState};
use crate::train::{Parts, StepOutput, Trace, TrainModel};
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

/// What a pipeline call's chunks need beside their input: the positions,
/// each micro-batch's dropout, and how many micro-batches each chunk has
/// run (every schedule runs a chunk's forwards in micro-batch order).
#[derive(Default)]
struct Calls {
    seq: usize,
    dropout: Vec<Option<Dropout>>,
    seen: Vec<usize>,
}

/// One chunk of this stage: the embeddings first on global chunk 0, then
/// its blocks.
struct Chunk {
    net: Rc<Net>,
    v: usize,
    blocks: std::ops::Range<usize>,
    first: bool,
    calls: Rc<RefCell<Calls>>,
}

impl ChainLink for Chunk {
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        let (seq, dropout) = {
            let mut c = self.calls.borrow_mut();
            let i = c.seen[self.v];
            c.seen[self.v] += 1;
            (c.seq, c.dropout.get(i).copied().flatten())
        };
        let h = if self.first {
            self.net.embed(&xs[0], dropout)?
        } else {
            xs[0].clone()
        };
        self.net.blocks(h, self.blocks.clone(), seq, dropout)
    }
}

/// The communicators of this rank's place in the grid.
struct Groups {
    world: Context,
    /// Its tensor-parallel group (one stage of one replica).
    tc: Context,
    /// Its pipeline: the same tensor-parallel position in every stage.
    pc: Communicator,
    /// The same place in the other replicas (`None`: d = 1).
    dp: Option<Context>,
    /// Its replica: every stage and tensor-parallel rank (the clip norm,
    /// the gathered parameters).
    model: Communicator,
    /// The first and last stage at its position (the tied `wte`); `None`
    /// elsewhere and with one stage.
    tied: Option<Communicator>,
    group: usize,
    groups: usize,
    stage: usize,
    stages: usize,
}

impl Groups {
    /// Rank = (g·p + s)·t + j: replica g, stage s, tensor-parallel rank j.
    /// Collective.
    fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        let (d, p, t) = cfg.grid(comm.size())?;
        let r = comm.rank();
        let (j, s, g) = (r % t, (r / t) % p, r / (t * p));
        let world = Context::new(comm);
        let key = r as i64;
        let split = |color: Option<usize>, key: i64| -> Result<Option<Context>> {
            world.split(color.map(|c| c as u32), key)
        };
        let need = |c: Option<Context>| {
            c.ok_or_else(|| Error::Usage("gpt: a rank was left out of its group".into()))
        };
        // Every split is collective: each rank makes every one, in order.
        let tc = need(split(Some(g * p + s), key)?)?;
        let pc = need(split(Some(g * t + j), s as i64)?)?;
        let dp = need(split(Some(s * t + j), g as i64)?)?;
        let model = need(split(Some(g), key)?)?;
        let ends = p > 1 && (s == 0 || s == p - 1);
        let tied = split(ends.then_some(g * t + j), s as i64)?;
        Ok(Groups {
            world: world.clone(),
            tc,
            pc: pc.comm().clone(),
            dp: (d > 1).then_some(dp),
            model: model.comm().clone(),
            tied: tied.map(|c| c.comm().clone()),
            group: g,
            groups: d,
            stage: s,
            stages: p,
        })
    }

    fn last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// `(sum, hits)` of each replica's last stage (its first
    /// tensor-parallel rank), summed over the replicas: the same on every
    /// rank.
    fn total(&self, sum: f64, hits: usize) -> Result<(f64, usize)> {
        let mine = if self.last() && self.tc.rank() == 0 {
            (sum, hits)
        } else {
            (0.0, 0)
        };
        self.world
            .comm()
            .allreduce_obj(&mine, |a, b| (a.0 + b.0, a.1 + b.1))
    }
}

/// The GPT on this rank with its text and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct GptTraining {
    cfg: Config,
    groups: Groups,
    net: Rc<Net>,
    pipe: Pipeline,
    calls: Rc<RefCell<Calls>>,
    train: TextWindows,
    validation: TextWindows,
    /// The last evaluation's mean loss per token.
    validation_loss: Option<f64>,
    /// The validation text's tokens per byte (1 for bytes; fewer with a
    /// BPE): bits per token times it are bits per byte.
    tokens_per_byte: f64,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
}

impl GptTraining {
    /// Build this rank's part, read the corpus, set up the shuffle and the
    /// optimizer. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate(comm.size())?;
        let groups = Groups::new(comm, cfg)?;
        // Every rank reads the corpus; they agree on whether it could.
        let text = Text::read(cfg.corpus.as_deref());
        let failed: Vec<String> = comm
            .allgather_obj(&text.as_ref().err().map(|e| e.to_string()))?
            .into_iter()
            .flatten()
            .collect();
        let text = match (text, failed.first()) {
            (Err(e), _) => return Err(e),
            (Ok(_), Some(e)) => return Err(Error::Io(format!("another rank: {e}"))),
            (Ok(c), None) => c,
        };
        let tokenizer = tokenizer(comm, cfg, &text)?;
        // One copy of the tokens per process, however many thread ranks.
        let corpus = text.shared_tokens(&tokenizer)?;
        let tokens_per_byte = corpus.validation.len() as f64 / text.validation.len().max(1) as f64;
        drop(text);
        let host = crate::comm::HOST;
        let train = TextWindows::new(corpus.train.clone(), cfg.seq, &host, "training")?;
        let validation = TextWindows::new(corpus.validation.clone(), cfg.seq, &host, "validation")?;
        // This stage's chunks: global chunk v·p + s for v = 0..V.
        let chunks = cfg.chunks()?;
        let (p, s) = (groups.stages, groups.stage);
        let mine: Vec<(usize, std::ops::Range<usize>)> = (s..chunks.len())
            .step_by(p)
            .map(|c| (c, chunks[c].clone()))
            .collect();
        let blocks: Vec<usize> = mine.iter().flat_map(|(_, r)| r.clone()).collect();
        let store = ParamStore::new(comm.device(), cfg.seed);
        let fsdp = groups
            .dp
            .as_ref()
            .filter(|_| cfg.shard_state == ShardState::Parameters)
            .map(|dp| dp.comm().clone());
        let net = Rc::new(Net::new(
            &groups.tc,
            &store,
            cfg,
            &blocks,
            (s == 0, groups.last()),
            fsdp.as_ref(),
        )?);
        let calls = Rc::new(RefCell::new(Calls::default()));
        let links: Vec<Box<dyn ChainLink>> = mine
            .into_iter()
            .enumerate()
            .map(|(v, (c, blocks))| {
                Box::new(Chunk {
                    net: net.clone(),
                    v,
                    blocks,
                    first: c == 0,
                    calls: calls.clone(),
                }) as Box<dyn ChainLink>
            })
            .collect();
        let pipe = Pipeline::new(&groups.pc, cfg.schedule(), links)?.with_costs(cfg.costs(&chunks));
        let it = synchronized_iterator(comm, train.len(), cfg.batch_size, cfg.seed)?;
        let mut parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        if cfg.shard_state == ShardState::Optimizer && groups.groups > 1 {
            // ZeRO stage 1: this replica's rows of every parameter's state.
            parts.opt.shard_state(groups.groups, groups.group)?;
        }
        Ok(GptTraining {
            cfg: cfg.clone(),
            groups,
            net,
            pipe,
            calls,
            train,
            validation,
            validation_loss: None,
            tokens_per_byte,
            parts,
        })
    }

    /// This replica's rows of a global batch of windows, on this rank's
    /// device, and the first row's global index.
    fn rows(&self, x: &Tensor) -> Result<(Tensor, usize)> {
        let g = &self.groups;
        let rows = chunk_range(x.dim(0)?, g.groups, g.group);
        let part = x
            .narrow(0, rows.start, rows.len())?
            .to_device(g.tc.device())?;
        Ok((part, rows.start))
    }

    /// The global norm of the gradients over every split: each sharded
    /// tensor's squares summed over its group, each whole one counted once
    /// (by its group's first rank), the last stage's copy of `wte` not
    /// counted. Collective over the replica.
    ///
    /// With the optimizer's state sharded over the replicas (`sharded`:
    /// the gradients reduce-scattered, each replica's own rows summed), a
    /// sharded parameter counts this replica's rows, a whole one the first
    /// replica's copy, and the sum goes over the replicas too.
    ///
    /// Fully sharded blocks (`--shard-state parameters`): each replica's
    /// shares count on every replica, the rest (reduced whole) on the
    /// first, and the sum goes over the replicas.
    fn grad_norm(&self, sharded: bool) -> Result<f64> {
        let mut sq = 0.0;
        let opt = &self.parts.opt;
        let shares = self.net.share_names();
        let over_replicas = sharded || !shares.is_empty();
        for (p, share) in opt.params().iter().zip(opt.shares()) {
            let own_share = shares.contains_key(p.name());
            // Whole on every rank of the tensor-parallel group: counted by
            // its first.
            let tp_whole = shares.get(p.name()).copied().unwrap_or(p.shard().is_none());
            if (tp_whole && self.groups.tc.rank() != 0) || self.net.is_tied_copy(p) {
                continue;
            }
            sq += match (sharded, share) {
                _ if own_share => p.grad_squares()?,
                (true, Some(rows)) => p.grad_squares_of(Some(rows.clone()))?,
                _ if over_replicas && self.groups.group != 0 => 0.0,
                _ => p.grad_squares()?,
            };
        }
        let mut sq = self.groups.model.allreduce_obj(&sq, |a, b| a + b)?;
        if let (true, Some(dp)) = (over_replicas, &self.groups.dp) {
            sq = dp.comm().allreduce_obj(&sq, |a, b| a + b)?;
        }
        Ok(sq.sqrt())
    }

    /// The ranks that hold the model's shares between them: the replica's,
    /// or every rank's where the blocks are fully sharded over the
    /// replicas.
    fn holders(&self) -> &Communicator {
        if self.net.share_names().is_empty() {
            &self.groups.model
        } else {
            self.groups.world.comm()
        }
    }

    /// The replicas' communicator where the optimizer's state is sharded
    /// over them (`--shard-state optimizer`, d > 1).
    fn sharded_over(&self) -> Option<&Context> {
        self.groups
            .dp
            .as_ref()
            .filter(|_| self.cfg.shard_state == ShardState::Optimizer)
    }

    /// Scale every gradient so that their global norm is at most `max`
    /// (PyTorch's `clip_grad_norm_`: the factor max / (norm + 1e-6),
    /// applied when below 1).
    fn clip(&self, max: f64, sharded: bool) -> Result<()> {
        let norm = self.grad_norm(sharded)?;
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            for p in self.parts.store.params() {
                p.scale_grad(coef)?;
            }
        }
        Ok(())
    }

    /// The gradients of the next batch (forward and backward, summed over
    /// the groups, clipped; no update), whole, on rank 0: what tests
    /// compare between grids. Collective.
    pub fn gradients(&mut self) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.forward_backward(0, &mut Trace::new(self.groups.world.rank()), false)?;
        let whole = self.parts.store.gather_grads_whole(self.holders())?;
        Ok(whole.filter(|_| self.groups.world.rank() == 0))
    }

    /// Forward and backward on the next global batch through the
    /// pipeline, then the gradients summed where they are partial (the
    /// sequence-parallel ones over the group, the tied `wte` over the two
    /// end stages, everything over the replicas) and clipped: (loss sum
    /// over the batch's tokens, hits, tokens), the same on every rank.
    /// `update`: for the optimizer's step, which with its state sharded
    /// over the replicas needs each replica's rows only (reduce-scattered,
    /// not allreduced).
    fn forward_backward(
        &mut self,
        step: usize,
        trace: &mut Trace,
        update: bool,
    ) -> Result<(f64, usize, usize)> {
        let b = self.parts.iterator()?.next_batch(&self.train)?;
        let (Some(x), Some(t)) = (&b.x, &b.t) else {
            return Err(Error::Usage("gpt: a batch without tokens".into()));
        };
        let tokens = b.len * self.cfg.seq;
        let ((x, first_row), (t, _)) = (self.rows(x)?, self.rows(t)?);
        let sizes = chunk_sizes(x.dim(0)?, self.cfg.micro_batches);
        let (xs, ts) = (split_rows(&x, &sizes)?, split_rows(&t, &sizes)?);
        // The step's dropout seed: the run's and the step's, on every rank.
        let mut s = self.cfg.seed ^ ((step as u64) << 20) ^ 0x6A09_E667_F3BC_C908;
        let seed = crate::rng::splitmix64(&mut s);
        let mut at = first_row;
        let dropout = sizes
            .iter()
            .map(|&k| {
                at += k;
                Some(Dropout {
                    p: self.cfg.dropout,
                    seed,
                    first_row: at - k,
                })
            })
            .collect();
        self.begin(dropout);
        trace.start();
        let (mut sum, mut hits) = (0.0, 0usize);
        let net = self.net.clone();
        let inputs = (self.groups.stage == 0).then_some(xs.as_slice());
        self.pipe.step(inputs, sizes.len(), &mut |i, h| {
            let Loss {
                sum: s,
                hits: k,
                scaled,
            } = net.head_loss(h, &ts[i], tokens, true)?;
            sum += s;
            hits += k;
            Ok(scaled)
        })?;
        trace.lap("pipeline");
        let partial = self.net.sequence_partial();
        if !partial.is_empty() {
            allreduce_grads(self.groups.tc.comm(), &partial, ReduceOp::Sum)?;
        }
        if let (Some(tied), Some(w)) = (&self.groups.tied, self.net.tied_copy()) {
            allreduce_grads(tied, std::slice::from_ref(w), ReduceOp::Sum)?;
        }
        let sharded = update && self.sharded_over().is_some();
        if let (true, Some(dp)) = (sharded, self.sharded_over()) {
            reduce_scatter_grads(dp.comm(), &self.parts.opt, ReduceOp::Sum)?;
            trace.lap("reduce-scatter");
        } else if let Some(dp) = &self.groups.dp {
            // Fully sharded blocks' shares got theirs in backward.
            let shares = self.net.share_names();
            let params: Vec<Param> = self
                .parts
                .store
                .params()
                .into_iter()
                .filter(|p| p.value().elem_count() > 0 && !shares.contains_key(p.name()))
                .collect();
            allreduce_grads(dp.comm(), &params, ReduceOp::Sum)?;
            trace.lap("allreduce");
        }
        if let Some(max) = self.cfg.clip_grad_norm {
            self.clip(max, sharded)?;
        }
        let (sum, hits) = self.groups.total(sum, hits)?;
        Ok((sum, hits, tokens))
    }

    /// A pipeline call's chunks start from micro-batch 0 with `dropout`.
    fn begin(&self, dropout: Vec<Option<Dropout>>) {
        let mut c = self.calls.borrow_mut();
        c.seq = self.cfg.seq;
        c.dropout = dropout;
        c.seen = vec![0; self.cfg.virtual_stages()];
    }
}

impl TrainModel for GptTraining {
    fn name(&self) -> &str {
        "gpt"
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let (sum, hits, tokens) = self.forward_backward(step, trace, true)?;
        self.parts.opt.step()?;
        if let Some(dp) = self.sharded_over() {
            allgather_params(dp.comm(), &self.parts.opt)?;
        }
        trace.lap("step");
        Ok(StepOutput {
            loss: sum / tokens as f64,
            correct: hits,
            samples: tokens,
            skipped: false,
        })
    }

    /// Next-token accuracy over the validation text (every window, in
    /// batches of `--batch-size`, through the pipeline without gradients);
    /// its mean loss goes to the epoch's line.
    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.groups.tc.no_grad();
        let n = self.validation.len();
        let (mut sum, mut hits, mut at) = (0.0, 0usize, 0usize);
        while at < n {
            let k = self.cfg.batch_size.min(n - at);
            let idx: Vec<usize> = (at..at + k).collect();
            let b = self.validation.batch(&idx)?;
            let (Some(x), Some(t)) = (&b.x, &b.t) else {
                return Err(Error::Usage("gpt: a batch without tokens".into()));
            };
            let ((x, _), (t, _)) = (self.rows(x)?, self.rows(t)?);
            at += k;
            if x.dim(0)? == 0 {
                // More replicas than windows left: this one has none (the
                // same on every rank of the replica).
                continue;
            }
            self.begin(vec![None]);
            let inputs = (self.groups.stage == 0).then_some(std::slice::from_ref(&x));
            let out = self.pipe.forward(inputs, 1)?;
            if let Some(h) = out.first() {
                let loss = self.net.head_loss(h, &t, 1, false)?;
                sum += loss.sum;
                hits += loss.hits;
            }
        }
        let (sum, hits) = self.groups.total(sum, hits)?;
        let tokens = (n * self.cfg.seq).max(1) as f64;
        self.validation_loss = Some(sum / tokens);
        Ok(hits as f64 / tokens)
    }

    fn throughput_unit(&self) -> &'static str {
        "tokens"
    }

    fn epoch_note(&self) -> String {
        match self.validation_loss {
            Some(l) => format!(
                ", validation loss {l:.4}, perplexity {:.2}, bits per byte {:.3}",
                l.exp(),
                l / std::f64::consts::LN_2 * self.tokens_per_byte
            ),
            None => String::new(),
        }
    }

    /// Every parameter whole by name (the module doc's list), on rank 0
    /// (the replicas hold copies; the first's are gathered); `None`
    /// elsewhere. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let whole = self.parts.store.gather_whole(self.holders())?;
        Ok(whole.filter(|_| self.groups.world.rank() == 0))
    }
}

/// The run's tokenizer, the same on every rank: bytes; or a BPE that rank 0
/// reads back from the checkpoint resumed (the text may have changed since)
/// or learns from the training text, writes as `tokenizer.json` into
/// `--checkpoint-dir` and beside `--save-params`, and broadcasts (an error
/// of rank 0's is every rank's). Collective.
fn tokenizer(comm: &Communicator, cfg: &Config, text: &Text) -> Result<Tokenizer> {
    let super::Tokens::Bpe { vocab } = cfg.tokens else {
        return Ok(Tokenizer::Bytes);
    };
    let mine: Option<std::result::Result<String, String>> = (comm.rank() == 0).then(|| {
        let made = || -> Result<String> {
            let saved = cfg.train.resume.as_ref().and_then(|r| {
                [Some(r.as_path()), r.parent()]
                    .into_iter()
                    .flatten()
                    .map(|d| d.join(TOKENIZER_FILE))
                    .find(|f| f.is_file())
            });
            let json = match saved {
                Some(f) => std::fs::read_to_string(&f)
                    .map_err(|e| Error::caused(format!("--resume: {}", f.display()), e))?,
                None => Tokenizer::train_bpe(&text.train_lines(), vocab)?
                    .to_json()?
                    .unwrap_or_default(),
            };
            let dirs = cfg
                .train
                .checkpoint
                .as_ref()
                .map(|c| c.dir.join(TOKENIZER_FILE));
            for path in dirs.iter().chain(&cfg.tokenizer_copies) {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    crate::output::make_dir("--checkpoint-dir", dir)?;
                }
                crate::output::write_atomic(path, json.as_bytes())?;
            }
            Ok(json)
        };
        made().map_err(|e| e.to_string())
    });
    match comm.bcast_obj(mine.as_ref(), 0)? {
        Ok(json) => {
            let t = Tokenizer::from_json(&json)?;
            if t.vocab_size() > vocab {
                return Err(Error::Usage(format!(
                    "the tokenizer resumed has {} tokens, more than --vocab-size {vocab}",
                    t.vocab_size()
                )));
            }
            Ok(t)
        }
        Err(e) if comm.rank() == 0 => Err(Error::Usage(e)),
        Err(e) => Err(Error::Usage(format!("rank 0: {e}"))),
    }
}
