//! `ParamStore`: every trainable parameter of a rank, by name, built in one
//! place (as candle-nn's `VarBuilder` builds layers) and stepped by one
//! optimizer whichever path computed its gradient.
//!
//! - Layers are made from the store: [`ParamStore::linear`] creates (and
//!   registers) a layer's parameters with the seeded initialisers of
//!   [`super::init`]; [`ParamStore::add`] registers one made elsewhere (a
//!   shard of a sharded layer, a `Var` of a candle-nn layer).
//! - Names are unique; [`ParamStore::pp`] scopes them (`"backbone"` →
//!   `"backbone.layer0.weight"`).
//! - Layers' gradients arrive in their parameters during backward, on the
//!   CPU kernels and the generic path alike ([`Param::tracked`]). After a
//!   backward through your own candle ops on [`Param::value`] (a candle-nn
//!   layer, plain ops), [`ParamStore::absorb`] moves what candle's autograd
//!   left in its `GradStore` into the parameters' gradients.
//! - [`ParamStore::state_dict`]: name → tensor, with each shard's place in
//!   its global tensor: what checkpoints save.

use super::{init, Linear, Param, Shard};
use crate::{Error, Result};
use candle_core::{backprop::GradStore, Device, Tensor};
use std::sync::{Arc, Mutex};

/// One entry of [`ParamStore::state_dict`].
#[derive(Clone, Debug)]
pub struct StateEntry {
    /// The parameter's (global) name.
    pub name: String,
    /// Its value on this rank.
    pub tensor: Tensor,
    /// Where it lies in the global tensor, if this rank holds a shard.
    pub shard: Option<Shard>,
}

/// The parameters of one rank, in the order they were made. Clones (and
/// scopes made by [`ParamStore::pp`]) share the one list.
#[derive(Clone)]
pub struct ParamStore {
    params: Arc<Mutex<Vec<Param>>>,
    prefix: String,
    device: Device,
    seed: u64,
    /// Values by full name that parameters take instead of their
    /// initialisers' ([`ParamStore::with_values`]).
    presets: Option<Arc<std::collections::BTreeMap<String, Tensor>>>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamStore({} parameters)", self.len())
    }
}

impl ParamStore {
    /// An empty store whose parameters live on `device`, initialised from
    /// `seed`.
    pub fn new(device: &Device, seed: u64) -> Self {
        ParamStore {
            params: Default::default(),
            prefix: String::new(),
            device: device.clone(),
            seed,
            presets: None,
        }
    }

    /// An empty store whose parameters take their values from `values`
    /// by full name (each of the shape the layer asks for), not from their
    /// initialisers: a layer built again around values held elsewhere (a
    /// fully sharded block's, gathered for one use).
    pub fn with_values(
        device: &Device,
        seed: u64,
        values: std::collections::BTreeMap<String, Tensor>,
    ) -> Self {
        ParamStore {
            presets: Some(Arc::new(values)),
            ..ParamStore::new(device, seed)
        }
    }

    /// The value given for parameter `name` (under this scope) by
    /// [`ParamStore::with_values`], if any.
    pub fn preset(&self, name: &str) -> Option<Tensor> {
        self.presets.as_ref()?.get(&self.full(name)).cloned()
    }

