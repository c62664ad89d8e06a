//! ChainerMN's hierarchical communicator on the CPU: nodes made up with
//! `hierarchical_on`, every rank's result against the flat communicator's,
//! and `Setup` (`--device`, `--communicator`) refusing what this build lacks.

use candle_core::{DType, Tensor};
use proptest::prelude::*;
use shardnet::comm::{launch, Communicator, ReduceOp, Setup, HOST};
use shardnet::Error;

/// Rank r's tensor: distinct values on every rank (small integers, so that
/// a sum is exact in any order, and so the two communicators must agree
/// bit for bit), or a random-looking float in [-1, 1).
fn data(rank: usize, shape: &[usize], dtype: DType, integers: bool) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let k = (i * 7 + rank * 13 + 3) % 17;
            if integers {
                k as f32
            } else {
                let h = ((i as u64 + 1) * 0x9E37_79B9 + rank as u64 * 0x85EB_CA6B) % 10_007;
                h as f32 / 5003.5 - 1.0
            }
        })
        .collect();
    Tensor::from_vec(v, shape, &HOST)
        .and_then(|t| t.to_dtype(dtype))
        .expect("test tensor")
}

/// Every element, in f64.
fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a tensor's elements")
}

/// The layouts tried: `nodes[r]` is rank r's node.
fn layouts(n: usize) -> Vec<Vec<u32>> {
    let mut out = vec![vec![0; n], (0..n as u32).collect()];
    if n >= 3 {
        out.push((0..n).map(|r| (r / 2) as u32).collect());
        // Nodes of unequal sizes, ranks of one node not contiguous.
        out.push((0..n).map(|r| u32::from(r % 3 == 1)).collect());
    }
    out
}

fn compare(n: usize, nodes: &[u32], shape: &[usize], dtype: DType, op: ReduceOp, integers: bool) {
    let shape = shape.to_vec();
    let nodes = nodes.to_vec();
    let out = launch(n, |c: Communicator| {
        let h = c.hierarchical_on(nodes[c.rank()])?;
        assert_eq!(h.backend(), "hierarchical");
        let x = data(c.rank(), &shape, dtype, integers);
        let got = h.allreduce(&x, op)?;
        let want = c.allreduce(&x, op)?;
        Ok((got, want))
    })
    .expect("ranks");
    for (r, (got, want)) in out.iter().enumerate() {
        assert_eq!(got.dims(), want.dims(), "rank {r}: shape");
        assert_eq!(got.dtype(), want.dtype(), "rank {r}: dtype");
        let (g, w) = (f64s(got), f64s(want));
        // Integers: exact. Floats: f32 sums in another order, ~n ulp.
        let tol = match (integers, dtype) {
            (true, _) => 0.0,
            (false, DType::BF16) => 2e-2,
            (false, _) => 4e-6,
        };
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!(
                (a - b).abs() <= tol * b.abs().max(1.0),
                "rank {r} of {n}, nodes {nodes:?}, {op:?} {dtype:?} {shape:?}: element {i} is {a}, flat gives {b}"
            );
        }
    }
}

#[test]
fn allreduce_equals_the_flat_one_on_every_layout() {
    for n in 1..=4 {
        for nodes in layouts(n) {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean] {
                compare(n, &nodes, &[3, 5], DType::F32, op, true);
                compare(n, &nodes, &[7], DType::F32, op, false);
            }
            compare(n, &nodes, &[4, 2], DType::U32, ReduceOp::Sum, true);
            compare(n, &nodes, &[4, 2], DType::BF16, ReduceOp::Mean, false);
            compare(n, &nodes, &[0, 3], DType::F32, ReduceOp::Sum, true);
            compare(n, &nodes, &[], DType::F64, ReduceOp::Sum, false);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn allreduce_over_shapes_and_nodes(
        n in 1usize..=4,
        nodes in proptest::collection::vec(0u32..3, 4),
        shape in proptest::collection::vec(0usize..5, 0..3),
        op in prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Max), Just(ReduceOp::Mean)],
    ) {
        compare(n, &nodes[..n], &shape, DType::F32, op, false);
    }
}

/// Everything but allreduce is the world's backend: the same results.
#[test]
fn other_operations_are_the_world_backends() {
    for n in 1..=4 {
        let out = launch(n, |c: Communicator| {
            let h = c.hierarchical_on((c.rank() / 2) as u32)?;
            let r = c.rank();
            let x = data(r, &[r + 1, 3], DType::F32, false);
            let mut got = vec![h.allgather(&x)?, h.bcast(Some(&x).filter(|_| r == 0), 0)?];
            let mut want = vec![c.allgather(&x)?, c.bcast(Some(&x).filter(|_| r == 0), 0)?];
            let parts: Vec<Tensor> = (0..n)
                .map(|d| data(r * 10 + d, &[d + 1], DType::F32, true))
                .collect();
            got.extend(h.alltoall(&parts)?);
            want.extend(c.alltoall(&parts)?);
            let y = data(r, &[n + 1, 2], DType::F32, true);
            got.push(h.reduce_scatter(&y, ReduceOp::Sum)?);
            want.push(c.reduce_scatter(&y, ReduceOp::Sum)?);
            h.barrier()?;
            Ok((got, want, h.intra_size()))
        })
        .expect("ranks");
        for (r, (got, want, intra)) in out.iter().enumerate() {
            let node_size = (0..n).filter(|q| q / 2 == r / 2).count();
            assert_eq!(*intra, node_size, "rank {r}: ranks on its node");
            for (g, w) in got.iter().zip(want) {
                let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(g, w, "rank {r} of {n}");
            }
        }
    }
}

/// A rank that passes another shape: every rank, on every node, gets the
/// mismatch naming the ranks' shapes, and none hangs.
#[test]
fn a_mismatch_is_reported_on_every_rank() {
    let out = launch(4, |c: Communicator| {
        let h = c.hierarchical_on((c.rank() / 2) as u32)?;
        let len = if c.rank() == 3 { 5 } else { 4 };
        let x = Tensor::ones(len, DType::F32, &HOST)?;
        Ok(match h.allreduce(&x, ReduceOp::Sum) {
            Err(Error::Mismatch { op, details }) => format!("{op}: {details}"),
            other => format!("no mismatch: {other:?}"),
        })
    })
    .expect("ranks");
    for (r, msg) in out.iter().enumerate() {
        assert!(msg.starts_with("allreduce(sum)"), "rank {r}: {msg}");
        assert!(
            msg.contains("rank 3: allreduce(sum) f32 [5]"),
            "rank {r}: {msg}"
        );
    }
}

#[test]
fn setup_refuses_what_this_build_lacks() {
    let err = |d: &str, c: &str| {
        Setup::new(d, c)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(Setup::new("cpu", "host").is_ok());
    assert!(Setup::new("cpu", "hierarchical").is_ok());
    assert!(
        err("cpu", "nccl").contains("add --device cuda"),
        "{}",
        err("cpu", "nccl")
    );
    assert!(err("tpu", "host").contains("unknown device"));
    assert!(err("cpu", "gloo").contains("unknown communicator"));
    if cfg!(feature = "cuda") {
        assert!(Setup::new("cuda", "host").is_ok());
    } else {
        assert!(
            err("cuda", "host").contains("scripts/build-cuda.sh"),
            "{}",
            err("cuda", "host")
        );
    }
    if !cfg!(feature = "nccl") && cfg!(feature = "cuda") {
        assert!(err("cuda", "nccl").contains("nccl"));
    }
}
