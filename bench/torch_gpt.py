#!/usr/bin/env python3
"""PyTorch (CPU) peer of `shardnet train gpt`: the same GPT, data and optimizer.

The model is nanoGPT's: byte tokens (V = 256), learned positions, L pre-LN
blocks (LayerNorm eps 1e-5, causal multi-head attention through
F.scaled_dot_product_attention, GELU in GPT-2's tanh form, 4D hidden), ln_f
and the LM head tied to the token embedding; biases everywhere; no dropout.
Initialisation: N(0, 0.02), residual projections 0.02/sqrt(2L), biases 0.
AdamW (betas 0.9, 0.999, eps 1e-8, weight decay 0.01 on every tensor, as
shardnet's), gradients clipped to norm 1. Windows of T + 1 tokens from the
text (fortunes' records, every tenth held out, as shardnet reads them),
shuffled by the seed.

  --scheme single   one process, --threads threads.
  --scheme ddp      --ranks processes (gloo), DistributedDataParallel, each
                    rank B / ranks windows of the global batch, one thread
                    each.
  --scheme fsdp     --ranks processes (gloo), FSDP2's fully_shard on each
                    block and on the whole (a replica's share of every
                    parameter, gradient and moment; a block gathered
                    before its forward and backward), each rank B / ranks
                    windows, one thread each.
  --scheme tensor   Megatron tensor parallelism over --ranks processes
                    (gloo), written with the region ops as custom autograd
                    functions (copy-to, reduce-from): attention by heads,
                    MLP by hidden features; the embedding and LM head
                    replicated (the logits whole on every rank), one thread
                    each.
  --scheme pipeline the blocks cut into --ranks stages (gloo, one thread
                    each) under torch.distributed.pipelining's
                    ScheduleGPipe or Schedule1F1B (--schedule) with
                    --micro-batches; the first stage embeds, the last holds
                    ln_f and a copy of wte for the head, whose gradient is
                    summed with the first stage's (Megatron's tied
                    embeddings); the clipping norm is summed over the
                    stages (wte counted once).

--recompute full: each block run again in backward from its input
(torch.utils.checkpoint, non-reentrant), as shardnet's --recompute full.

--device cuda (with --scheme single): the model and data on cuda:0, each
step's end synchronised; the JSON adds peak_gpu_bytes
(torch.cuda.max_memory_allocated).

Timing: --warmup steps, a barrier, --steps timed steps; rank 0 prints one
JSON line: tokens_per_s, step_ms, peak_rss_mb (this process's peak resident
memory; each rank's with --ranks), first_loss, last_loss.

    python3 bench/torch_gpt.py --scheme single --layers 6 --dim 384 --heads 6 --seq 256
"""

import argparse
import json
import math
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# Megatron's region ops (copy-to, reduce-from), shared with the MLP's peer.
from torch_mlp_tensor_parallel import CopyTo, ReduceFrom

FORTUNES = "/usr/share/games/fortunes"


def corpus(path):
    files = []
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            p = os.path.join(path, name)
            if os.path.isfile(p) and "." not in name:
                files.append(p)
    else:
        files = [path]
    records = []
    for f in files:
        text = open(f, "rb").read()
        cur = []
        for line in text.split(b"\n"):
            if line in (b"%", b"%\r"):
                records.append(b"\n".join(cur).rstrip(b"\n"))
                cur = []
            else:
                cur.append(line)
        records.append(b"\n".join(cur).rstrip(b"\n"))
    records = [r for r in records if r]
    train = b"\n".join(r for i, r in enumerate(records) if i % 10 != 9)
    return torch.tensor(list(train), dtype=torch.long)


def chunk(n, parts, r):
    base, extra = divmod(n, parts)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


