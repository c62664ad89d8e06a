//! The sharded classifier on the local backend (1–4 thread ranks): every
//! case of `conformance::head` against the one-device head.

use shardnet::conformance::head::cases;
use shardnet::conformance::run_local;
use std::time::Duration;

#[test]
fn every_case_on_one_to_four_ranks() {
    let failures = run_local(cases, 4, Duration::from_secs(20));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A head built from a user's whole weight (each rank its rows, made with
/// `Param::new`) gives back that weight and its whole gradient through
/// `whole`, equal on 1–4 ranks to one rank's.
#[test]
fn a_head_from_a_users_weight_gathers_its_whole_gradient() {
    use candle_core::DType;
    use shardnet::conformance::{max_rel, seeded};
    use shardnet::functions::{copy_to_shards, Context, Margin};
    use shardnet::links::ShardedClassifier;
    use shardnet::nn::Param;
    const C: usize = 5;
    const D: usize = 4;
    let run = |n: usize| {
        shardnet::comm::launch(n, |comm| {
            let ctx = Context::new(&comm);
            let whole = seeded(3, &[C, D], DType::F32)?;
            let rows = shardnet::comm::chunk_range(C, comm.size(), comm.rank());
            let w = Param::new("head.weight", &whole.narrow(0, rows.start, rows.len())?)?;
            let head = ShardedClassifier::from_weight(&comm, C, w, Margin::None, 1)?;
            let x = copy_to_shards(&ctx, &seeded(4, &[3, D], DType::F32)?)?;
            head.forward(&x, &[0, 4, 2])?.loss.backward()?;
            let got = head.whole(Some(comm.size() - 1))?;
            Ok((whole, got))
        })
        .unwrap()
    };
    let one = run(1).pop().unwrap().1.unwrap();
    for n in 1..=4 {
        let outs = run(n);
        for (r, (given, got)) in outs.into_iter().enumerate() {
            if r + 1 < n {
                assert!(got.is_none(), "{n} ranks: rank {r} got the whole");
                continue;
            }
            let got = got.expect("the last rank gets the whole head");
            assert_eq!(max_rel(&got.weight, &given).unwrap(), 0.0);
            let (g, g1) = (got.weight_grad.unwrap(), one.weight_grad.clone().unwrap());
            assert_eq!(g.dims(), &[C, D]);
            assert!(max_rel(&g, &g1).unwrap() < 1e-6, "{n} ranks");
        }
    }
}
