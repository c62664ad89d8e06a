//! The tensor-parallel layers on the local backend (1–4 thread ranks): every
//! case of `conformance::tensor_parallel` against the one-device layers.

mod common;
use shardnet_conformance::tensor_parallel::cases;

fn main() {
    common::conformance_suite(
        cases,
        4,
        &[(
            "embedding_takes_ids_of_any_shape_like_candle_nn",
            embedding_takes_ids_of_any_shape_like_candle_nn,
        )],
    );
}

/// `VocabParallelEmbedding` takes ids of any shape, as candle-nn's
/// `Embedding` does: (2, 3) ids of u32 and i64 give (2, 3, D), equal to
/// candle-nn's on the whole table, with the whole table's gradient
/// gathered from the shards; out-of-range and float ids are refused.
fn embedding_takes_ids_of_any_shape_like_candle_nn() {
    use candle_core::{DType, Module, Tensor, Var};
    use shardnet::functions::Context;
    use shardnet::links::VocabParallelEmbedding;
    use shardnet::nn::ParamStore;
    use shardnet_conformance::seeded;
    const V: usize = 7;
    const D: usize = 4;
    for n in 1..=4 {
        let outs = shardnet::comm::launch(n, |comm| {
            let ctx = Context::new(&comm);
            let store = ParamStore::new(comm.device(), 3);
            let table = seeded(1, &[V, D], DType::F32)?;
            let emb = VocabParallelEmbedding::from_weights(&ctx, &store.pp("emb"), &table)?;
            let ids = Tensor::new(&[[0u32, 6, 3], [3, 1, 5]], comm.device())?;
            let y = emb.forward(&ids)?;
            let v = seeded(2, &[2, 3, D], DType::F32)?;
            y.mul(&v)?.sum_all()?.backward()?;
            let whole = emb.whole(Some(0))?;
            let _eval = ctx.no_grad();
            let y64 = emb.forward(&ids.to_dtype(DType::I64)?)?;
            let bad = emb
                .forward(&Tensor::new(&[[7u32]], comm.device())?)
                .is_err()
                && emb.forward(&ids.to_dtype(DType::F32)?).is_err();
            Ok((y, y64, whole, bad))
        })
        .unwrap();
        // candle-nn on the whole table.
        let table = Var::from_tensor(&seeded(1, &[V, D], DType::F32).unwrap()).unwrap();
        let reference = candle_nn::Embedding::new(table.as_tensor().clone(), D);
        let ids = Tensor::new(&[[0u32, 6, 3], [3, 1, 5]], &shardnet::comm::HOST).unwrap();
        let want = reference.forward(&ids).unwrap();
        let v = seeded(2, &[2, 3, D], DType::F32).unwrap();
        let g = want.mul(&v).unwrap().sum_all().unwrap().backward().unwrap();
        let want_dw = g.get(table.as_tensor()).unwrap();
        for (r, (y, y64, whole, bad)) in outs.into_iter().enumerate() {
            assert_eq!(y.dims(), &[2, 3, D], "{n} ranks, rank {r}");
            assert!(shardnet_conformance::max_rel(&y, &want).unwrap() < 1e-6);
            assert!(shardnet_conformance::max_rel(&y64, &want).unwrap() < 1e-6);
            assert!(bad, "{n} ranks, rank {r}: a bad id was accepted");
            match (r, whole) {
                (0, Some(w)) => {
                    let dw = w.weight_grad.expect("the whole gradient");
                    assert!(shardnet_conformance::max_rel(&dw, want_dw).unwrap() < 1e-6);
                }
                (0, None) => panic!("rank 0 got no whole table"),
                (_, w) => assert!(w.is_none()),
            }
        }
    }
}
