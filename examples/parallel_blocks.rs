//! Chainer's two multi-device examples in a few lines each, with shardnet's
//! tensor-parallel blocks and collectives, trained briefly on MNIST on two
//! thread ranks (each its own device):
//!
//! - **MnistMLPParallel**: four half-width MLPs joined by copies. Each pair
//!   of MLPs (first0/first1, second0/second1) is a column-parallel layer
//!   (each rank its U/2 units), a block-diagonal layer (each rank its own,
//!   no communication) and a row-parallel layer summing both ranks' outputs
//!   (h = z0 + z1, with one bias where Chainer has two).
//! - **ParallelNIN**'s pattern: two whole networks, one per device, their
//!   outputs summed (an allreduce).
//!
//! Run: `cargo run --release --example parallel_blocks` (MNIST from
//! `SHARDNET_DATA`, else downloaded).

use candle_core::Tensor;
use shardnet::data::{mnist, synchronized_iterator, Dataset};
use shardnet::functions::{allreduce_replicated, top1_hits, Context};
use shardnet::links::{ColumnParallelLinear, Features, LinearConfig, RowParallelLinear};
use shardnet::nn::{Linear, ParamStore};
use shardnet::optim::Adam;
use shardnet::{Error, ReduceOp, Result};

const UNITS: usize = 1000;
const STEPS: usize = 300;

/// One of Chainer's MLP pairs: column → block-diagonal → row.
struct Pair(ColumnParallelLinear, Linear, RowParallelLinear);

impl Pair {
    fn new(
        ctx: &Context,
        store: &ParamStore,
        name: &str,
        layer: usize,
        dims: [usize; 2],
    ) -> Result<Self> {
        let (n, half) = (ctx.size(), UNITS / 2);
        let wide = half * n; // each rank its U/2 units, as each device in Chainer
        let between = LinearConfig::new().with_features(Features::Sharded);
        let local = store.linear(&format!("{name}.l2"), layer + 1, half, half)?;
        Ok(Pair(
            ColumnParallelLinear::new(
                ctx,
                &store.pp(&format!("{name}.l1")),
                dims[0],
                wide,
                between.with_layer(layer),
            )?,
            local,
            RowParallelLinear::new(
                ctx,
                &store.pp(&format!("{name}.l3")),
                wide,
                dims[1],
                between.with_layer(layer + 2),
            )?,
        ))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.1.forward(&self.0.forward(x)?.relu()?)?.relu()?;
        self.2.forward(&h)
    }
}

enum Model {
    /// MnistMLPParallel: the first pair, relu, the second pair.
    MlpParallel(Box<(Pair, Pair)>),
    /// ParallelNIN's pattern: this rank's whole network.
    Replica(Box<(Linear, Linear)>),
}

impl Model {
    fn forward(&self, ctx: &Context, x: &Tensor) -> Result<Tensor> {
        match self {
            Model::MlpParallel(pairs) => pairs.1.forward(&pairs.0.forward(x)?.relu()?),
            Model::Replica(net) => {
                let y = net.1.forward(&net.0.forward(x)?.relu()?)?;
                allreduce_replicated(ctx, &y, ReduceOp::Sum)
            }
        }
    }
}

fn main() -> Result<()> {
    for (name, mlp) in [
        ("MnistMLPParallel with tensor-parallel blocks", true),
        ("ParallelNIN's two summed replicas", false),
    ] {
        let acc = shardnet::comm::launch(2, |comm| {
            let ctx = Context::new(&comm);
            // The block-diagonal layers and the replicas differ per rank:
            // their seed does.
            let store = ParamStore::new(comm.device(), 1 + comm.rank() as u64);
            let model = if mlp {
                Model::MlpParallel(Box::new((
                    Pair::new(&ctx, &store, "first", 0, [784, UNITS])?,
                    Pair::new(&ctx, &store, "second", 10, [UNITS, 10])?,
                )))
            } else {
                Model::Replica(Box::new((
                    store.linear("l1", 0, 784, 256)?,
                    store.linear("l2", 1, 256, 10)?,
                )))
            };
            let mut opt = Adam::new(store.params(), 1e-3)?;
            let (train, test) = mnist(None)?;
            let mut it = synchronized_iterator(&comm, train.len(), 100, 0)?;
            for _ in 0..STEPS {
                let b = train.batch(&it.next_indices())?;
                let (Some(x), Some(t)) = (b.x, b.t) else {
                    return Err(Error::Usage("a batch without data".into()));
                };
                let loss = candle_nn::loss::cross_entropy(&model.forward(&ctx, &x)?, &t)?;
                store.absorb(&mut loss.backward()?)?;
                opt.step()?;
            }
            let _eval = ctx.no_grad();
            let y = model.forward(&ctx, &test.x)?;
            Ok(top1_hits(&y, &test.t)? as f64 / test.len() as f64)
        })?;
        println!(
            "{name}: test accuracy after {STEPS} steps: {:.2}%",
            acc[0] * 100.0
        );
    }
    Ok(())
}
