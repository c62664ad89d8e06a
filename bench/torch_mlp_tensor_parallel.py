#!/usr/bin/env python3
"""PyTorch (CPU, gloo) baselines for MLPs split *within* their layers.

Training throughput (samples/s) of the 784-U-U-10 MLP (ReLU, softmax
cross-entropy, Adam lr 1e-3) on synthetic MNIST-shaped data (random B x 784
float32, labels 0..9, generated once on rank 0 and broadcast every step, as
shardnet and Megatron's broadcast_data do), in one of three schemes:

  --scheme tensor   Megatron-style tensor parallelism over --ranks processes
                    (torch.distributed, gloo): Linear(784, U) column-parallel
                    (rank r holds U/n output rows), ReLU on the split
                    features, Linear(U, U) row-parallel (rank r holds U/n
                    input columns; one all_reduce forward), ReLU,
                    Linear(U, 10) replicated, every rank the same loss.
                    The region ops are custom autograd functions: copy_to
                    (identity / all_reduce of dL/dx) and reduce_from
                    (all_reduce / identity). Autograd skips copy_to's
                    backward here because x (data) needs no gradient:
                    --input-grad makes x require one, as shardnet's
                    ColumnParallelLinear always computes and allreduces.
                    --ranks 1 is the same code with no communication.
  --scheme single   the plain nn.Sequential MLP in one process
                    (--threads 1 or 2).
  --scheme chainer  Chainer's MnistMLPParallel: two parts, each
                    first_p = MLP(784, U/2, U/2, U) and
                    second_p = MLP(U, U/2, U/2, 10); h = z0 + z1 (an all_reduce
                    forward and backward), y = y0 + y1 on rank 0 (rank 1
                    sends y1, gets dL/dy back). --ranks 1 runs both parts in
                    one process (no communication), --ranks 2 one per rank.

Every rank builds the whole model from --seed and keeps its slice, so the
losses (first_loss, last_loss in the JSON) are the same for every --ranks of
one scheme (up to the rounding of split sums): a correctness check.

Timing: --warmup steps, a barrier, --steps timed steps, a barrier; rank 0
prints one JSON line with samples_per_s = steps * B / time.

    python3 bench/torch_mlp_tensor_parallel.py --scheme tensor --ranks 2 --units 4000 --threads 1
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

IN, CLASSES = 784, 10


class CopyTo(torch.autograd.Function):
    """Megatron's copy-to-region: identity forward, all_reduce(grad) backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class ReduceFrom(torch.autograd.Function):
    """Megatron's reduce-from-region: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class AllReduceSum(torch.autograd.Function):
    """h = z0 + z1 on both ranks: all_reduce forward and backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class TensorMlp(nn.Module):
    def __init__(self, U, n, r, seed):
        super().__init__()
        torch.manual_seed(seed)
        full = [nn.Linear(IN, U), nn.Linear(U, U), nn.Linear(U, CLASSES)]
        cols = slice(r * U // n, (r + 1) * U // n)
        self.w1 = nn.Parameter(full[0].weight.data[cols].clone())
        self.b1 = nn.Parameter(full[0].bias.data[cols].clone())
        self.w2 = nn.Parameter(full[1].weight.data[:, cols].clone())
        self.b2 = nn.Parameter(full[1].bias.data.clone())
        self.l3 = full[2]
        self.n = n

    def forward(self, x):
        if self.n > 1:
            x = CopyTo.apply(x)
        h = F.relu(F.linear(x, self.w1, self.b1))
        z = F.linear(h, self.w2)
        if self.n > 1:
            z = ReduceFrom.apply(z)
        return self.l3(F.relu(z + self.b2))


def mlp(dims):
    return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(),
                         nn.Linear(dims[1], dims[2]), nn.ReLU(),
                         nn.Linear(dims[2], dims[3]))


