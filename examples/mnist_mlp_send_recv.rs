//! ChainerMN's model-parallel MLP example, one-to-one: MLP0 on rank 0 and MLP1 on rank 1,
//! wired by explicit `send` / `recv` with a delegate variable.
//! (`shardnet train mnist-mlp` is the same model written with
//! `MultiNodeChainList`.)
//!
//!     cargo run --release --example mnist_mlp_send_recv -- [DATA_DIR]

use candle_core::{DType, Device, Tensor};
use shardnet::comm::launch;
use shardnet::data::{mnist, synchronized_iterator, Dataset, EmptyDataset};
use shardnet::functions::Context;
use shardnet::functions::{recv, send};
use shardnet::nn::{Linear, Param};
use shardnet::optim::Adam;
use shardnet::Result;

fn linear(name: &str, i: usize, o: usize) -> Result<Linear> {
    let bound = 1.0 / (i as f64).sqrt();
    let w = (Tensor::rand(-1f32, 1.0, (o, i), &Device::Cpu)? * bound)?;
    let b = (Tensor::rand(-1f32, 1.0, o, &Device::Cpu)? * bound)?;
    Ok(Linear::new(
        Param::new(format!("{name}.weight"), &w)?,
        Some(Param::new(format!("{name}.bias"), &b)?),
    ))
}

/// Rank 0: h0 = relu(l1(x)); phi = send(h0, rank 1); y = recv(rank 1, phi).
struct Mlp0 {
    comm: Context,
    l1: Linear,
}

impl Mlp0 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h0 = self.l1.forward(x)?.relu()?;
        let phi = send(&h0, &self.comm, 1)?;
        // Note: do not forget to pass the delegate variable.
        recv(&self.comm, 1, Some(&phi))
    }
}

/// Rank 1: h0 = recv(rank 0); return send(l3(relu(l2(h0))), rank 0).
struct Mlp1 {
    comm: Context,
    l2: Linear,
    l3: Linear,
}

impl Mlp1 {
    fn forward(&self) -> Result<Tensor> {
        let h0 = recv(&self.comm, 0, None)?;
        let h1 = self.l2.forward(&h0)?.relu()?;
        // The delegate is returned: backward starts from it.
        send(&self.l3.forward(&h1)?, &self.comm, 0)
    }
}

fn main() -> Result<()> {
    shardnet::tune_allocator();
    shardnet::tune_candle_pool();
    let dir = std::env::args().nth(1).map(std::path::PathBuf::from);
    let (n_units, batch) = (100, 100);
    let acc = launch(2, |comm| {
        let comm = Context::new(&comm);
        let data = if comm.rank() == 0 {
            Some(mnist(dir.as_deref())?)
        } else {
            None
        };
        let len = comm.bcast_obj(data.as_ref().map(|(tr, _)| tr.len()).as_ref(), 0)?;
        let mut it = synchronized_iterator(&comm, len, batch, 0)?;
        if comm.rank() == 0 {
            let (train, test) = data.expect("rank 0 loaded MNIST");
            let model = Mlp0 {
                comm: comm.clone(),
                l1: linear("l1", 784, n_units)?,
            };
            let mut opt = Adam::new(model.l1.params(), 1e-3)?;
            for _ in 0..it.batches_per_epoch() {
                let b = it.next_batch(&train)?;
                let y = model.forward(b.x.as_ref().expect("data"))?;
                candle_nn::loss::cross_entropy(&y, b.t.as_ref().expect("labels"))?.backward()?;
                opt.step()?;
            }
            let _eval = comm.no_grad();
            let y = model.forward(&test.x)?;
            let correct = y
                .argmax(1)?
                .eq(&test.t)?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
            Ok(correct / test.len() as f64)
        } else {
            let model = Mlp1 {
                comm: comm.clone(),
                l2: linear("l2", n_units, n_units)?,
                l3: linear("l3", n_units, 10)?,
            };
            let mut opt = Adam::new([model.l2.params(), model.l3.params()].concat(), 1e-3)?;
            let empty = EmptyDataset::new(len);
            for _ in 0..it.batches_per_epoch() {
                it.next_batch(&empty)?;
                model.forward()?.backward()?;
                opt.step()?;
            }
            let _eval = comm.no_grad();
            model.forward()?;
            Ok(0.0)
        }
    })?;
    println!(
        "one epoch, explicit send/recv on 2 ranks: test accuracy {:.2}%",
        acc[0] * 100.0
    );
    Ok(())
}
