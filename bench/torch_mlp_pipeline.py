#!/usr/bin/env python3
"""PyTorch (CPU, gloo) baseline for shardnet's seed-001 model-parallel MLP.

Measures training throughput (samples/s, ms per optimizer step) of an MLP on
MNIST-shaped synthetic data, split into S pipeline stages, one stage per
process, with explicit point-to-point send/recv of activations (forward) and
gradients (backward) over torch.distributed's gloo backend.  Timing is about
throughput only: the data are random (B x 784 float32 inputs, labels 0..9),
generated once and reused every step.

Model and split
---------------
The model has K = --model-stages stages (default: max(S, 2)), i.e. K+1 Linear
layers with ReLU between them:

    Linear(784,U) ReLU | Linear(U,U) ReLU | ... | Linear(U,U) ReLU Linear(U,10)
    \\__ stage 0 ____/   \\_ stage 1 ___/         \\_ stage K-1 ______________/

    stage 0         : Linear(784, U) + ReLU           (+ softmax cross-entropy)
    stage 1..K-2    : Linear(U, U) + ReLU             (one each)
    stage K-1       : Linear(U, U) + ReLU + Linear(U, 10)   -> logits

For S = 2 this is exactly ChainerMN's model-parallel MLP example: rank 0 holds Linear(784,U)+ReLU and the
loss, rank 1 holds Linear(U,U)+ReLU+Linear(U,10) and sends the logits back to
rank 0, which computes the loss.  For S > 2, rank k holds stage k and the
logits go from rank S-1 back to rank 0 for the loss.

--stages 1 runs the whole K-stage model in one process with no communication
(the "1 rank" row).  By default K = 2 then, i.e. the same 3-layer model as
--stages 2; use e.g. `--stages 1 --model-stages 4` for the model that
`--stages 4` pipelines.  With S > 1 and K > S, the K stages are spread over
the S ranks in contiguous runs, the first K % S ranks holding one more.

All ranks build the full model from --seed and keep only their stage, so the
initial weights (and hence the loss trajectory) are identical for every S and
M with the same K and seed.

Pipeline schedule (GPipe)
-------------------------
The batch of B samples is split into M micro-batches (torch.tensor_split,
so sizes may differ by one when M does not divide B).  Per optimizer step:

  * every rank first posts all its irecv()s for the step (activations in,
    gradients in), so data arrive while it computes;
  * forward: rank 0 computes stage 0 for micro-batch 0..M-1, isend()ing each
    activation to rank 1 without waiting; rank k waits for input i, makes it
    requires_grad, computes, isend()s the output to rank k+1 (rank S-1 sends
    the logits to rank 0).  So rank k works on micro-batch i while rank k+1
    works on i-1.  Rank 0 then takes the logits i in order, computes
    loss_i = sum-cross-entropy(logits_i, y_i) / B (so sum_i loss_i is the mean
    over the whole batch and the gradients equal the unsplit batch's), calls
    loss_i.backward() and isend()s logits_i.grad to rank S-1;
  * backward (after all of this rank's forwards): rank k waits for the
    gradient of its output i, calls torch.autograd.backward(output_i, grad),
    and isend()s input_i.grad to rank k-1; rank 0 ends with
    torch.autograd.backward(h_i, grad_i).  Gradients accumulate over the M
    micro-batches in .grad;
  * each rank waits for its outstanding isend()s, then takes one Adam step
    (lr --lr, default 1e-3) on its own parameters.

Tags: the activation (or logits) of micro-batch i has tag i, the gradient of
micro-batch i has tag M + i, so the two directions of a pair never mix.

Timing: --warmup untimed steps, a barrier, --steps timed steps, a barrier;
rank 0 takes the wall time between the barriers.
samples_per_s = steps * B / time, step_ms = time / steps * 1000.

Launch
------
Self-spawning (S processes via torch.multiprocessing, MASTER_ADDR=127.0.0.1,
a free port):

    python3 bench/torch_mlp_pipeline.py --stages 2 --units 100 --threads 1

Under torchrun (WORLD_SIZE is taken as S; --stages, if given, must match):

    torchrun --standalone --nproc-per-node 2 bench/torch_mlp_pipeline.py \\
        --stages 2 --units 100 --threads 1

Output: rank 0 prints one JSON line, e.g.
{"framework": "pytorch", "torch": "2.x", "stages": 2, "units": 100,
 "batch_size": 100, "micro_batches": 1, "threads": 1, "steps": 50,
 "samples_per_s": ..., "step_ms": ..., ...}
plus a few extra keys (model_stages, warmup, first_loss, last_loss, pinned).
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 784
CLASSES = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch gloo pipeline baseline for shardnet's seed-001 MLP")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeline stages = processes (default 2; WORLD_SIZE under torchrun)")
    p.add_argument("--model-stages", type=int, default=None,
                   help="stages of the model (default max(S,2)); only differs from S when S=1")
    p.add_argument("--units", type=int, default=100, help="hidden width U")
    p.add_argument("--batch-size", type=int, default=100, help="batch size B")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="GPipe micro-batches per batch M")
    p.add_argument("--steps", type=int, default=50, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads per process")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pin", action="store_true",
                   help="pin rank r to CPU r mod ncpu (os.sched_setaffinity)")
    a = p.parse_args(argv)

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        ws = int(os.environ["WORLD_SIZE"])
        if a.stages is not None and a.stages != ws:
            p.error(f"--stages {a.stages} != WORLD_SIZE {ws}")
        a.stages = ws
    elif a.stages is None:
        a.stages = 2
    a.under_torchrun = under_torchrun

    if a.stages < 1:
        p.error("--stages must be >= 1")
    if a.model_stages is None:
        a.model_stages = max(a.stages, 2)
    if a.model_stages < 2:
        p.error("--model-stages must be >= 2")
    if a.stages > 1 and a.model_stages < a.stages:
        p.error("--model-stages must be at least --stages")
    if not 1 <= a.micro_batches <= a.batch_size:
        p.error("need 1 <= --micro-batches <= --batch-size")
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        p.error("need --steps >= 1, --warmup >= 0, --threads >= 1")
    return a


def build_stages(K, U, seed):
    """The full K-stage model, identical on every rank (same seed)."""
    torch.manual_seed(seed)
    stages = [nn.Sequential(nn.Linear(IN_FEATURES, U), nn.ReLU())]
    for _ in range(1, K - 1):
        stages.append(nn.Sequential(nn.Linear(U, U), nn.ReLU()))
    stages.append(nn.Sequential(nn.Linear(U, U), nn.ReLU(), nn.Linear(U, CLASSES)))
    return stages


def make_data(B, seed):
    g = torch.Generator().manual_seed(seed + 12345)
    x = torch.rand(B, IN_FEATURES, generator=g, dtype=torch.float32)
    y = torch.randint(0, CLASSES, (B,), generator=g)
    return x, y


def micro_sizes(B, M):
    return [t.numel() for t in torch.tensor_split(torch.arange(B), M)]


# ---------------------------------------------------------------------------
# one optimizer step
# ---------------------------------------------------------------------------

def step_single(model, opt, xs, ys, B):
    """Whole model in one process; micro-batches = gradient accumulation."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x), y, reduction="sum") / B
        loss.backward()
        total += loss.item()
    opt.step()
    return total