class Block(nn.Module):
    def __init__(self, d, heads, layers, tp=1, rank=0):
        super().__init__()
        self.tp, self.d = tp, d
        h0, h1 = chunk(heads, tp, rank)
        self.heads, self.hd = h1 - h0, d // heads
        f0, f1 = chunk(4 * d, tp, rank)
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * self.heads * self.hd)
        self.attn_proj = nn.Linear(self.heads * self.hd, d, bias=False)
        self.attn_bias = nn.Parameter(torch.zeros(d))
        self.c_fc = nn.Linear(d, f1 - f0)
        self.mlp_proj = nn.Linear(f1 - f0, d, bias=False)
        self.mlp_bias = nn.Parameter(torch.zeros(d))
        for lin in (self.c_attn, self.c_fc):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.attn_proj, self.mlp_proj):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))

    def enter(self, x):
        return CopyTo.apply(x) if self.tp > 1 else x

    def leave(self, x):
        return ReduceFrom.apply(x) if self.tp > 1 else x

    def forward(self, x):
        b, t, d = x.shape
        a = self.enter(self.ln_1(x))
        q, k, v = self.c_attn(a).split(self.heads * self.hd, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.hd)
        x = x + self.leave(self.attn_proj(y)) + self.attn_bias
        m = self.enter(self.ln_2(x))
        h = F.gelu(self.c_fc(m), approximate="tanh")
        return x + self.leave(self.mlp_proj(h)) + self.mlp_bias