def chainer_parts(U, seed, parts):
    """Part p = (first_p, second_p), initialised from seed + p (any placement)."""
    out = []
    for p in parts:
        torch.manual_seed(seed + 1000 * p)
        out.append((mlp([IN, U // 2, U // 2, U]), mlp([U, U // 2, U // 2, CLASSES])))
    return out


def run(rank, a, port):
    torch.set_num_threads(a.threads)
    n = a.ranks
    if n > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=n)
    B, U = a.batch_size, a.units
    g = torch.Generator().manual_seed(a.seed + 12345)
    x0 = torch.rand(B, IN, generator=g)
    t0 = torch.randint(0, CLASSES, (B,), generator=g)

    if a.scheme == "single":
        torch.manual_seed(a.seed)
        model = nn.Sequential(nn.Linear(IN, U), nn.ReLU(), nn.Linear(U, U), nn.ReLU(),
                              nn.Linear(U, CLASSES))
        params = list(model.parameters())
    elif a.scheme == "tensor":
        model = TensorMlp(U, n, rank, a.seed)
        params = list(model.parameters())
    else:
        parts = chainer_parts(U, a.seed, [0, 1] if n == 1 else [rank])
        params = [q for f, s in parts for q in list(f.parameters()) + list(s.parameters())]
    opt = torch.optim.Adam(params, lr=a.lr)

    def step():
        x, t = x0.clone(), t0.clone()
        if n > 1:  # rank 0 reads the batch, the others get it
            dist.broadcast(x, 0)
            dist.broadcast(t, 0)
        if a.input_grad:
            x.requires_grad_()
        opt.zero_grad(set_to_none=True)
        if a.scheme != "chainer":
            loss = F.cross_entropy(model(x), t)
            loss.backward()
        elif n == 1:
            z = sum(f(x) for f, _ in parts)
            h = F.relu(z)
            loss = F.cross_entropy(sum(s(h) for _, s in parts), t)
            loss.backward()
        else:
            f, s = parts[0]
            y = s(F.relu(AllReduceSum.apply(f(x))))
            if rank == 0:  # y = y0 + y1; dL/dy1 = dL/dy goes back to rank 1
                y1 = torch.empty(B, CLASSES)
                dist.recv(y1, 1)
                y0 = y.detach().requires_grad_()
                loss = F.cross_entropy(y0 + y1.requires_grad_(), t)
                loss.backward()  # the loss only: rank 1 needs dL/dy1 before the all_reduce
                dist.send(y1.grad, 1)
                y.backward(y0.grad)
            else:
                dist.send(y.detach(), 0)
                gy = torch.empty(B, CLASSES)
                dist.recv(gy, 0)
                y.backward(gy)
                loss = torch.zeros(())
        opt.step()
        return loss.item()

    first = None
    for _ in range(a.warmup):
        loss = step()
        first = loss if first is None else first
    if n > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
        first = loss if first is None else first
    if n > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({
            "framework": "pytorch", "torch": torch.__version__, "scheme": a.scheme,
            "ranks": n, "threads": a.threads, "units": U, "batch_size": B,
            "steps": a.steps, "warmup": a.warmup, "input_grad": a.input_grad,
            "samples_per_s": round(a.steps * B / elapsed, 3),
            "step_ms": round(elapsed / a.steps * 1000, 3),
            "first_loss": round(first, 6), "last_loss": round(loss, 6),
        }), flush=True)
    if n > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scheme", choices=["tensor", "single", "chainer"], default="tensor")
    p.add_argument("--ranks", type=int, default=2, help="processes (single: always 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--units", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-grad", action="store_true",
                   help="x requires grad (tensor: dL/dx computed and all-reduced)")
    a = p.parse_args()
    if a.scheme == "single":
        a.ranks = 1
    if a.scheme == "chainer" and a.ranks not in (1, 2):
        p.error("chainer: --ranks 1 or 2")
    if a.ranks == 1:
        run(0, a, None)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(run, args=(a, port), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    sys.exit(main())
