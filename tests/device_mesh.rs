//! Chainer's MnistMLPParallel written as one program over a `DeviceMesh`
//! (sub-modules placed on ranks 0 and 1, copies inserted by the mesh): on 2
//! thread ranks it trains exactly what it trains on 1.

use candle_core::{DType, Tensor};
use shardnet::comm::launch_with_timeout;
use shardnet::functions::Context;
use shardnet::links::DeviceMesh;
use shardnet::nn::{Linear, ParamStore};
use shardnet::optim::Adam;
use std::collections::BTreeMap;
use std::time::Duration;

/// Chainer's `MnistMLP`: three layers, relu after the first two.
struct Mlp([Linear; 3]);

impl Mlp {
    fn new(store: &ParamStore, name: &str, layer: usize, d: [usize; 4]) -> shardnet::Result<Self> {
        let l = |k: usize| store.linear(&format!("{name}.l{k}"), layer + k, d[k], d[k + 1]);
        Ok(Mlp([l(0)?, l(1)?, l(2)?]))
    }
    fn forward(&self, x: &Tensor) -> shardnet::Result<Tensor> {
        let h = self.0[0].forward(x)?.relu()?;
        let h = self.0[1].forward(&h)?.relu()?;
        self.0[2].forward(&h)
    }
}

fn train(ranks: usize) -> (BTreeMap<String, Tensor>, Vec<f32>) {
    let (n_in, u, n_out) = (12, 8, 3);
    let out = launch_with_timeout(ranks, Duration::from_secs(30), |comm| {
        let ctx = Context::new(&comm);
        let store = ParamStore::new(comm.device(), 5);
        let mesh = DeviceMesh::new(&ctx, &store);
        // The model as Chainer's example writes it.
        let first0 = mesh.on(0, |s| Mlp::new(s, "first0", 0, [n_in, u / 2, u / 2, u]))?;
        let first1 = mesh.on(1, |s| Mlp::new(s, "first1", 3, [n_in, u / 2, u / 2, u]))?;
        let second0 = mesh.on(0, |s| Mlp::new(s, "second0", 6, [u, u / 2, u / 2, n_out]))?;
        let second1 = mesh.on(1, |s| Mlp::new(s, "second1", 9, [u, u / 2, u / 2, n_out]))?;
        let mut opt = Adam::new(store.params(), 1e-2)?;
        let mut losses = Vec::new();
        for step in 0..4u32 {
            let x = Tensor::arange(0f32, (6 * n_in) as f32, &candle_core::Device::Cpu)?
                .reshape((6, n_in))?
                .affine(0.01, step as f64 * 0.1)?
                .sin()?;
            let t = Tensor::new(&[0u32, 1, 2, 0, 1, 2], &candle_core::Device::Cpu)?;
            let x = mesh.input(0, Some(&x))?;
            let z0 = mesh.run(&first0, &x, |m, x| m.forward(x))?;
            let z1 = mesh.run(&first1, &x, |m, x| m.forward(x))?;
            let h0 = mesh.add(&z0, &z1)?;
            let h1 = mesh.add(&z1, &z0)?;
            let y0 = mesh.run(&second0, &mesh.map(&h0, |h| Ok(h.relu()?))?, |m, h| {
                m.forward(h)
            })?;
            let y1 = mesh.run(&second1, &mesh.map(&h1, |h| Ok(h.relu()?))?, |m, h| {
                m.forward(h)
            })?;
            let y = mesh.add(&y0, &y1)?;
            let loss = mesh.map(&y, |y| Ok(candle_nn::loss::cross_entropy(y, &t)?))?;
            if let Some(l) = &loss.value {
                losses.push(l.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            }
            if let Some(mut g) = mesh.backward(&loss)? {
                store.absorb(&mut g)?;
            }
            opt.step()?;
        }
        Ok((store.gather_whole(&ctx)?, losses))
    })
    .unwrap();
    let (params, losses) = out.into_iter().next().unwrap();
    (params.unwrap(), losses)
}

#[test]
fn mnist_mlp_parallel_over_a_mesh_of_two_equals_one() {
    let (one, l1) = train(1);
    let (two, l2) = train(2);
    assert_eq!(one.len(), 24);
    assert_eq!(l1, l2);
    for (k, v) in &one {
        let e = shardnet_conformance::max_rel(&two[k], v).unwrap();
        assert!(e <= 1e-6, "{k}: {e:e}");
    }
    assert!(l1[3] < l1[0], "{l1:?}");
}
