//! What the graph holds between a forward and its backward, counted by the
//! heap (this binary's global allocator is the counting one): an
//! input-channel-split convolution on sharded activations keeps its input
//! shard and its output shard, never the whole-sized partial sums it
//! reduce-scatters. Both kernel paths (CI runs the tests both ways).

use candle_core::{DType, Tensor, Var};
use shardnet::functions::{reduce_scatter, Context};
use shardnet::heap::{self, CountingAllocator};
use shardnet::links::{ConvConfig, InputParallelConv2d};
use shardnet::nn::ParamStore;
use shardnet::ReduceOp;
use std::sync::Mutex;

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator;

/// Images, input and output channels, side.
const B: usize = 4;
const C: usize = 8;
const O: usize = 64;
const S: usize = 16;

/// The heap's live bytes that 2 thread ranks' forwards leave behind
/// (summed over both, the graphs kept), each rank's layer run by `forward`
/// on its input shard: the least of 3 forwards, so that a buffer a thread
/// makes once and keeps (the GEMMs' packing space of a thread that had no
/// work before) is not taken for what the graph holds.
fn held_by_forward(
    forward: fn(&InputParallelConv2d, &Context, &Tensor) -> shardnet::Result<Tensor>,
) -> u64 {
    let held = Mutex::new(Vec::new());
    let outs = shardnet::comm::launch(2, |comm| {
        let ctx = Context::new(&comm);
        let store = ParamStore::new(comm.device(), 3);
        let conv = InputParallelConv2d::new_sharded(
            &ctx,
            &store.pp("conv"),
            (C, O),
            ConvConfig::new().with_bias(false),
        )?;
        let x = Var::randn(0f32, 1., (B, C / 2, S, S), comm.device())?;
        let x = x.as_tensor();
        // A first pass: whatever is made once (buffers, thread pools) is
        // made before the count starts.
        forward(&conv, &ctx, x)?.sum_all()?.backward()?;
        let mut dims = Vec::new();
        for _ in 0..3 {
            comm.barrier()?;
            let before = heap::live_bytes().unwrap();
            comm.barrier()?;
            let y = forward(&conv, &ctx, x)?;
            comm.barrier()?;
            if comm.rank() == 0 {
                let after = heap::live_bytes().unwrap();
                held.lock().unwrap().push(after.saturating_sub(before));
            }
            comm.barrier()?;
            y.sum_all()?.backward()?;
            dims = y.dims().to_vec();
        }
        Ok(dims)
    })
    .unwrap();
    assert!(outs.iter().all(|d| d == &[B, O / 2, S, S]));
    let held = held.lock().unwrap();
    held.iter().copied().min().unwrap()
}

#[test]
fn an_input_split_convolution_keeps_no_whole_partial_sums() {
    let f32s = |n: usize| (n * DType::F32.size_in_bytes()) as u64;
    let shard = f32s(B * (O / 2) * S * S);
    let whole = f32s(B * O * S * S);
    let held = held_by_forward(|conv, _, x| conv.forward(x));
    // Each rank's output shard, and little else.
    assert!(
        held < 2 * shard + whole / 4,
        "the forward left {held} bytes live: more than the 2 output shards ({shard} each)"
    );
    // The same layer with the partial sums reduce-scattered by the plain
    // collective (which keeps its input for the graph): the count sees them.
    let plain = held_by_forward(|conv, ctx, x| {
        reduce_scatter(ctx, &conv.conv.forward(x)?, ReduceOp::Sum, 1)
    });
    assert!(
        plain >= 2 * (shard + whole),
        "the plain reduce-scatter's graph held {plain} bytes, expected at least {}",
        2 * (shard + whole)
    );
}