def step_pipeline(rank, S, stage, opt, xs, ys, B, U, sizes):
    M = len(sizes)
    opt.zero_grad(set_to_none=True)
    sends = []
    total = 0.0
    last = S - 1
    prev_rank = rank - 1          # input comes from here (rank > 0)
    next_rank = (rank + 1) % S    # output goes here (S-1 -> 0: logits)

    if rank == 0:
        # post all receives: logits from S-1, grads of h from 1
        logit_bufs = [torch.empty(m, CLASSES) for m in sizes]
        gh_bufs = [torch.empty(m, U) for m in sizes]
        logit_req = [dist.irecv(logit_bufs[i], src=last, tag=i) for i in range(M)]
        gh_req = [dist.irecv(gh_bufs[i], src=1, tag=M + i) for i in range(M)]

        hs = []
        for i in range(M):                      # forward of stage 0
            h = stage(xs[i])
            hs.append(h)
            sends.append(dist.isend(h.detach(), dst=1, tag=i))
        for i in range(M):                      # loss as logits arrive
            logit_req[i].wait()
            logits = logit_bufs[i].requires_grad_()
            loss = F.cross_entropy(logits, ys[i], reduction="sum") / B
            loss.backward()
            total += loss.item()
            sends.append(dist.isend(logits.grad, dst=last, tag=M + i))
        for i in range(M):                      # backward of stage 0
            gh_req[i].wait()
            torch.autograd.backward(hs[i], gh_bufs[i])
    else:
        out_features = CLASSES if rank == last else U
        in_bufs = [torch.empty(m, U) for m in sizes]
        g_bufs = [torch.empty(m, out_features) for m in sizes]
        in_req = [dist.irecv(in_bufs[i], src=prev_rank, tag=i) for i in range(M)]
        g_req = [dist.irecv(g_bufs[i], src=next_rank, tag=M + i) for i in range(M)]

        ins, outs = [], []
        for i in range(M):                      # forward
            in_req[i].wait()
            inp = in_bufs[i].requires_grad_()
            out = stage(inp)
            ins.append(inp)
            outs.append(out)
            sends.append(dist.isend(out.detach(), dst=next_rank, tag=i))
        for i in range(M):                      # backward
            g_req[i].wait()
            torch.autograd.backward(outs[i], g_bufs[i])
            sends.append(dist.isend(ins[i].grad, dst=prev_rank, tag=M + i))

    for w in sends:
        w.wait()
    opt.step()
    return total


