//! The sharded classifier on the local backend (1–4 thread ranks): every
//! case of `conformance::head` against the one-device head.

use shardnet_conformance::head::cases;
use shardnet_conformance::run_local;
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
    use shardnet::functions::{copy_to_shards, Context, Margin};
    use shardnet::links::ShardedClassifier;
    use shardnet::nn::Param;
    use shardnet_conformance::{max_rel, seeded};
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

/// The logits buffer a rank's thread keeps from one step to the next
/// (large heads would otherwise have it faulted in and zeroed every step)
/// changes nothing: heads of several sizes, in f32 and bf16 logits, with an
/// evaluation between steps, give on one thread bit for bit what each gives
/// alone on a fresh one.
#[test]
fn the_logits_buffer_kept_between_steps_changes_nothing() {
    use candle_core::DType;
    use shardnet::functions::{copy_to_shards, Context, Margin};
    use shardnet::links::ShardedClassifier;
    use shardnet_conformance::seeded;
    const D: usize = 8;
    // (classes, batch, train or evaluate): more than one class block, then
    // fewer classes, an evaluation, and the first again.
    let calls: [(usize, usize, bool); 5] = [
        (2500, 5, true),
        (7, 3, true),
        (2500, 5, false),
        (2500, 5, true),
        (7, 3, true),
    ];
    type Out = (Vec<f32>, Option<Vec<f32>>);
    let one = |comm: &shardnet::comm::Communicator,
               logits: DType,
               (c, b, train): (usize, usize, bool)|
     -> shardnet::Result<Out> {
        let ctx = Context::new(comm);
        let mut head = ShardedClassifier::new(comm, c, D, Margin::None, 5)?;
        head.logits = logits;
        let x = copy_to_shards(&ctx, &seeded(6, &[b, D], DType::F32)?)?;
        let labels: Vec<u32> = (0..b as u32).map(|i| (i * 997) % c as u32).collect();
        if !train {
            let out = head.evaluate(&x, &labels)?;
            return Ok((out.loss.flatten_all()?.to_vec1()?, None));
        }
        let out = head.forward(&x, &labels)?;
        out.loss.backward()?;
        let grad = head.whole(Some(0))?.and_then(|w| w.weight_grad);
        let grad = grad.map(|g| g.flatten_all().and_then(|g| g.to_vec1::<f32>()));
        Ok((out.loss.flatten_all()?.to_vec1()?, grad.transpose()?))
    };
    for logits in [DType::F32, DType::BF16] {
        let together = shardnet::comm::launch(1, |comm| {
            calls
                .iter()
                .map(|&call| one(&comm, logits, call))
                .collect::<shardnet::Result<Vec<Out>>>()
        })
        .unwrap()
        .pop()
        .unwrap();
        for (i, &call) in calls.iter().enumerate() {
            let alone = shardnet::comm::launch(1, |comm| one(&comm, logits, call))
                .unwrap()
                .pop()
                .unwrap();
            assert_eq!(together[i], alone, "{logits:?} logits, call {i} {call:?}");
        }
    }
}

/// Two heads in one model are told apart by name: `named` gives
/// `{name}.weight`, `new` `head.weight`, and one store holds both (it
/// refuses two parameters of one name).
#[test]
fn two_heads_in_one_store_have_their_own_names() {
    use shardnet::functions::Margin;
    use shardnet::links::ShardedClassifier;
    use shardnet::nn::ParamStore;
    shardnet::comm::launch(2, |comm| {
        let a = ShardedClassifier::new(&comm, 10, 4, Margin::None, 0)?;
        let b = ShardedClassifier::named(&comm, "tower2.head", 10, 4, Margin::None, 0)?;
        assert_eq!(a.weight.name(), "head.weight");
        assert_eq!(b.weight.name(), "tower2.head.weight");
        let store = ParamStore::new(comm.device(), 0);
        store.register(a.weight.clone())?;
        store.register(b.weight.clone())?;
        assert!(store.register(a.weight.clone()).is_err());
        Ok(())
    })
    .unwrap();
}