    /// The device its parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The seed its initialisers draw from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The same store, with names made under `scope`.
    pub fn pp(&self, scope: &str) -> ParamStore {
        ParamStore {
            prefix: self.full(scope),
            ..self.clone()
        }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Param>> {
        self.params.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register `value` (moved to the store's device) as parameter `name`
    /// (under this scope), optionally as a shard of a global tensor.
    pub fn add(&self, name: &str, value: &Tensor, shard: Option<Shard>) -> Result<Param> {
        let preset = self.preset(name);
        let value = match &preset {
            Some(v) if v.dims() != value.dims() => {
                return Err(Error::Usage(format!(
                    "{}: the value given has shape {:?}, the layer's {:?}",
                    self.full(name),
                    v.dims(),
                    value.dims()
                )))
            }
            Some(v) => v,
            None => value,
        };
        let p = Param::new(self.full(name), &value.to_device(&self.device)?)?;
        let p = match shard {
            Some(s) => p.with_shard(s),
            None => p,
        };
        self.register(p.clone())?;
        Ok(p)
    }

    /// Register a parameter made elsewhere (its name is kept as it is).
    pub fn register(&self, param: Param) -> Result<()> {
        let mut all = self.lock();
        if all.iter().any(|p| p.name() == param.name()) {
            return Err(Error::Usage(format!(
                "two parameters are named {}: every parameter needs its own name",
                param.name()
            )));
        }
        all.push(param);
        Ok(())
    }

    /// A `Linear(fan_in → fan_out)` named `name` (weight `name.weight`,
    /// bias `name.bias`), its tensors [`init::uniform_layer`] of `layer`
    /// with bound 1/√fan_in.
    pub fn linear(
        &self,
        name: &str,
        layer: usize,
        fan_in: usize,
        fan_out: usize,
    ) -> Result<Linear> {
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        let (seed, dev) = (self.seed, &self.device);
        let w = init::uniform_layer(seed, layer, 0, (fan_out, fan_in), bound, dev)?;
        let b = init::uniform_layer(seed, layer, 1, (1, fan_out), bound, dev)?.reshape(fan_out)?;
        Ok(Linear::new(
            self.pp(name).add("weight", &w, None)?,
            Some(self.pp(name).add("bias", &b, None)?),
        ))
    }

    /// Every parameter, in the order made.
    pub fn params(&self) -> Vec<Param> {
        self.lock().clone()
    }

    /// How many parameters it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Move every parameter's entry of `grads` into its gradient (see
    /// [`Param::absorb`]). Call after each backward.
    pub fn absorb(&self, grads: &mut GradStore) -> Result<()> {
        for p in self.lock().iter() {
            p.absorb(grads)?;
        }
        Ok(())
    }

    /// Name → value of every parameter, with shard placement.
    pub fn state_dict(&self) -> Vec<StateEntry> {
        self.lock()
            .iter()
            .map(|p| StateEntry {
                name: p.name().to_string(),
                tensor: p.value().clone(),
                shard: p.shard(),
            })
            .collect()
    }

    /// Every parameter as training state (`param/{name}`), read and
    /// written in place by checkpoints.
    pub fn state(&self) -> Vec<super::StateTensor> {
        self.lock()
            .iter()
            .map(|p| super::StateTensor::var(format!("param/{}", p.name()), p.var(), p.shard()))
            .collect()
    }

    /// Every parameter's gradient (zeros where backward left none), whole
    /// by the parameter's name and placement as [`gather_whole`](Self::gather_whole)
    /// joins the values, on rank 0 of `comm` (`None` elsewhere); the
    /// gradients are taken ([`Param::take_grad`]). What tests compare
    /// between splits. Collective.
    pub fn gather_grads_whole(
        &self,
        comm: &crate::comm::Communicator,
    ) -> Result<Option<std::collections::BTreeMap<String, Tensor>>> {
        let grads = ParamStore::new(self.device(), self.seed());
        for p in self.params() {
            let g = match p.take_grad() {
                Some(g) => g,
                None => p.value().zeros_like()?,
            };
            let q = Param::new(p.name(), &g)?;
            grads.register(match p.shard() {
                Some(s) => q.with_shard(s),
                None => q,
            })?;
        }
        grads.gather_whole(comm)
    }

    /// Every parameter of every rank's store whole, by name, on rank 0
    /// (`None` elsewhere): shards concatenated along their dimension by
    /// their placement (a shard held by several ranks taken once),
    /// parameters without one taken from the lowest rank holding them.
    /// Values travel as f32. Collective.
    pub fn gather_whole(
        &self,
        comm: &crate::comm::Communicator,
    ) -> Result<Option<std::collections::BTreeMap<String, Tensor>>> {
        self.gather_whole_with(comm, &[])
    }

    /// [`gather_whole`](Self::gather_whole), and with the parameters the
    /// training state tensors `extra` (batch norm's running statistics),
    /// each named as its [`StateTensor`](super::StateTensor) is without a
    /// `buffer/` prefix (`bn1.running_mean`, as PyTorch's `state_dict`).
    /// Collective.
    pub fn gather_whole_with(
        &self,
        comm: &crate::comm::Communicator,
        extra: &[super::StateTensor],
    ) -> Result<Option<std::collections::BTreeMap<String, Tensor>>> {
        type Entry = (String, Vec<usize>, Option<Shard>, Vec<f32>);
        let mut mine: Vec<Entry> = self
            .state_dict()
            .into_iter()
            .map(|e| {
                let v = e
                    .tensor
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                Ok((e.name, e.tensor.dims().to_vec(), e.shard, v))
            })
            .collect::<Result<_>>()?;
        for t in extra {
            let v = t.with_values(|v| Ok(v.to_vec()))?;
            let name = t
                .name
                .strip_prefix(super::BUFFER_PREFIX)
                .unwrap_or(&t.name)
                .to_string();
            mine.push((name, t.shape.clone(), t.shard, v));
        }
        let Some(all) = comm.gather_obj(&mine, 0)? else {
            return Ok(None);
        };
        let mut pieces: std::collections::BTreeMap<String, Vec<(Option<Shard>, Tensor)>> =
            Default::default();
        for (name, dims, shard, v) in all.into_iter().flatten() {
            let t = Tensor::from_vec(v, dims, comm.device())?;
            pieces.entry(name).or_default().push((shard, t));
        }
        let mut whole = std::collections::BTreeMap::new();
        for (name, mut parts) in pieces {
            let t = match parts[0].0 {
                None => parts.swap_remove(0).1,
                Some(s) => {
                    parts.sort_by_key(|(p, _)| p.map_or(0, |p| p.offset));
                    // A shard several ranks hold (data-parallel replicas, a
                    // pipeline's tied copy) is taken once.
                    parts.dedup_by_key(|(p, _)| p.map(|p| p.offset));
                    let ts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
                    let t = Tensor::cat(&ts, s.dim)?;
                    if t.dims().get(s.dim) != Some(&s.global) {
                        return Err(Error::Usage(format!(
                            "gather_whole: the shards of {name} cover {:?} of {} along dimension {}",
                            t.dims().get(s.dim),
                            s.global,
                            s.dim
                        )));
                    }
                    t
                }
            };
            whole.insert(name, t);
        }
        Ok(Some(whole))
    }
}