# ---------------------------------------------------------------------------
# per-process driver
# ---------------------------------------------------------------------------

def run(rank, a, port):
    S = a.stages
    if a.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    if S > 1 and not a.under_torchrun:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    if S > 1:
        if a.under_torchrun:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", rank=rank, world_size=S)
        assert dist.get_rank() == rank

    B, M, U = a.batch_size, a.micro_batches, a.units
    stages = build_stages(a.model_stages, U, a.seed)
    sizes = micro_sizes(B, M)
    xs = ys = None
    if rank == 0:
        x, y = make_data(B, a.seed)
        xs = list(torch.tensor_split(x, M))
        ys = list(torch.tensor_split(y, M))

    if S == 1:
        model = nn.Sequential(*stages)
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)

        def one_step():
            return step_single(model, opt, xs, ys, B)
    else:
        # K stages over S ranks in contiguous runs, the first K % S ranks
        # holding one more (as shardnet's chunk_sizes).
        counts = [a.model_stages // S + (1 if r < a.model_stages % S else 0) for r in range(S)]
        first = sum(counts[:rank])
        stage = nn.Sequential(*stages[first:first + counts[rank]])
        del stages
        opt = torch.optim.Adam(stage.parameters(), lr=a.lr)

        def one_step():
            return step_pipeline(rank, S, stage, opt, xs, ys, B, U, sizes)

    first_loss = None
    for _ in range(a.warmup):
        l = one_step()
        if first_loss is None:
            first_loss = l
    if S > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        l = one_step()
        if first_loss is None:
            first_loss = l
    if S > 1:
        dist.barrier()
    elapsed = time.perf_counter() - t0

    if rank == 0:
        print(json.dumps({
            "framework": "pytorch",
            "torch": torch.__version__,
            "stages": S,
            "units": U,
            "batch_size": B,
            "micro_batches": M,
            "threads": a.threads,
            "steps": a.steps,
            "samples_per_s": round(a.steps * B / elapsed, 2),
            "step_ms": round(elapsed / a.steps * 1000.0, 4),
            "model_stages": a.model_stages,
            "warmup": a.warmup,
            "first_loss": round(first_loss, 6),
            "last_loss": round(l, 6),
            "pinned": bool(a.pin),
        }), flush=True)
    if S > 1:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    a = parse_args()
    if a.under_torchrun:
        run(int(os.environ["RANK"]), a, None)
    elif a.stages == 1:
        run(0, a, None)
    else:
        mp.spawn(run, args=(a, free_port()), nprocs=a.stages, join=True)


if __name__ == "__main__":
    sys.exit(main())
