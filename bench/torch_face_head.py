#!/usr/bin/env python3
"""PyTorch (CPU, gloo) baseline for shardnet's seed-003 sharded classifier.

The memory-balanced sharded classifier, written in PyTorch the way its paper
describes it: N processes; each holds the whole (small) backbone and the
rows W_r of a classifier of C classes (C/N each, one more on the first C % N
ranks). Per step, with global batch B split over the ranks:

  * backbone (data parallel): Linear(d, d) ReLU Linear(d, d) on the rank's
    B/N rows -> features (B/N, d);
  * torch.distributed.nn.functional.all_gather (differentiable: backward
    sums each sample's gradient back to its rank) -> features (B, d);
  * one torch.autograd.Function for the head: logits z_r = x W_r^T
    (B, C_r) and the scheme's sharded softmax cross-entropy, in place in
    that one buffer: allreduce of the row max, of the target logit and of
    the sum of exponentials (three allreduces of B values); backward local:
    dz = (softmax - onehot) / B, dx = dz W_r, dW_r = dz^T x;
  * backbone gradients allreduced (sum: the loss is already the global
    mean), then the optimizer on backbone and W_r: `--optimizer adam`
    (torch.optim.Adam, lr 1e-2) or `sgd` (torch.optim.SGD, lr 0.1, momentum
    0.9, weight decay 5e-4: InsightFace's head); `fused=True` (one in-place
    pass per tensor, no temporaries: several times faster than the default
    per-tensor path on a large W_r), or with `--unfused-update`
    torch.optim's default CPU path (temporaries the size of W_r).

Plain logits (no margin), like `shardnet train face-head --margin none`; f32,
or with `--precision bf16` the logits GEMM and both gradient GEMMs on bf16
inputs (f32 master weights and softmax; torch's CPU bf16 matmul;
its output, the logits, is rounded to bf16), like shardnet's
`--precision bf16`.
Inputs are random (B x d), labels uniform, generated once per rank.

Reports (JSON on stdout, from rank 0): step_ms (mean wall time of the timed
steps: forward, backward, allreduces, optimizer), peak_rss_bytes of every
rank (ru_maxrss), the loss of the first and last step.

With `--device cuda` every rank computes on a GPU (rank r on cuda:(r mod
GPUs)) and the collectives are NCCL's; step times are taken after a
device synchronisation, and the report adds peak_gpu_bytes (rank 0's
torch.cuda.max_memory_allocated).

Requires torch and numpy (torch.distributed's all_gather_object needs it):
pip install torch numpy.

Usage: python3 bench/torch_face_head.py --classes 100000 --ranks 2
Self-spawning (torch.multiprocessing, gloo on 127.0.0.1).
"""
import argparse
import warnings
import json
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distnn
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", category=FutureWarning)


class ShardedLogitsCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over classes sharded across ranks, from the
    features x (B, d) and this rank's rows W_r (C_r, d): the logits GEMM and
    the two gradient GEMMs inside, so nothing but the one (B, C_r) buffer of
    logits -> exponentials -> probabilities -> dz is held (in place, as
    InsightFace's DistCrossEntropy does).

    bf16: x and W_r are cast to bf16 for the three GEMMs (f32
    accumulation, bf16 output); the softmax is f32 (the one (B, C_r) f32
    buffer is made from the bf16 logits), dz is cast to bf16 for the
    gradient GEMMs, and dx, dW are cast back to f32 (f32 master weights)."""

    @staticmethod
    def forward(ctx, x, w, labels, offset, bf16):
        if bf16:
            x, w = x.bfloat16(), w.bfloat16()
        z = x @ w.t()
        b, c = z.shape
        m = z.max(dim=1).values.float()
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        local = labels - offset
        rows = ((local >= 0) & (local < c)).nonzero().squeeze(1)
        zt = torch.zeros(b, device=z.device)
        zt[rows] = z[rows, local[rows]].float()
        dist.all_reduce(zt)
        if bf16:
            p = torch.sub(z, m[:, None]).exp_()  # bf16 - f32 -> f32
            del z
        else:
            p = z.sub_(m[:, None]).exp_()
        s = p.sum(dim=1)
        dist.all_reduce(s)
        p /= s[:, None]
        # Kept as attributes, not save_for_backward, so that backward can let
        # each go as soon as it is used (the f32 probabilities once cast to
        # bf16, the bf16 copy of W_r once dx is computed).
        ctx.x, ctx.w, ctx.p, ctx.rows, ctx.local = x, w, p, rows, local
        return (torch.log(s) + m - zt).mean()

    @staticmethod
    def backward(ctx, g):
        p, rows, local = ctx.p, ctx.rows, ctx.local
        del ctx.p
        p[rows, local[rows]] -= 1.0
        p *= g / p.shape[0]
        bf16 = p.dtype != ctx.w.dtype
        if bf16:
            p = p.bfloat16()
        dx = p @ ctx.w
        del ctx.w
        dw = p.t() @ ctx.x
        del ctx.x, p
        if bf16:
            dx, dw = dx.float(), dw.float()
        return dx, dw, None, None, None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank, a, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.set_num_threads(a.threads)
    cuda = a.device == "cuda"
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=a.ranks)
    n, d, C, B = a.ranks, a.dim, a.classes, a.batch_size
    sizes = [C // n + (1 if r < C % n else 0) for r in range(n)]
    offset = sum(sizes[:rank])
    torch.manual_seed(a.seed)
    backbone = torch.nn.Sequential(
        torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)).to(dev)
    w = torch.nn.Parameter(
        torch.empty(sizes[rank], d).uniform_(-d ** -0.5, d ** -0.5).to(dev))
    params = list(backbone.parameters()) + [w]
    fused = None if a.unfused_update else True
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.1 if a.lr is None else a.lr, momentum=a.momentum,
                              weight_decay=5e-4 if a.weight_decay is None else a.weight_decay,
                              fused=fused)
    else:
        opt = torch.optim.Adam(params, lr=1e-2 if a.lr is None else a.lr,
                               weight_decay=a.weight_decay or 0.0, fused=fused)
    rows = [B // n + (1 if r < B % n else 0) for r in range(n)]
    g = torch.Generator().manual_seed(a.seed + 1)
    x_all = torch.randn(B, d, generator=g)
    labels = torch.randint(0, C, (B,), generator=g)
    x = x_all[sum(rows[:rank]):sum(rows[:rank + 1])].to(dev)
    labels = labels.to(dev)
    losses, times = [], []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        h = backbone(x)
        feats = torch.cat(distnn.all_gather(h), dim=0)
        loss = ShardedLogitsCrossEntropy.apply(feats, w, labels, offset,
                                               a.precision == "bf16")
        loss.backward()
        for p in backbone.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [None] * n
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        timed = times[a.warmup:]
        print(json.dumps({
            "classes": C, "dim": d, "batch_size": B, "ranks": n,
            "optimizer": a.optimizer, "precision": a.precision,
            "update": "unfused" if a.unfused_update else "fused",
            "step_ms": 1e3 * sum(timed) / len(timed),
            "peak_rss_bytes": peaks,
            "first_loss": losses[0], "last_loss": losses[-1],
            "device": a.device,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        }))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--classes", type=int, default=10000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--lr", type=float, default=None,
                   help="default 0.1 with sgd, 1e-2 with adam")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=None,
                   help="default 5e-4 with sgd, 0 with adam")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: rank r on cuda:(r mod GPUs), collectives over NCCL")
    p.add_argument("--unfused-update", action="store_true",
                   help="torch.optim's default CPU path instead of fused=True")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no GPU here")
    mp.spawn(run, args=(a, free_port()), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