class GPT(nn.Module):
    def __init__(self, a, tp=1, rank=0):
        super().__init__()
        self.wte = nn.Embedding(256, a.dim)
        self.wpe = nn.Embedding(a.seq, a.dim)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList(Block(a.dim, a.heads, a.layers, tp, rank) for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(a.dim)
        self.recompute = getattr(a, "recompute", "none") == "full"

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


class Stage(nn.Module):
    """Stage s of p of the GPT: blocks chunk(L, p, s); the embeddings on
    the first, ln_f and the tied head (its own wte) on the last."""

    def __init__(self, a, s, p):
        super().__init__()
        torch.manual_seed(a.seed)
        whole = GPT(a)
        b0, b1 = chunk(a.layers, p, s)
        self.first, self.last = s == 0, s == p - 1
        self.wte = whole.wte if (self.first or self.last) else None
        self.wpe = whole.wpe if self.first else None
        self.h = nn.ModuleList(whole.h[b0:b1])
        self.ln_f = whole.ln_f if self.last else None

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for blk in self.h:
            x = blk(x)
        if self.last:
            x = self.ln_f(x) @ self.wte.weight.t()
        return x


def pipeline_worker(rank, a, port):
    """The pipeline scheme on rank `rank` (one stage each)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    p = a.ranks
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=p)
    stage_mod = Stage(a, rank, p)
    stage = PipelineStage(stage_mod, rank, p, torch.device("cpu"))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.schedule]
    sched = kind(stage, a.micro_batches, loss_fn=loss_fn)
    params = list(stage_mod.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    data = corpus(a.corpus)
    windows = (len(data) - 1) // a.seq
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(a.seed))
    # The tied wte: the first and the last stage sum their gradients.
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    losses = []

    def step(i):
        at = (i * a.batch_size) % max(1, windows - a.batch_size)
        starts = order[at: at + a.batch_size] * a.seq
        x = torch.stack([data[s: s + a.seq] for s in starts])
        y = torch.stack([data[s + 1: s + a.seq + 1] for s in starts])
        opt.zero_grad(set_to_none=True)
        out = []
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=out)
        else:
            sched.step()
        if stage_mod.wte is not None and p > 1:
            dist.all_reduce(stage_mod.wte.weight.grad, group=tied)
        # The global norm: each stage's squares, wte once (the first's).
        sq = sum(float(q.grad.pow(2).sum()) for q in params
                 if q.grad is not None and not (rank == p - 1 and rank > 0 and
                                                stage_mod.wte is not None and
                                                q is stage_mod.wte.weight))
        total = torch.tensor([sq])
        dist.all_reduce(total)
        scale = min(1.0, 1.0 / (math.sqrt(float(total)) + 1e-6))
        for q in params:
            if q.grad is not None:
                q.grad.mul_(scale)
        opt.step()
        if out:
            losses.append(float(sum(o.detach() for o in out) / len(out)))

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    dist.barrier()
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = [None] * p
    dist.all_gather_object(peaks, rss)
    last = [None] * p
    dist.all_gather_object(last, (losses[0], losses[-1]) if losses else None)
    if rank == 0:
        first_loss, last_loss = last[p - 1]
        print(json.dumps({
            "scheme": f"pipeline-{a.schedule}", "ranks": p, "micro_batches": a.micro_batches,
            "tokens_per_s": a.steps * a.batch_size * a.seq / dt,
            "step_ms": 1e3 * dt / a.steps,
            "peak_rss_mb": peaks,
            "first_loss": first_loss, "last_loss": last_loss,
        }))
    dist.destroy_process_group()


def worker(rank, a, port):
    ranks = a.ranks if a.scheme != "single" else 1
    torch.set_num_threads(a.threads if a.scheme == "single" else 1)
    if ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(a.seed)
    tp = ranks if a.scheme == "tensor" else 1
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    model = GPT(a, tp, rank if tp > 1 else 0).to(dev)
    if a.scheme == "ddp" and ranks > 1:
        model = nn.parallel.DistributedDataParallel(model)
    if a.scheme == "fsdp" and ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (ranks,))
        for blk in model.h:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    data = corpus(a.corpus).to(dev)
    windows = (len(data) - 1) // a.seq
    g = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(windows, generator=g)
    rows = chunk(a.batch_size, ranks, rank) if a.scheme in ("ddp", "fsdp") else (0, a.batch_size)
    losses = []

    def step(i):
        at = (i * a.batch_size) % max(1, windows - a.batch_size)
        idx = order[at + rows[0]: at + rows[1]]
        starts = idx * a.seq
        x = torch.stack([data[s: s + a.seq] for s in starts])
        y = torch.stack([data[s + 1: s + a.seq + 1] for s in starts])
        # bf16: autocast's mixed precision (the GEMMs and attention in bf16,
        # the weights, optimizer and loss in f32).
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # also waits for the GPU

    for i in range(a.warmup):
        step(i)
    if ranks > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    if ranks > 1:
        dist.barrier()
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if ranks > 1:
        peaks = [None] * ranks
        dist.all_gather_object(peaks, rss)
    else:
        peaks = [rss]
    if rank == 0:
        print(json.dumps({
            "scheme": a.scheme, "ranks": ranks,
            "tokens_per_s": a.steps * a.batch_size * a.seq / dt,
            "step_ms": 1e3 * dt / a.steps,
            "peak_rss_mb": peaks,
            "first_loss": losses[0], "last_loss": losses[-1],
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        }))
    if ranks > 1:
        # FSDP's hooks hold gloo work: let every rank finish before the
        # group goes.
        dist.barrier()
        del model, opt
        dist.destroy_process_group()


def run_args(p):
    """The flags this peer shares with bench/jax_gpt.py: threads, the model's
    sizes, the optimizer's rate, the timing and the text."""
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=FORTUNES)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scheme", choices=["single", "ddp", "fsdp", "tensor", "pipeline"],
                   default="single")
    p.add_argument("--recompute", choices=["none", "full"], default="none")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    run_args(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    a = p.parse_args()
    if a.precision == "bf16" and a.scheme == "pipeline":
        raise SystemExit("--precision bf16: with --scheme single, ddp or tensor")
    if a.device == "cuda" and a.scheme != "single":
        raise SystemExit("--device cuda: with --scheme single only")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no GPU here")
    if a.scheme == "single":
        worker(0, a, 0)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(pipeline_worker if a.scheme == "pipeline" else worker, args=(a, port),
                 nprocs=a.ranks)


if __name__ == "__main__":
    main()
