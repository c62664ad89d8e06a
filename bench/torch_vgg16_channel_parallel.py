#!/usr/bin/env python3
"""Channel-parallel VGG16 training throughput with torch.distributed/gloo on CPU (PyTorch peer of shardnet's seed-000 scheme, i.e. ChainerMN's channel-wise parallel VGG16).

Every conv of VGG16 (same model as torch_vgg16.py) is a ParallelConvolution2D:
with P ranks, rank r takes input channels r, r+P, r+2P, ... (x[:, r::P]), owns
n//P + (1 if r < n%P else 0) of the n output channels, runs its 3x3 conv, and the
blocks of all ranks are allgathered and concatenated on dim 1 in rank order. The
allgather is a torch.autograd.Function: forward = dist.all_gather, backward =
reduce-scatter, i.e. rank r gets the SUM over all ranks of their gradient for
block r (dist.reduce_scatter when gloo supports it, else dist.all_reduce + slice;
the run prints which one as a '#' line). Because BN, pools and classifier are
replicated (each rank runs them on the full gathered tensor, with identical RNG
for dropout), the gradient reaching each conv is P times that of the equivalent
single-process model, exactly as in ChainerMN; replicated parameters are not
all-reduced. (The last BN and the classifier get identical full gradients on all
ranks; an earlier BN channel gets its gradient only on the rank whose next conv
reads that channel, so the other ranks' copies go stale but are never read by
them -- the effective model is the same on all ranks.) Every rank uses the
same seeded batch; each process uses torch.set_num_threads(1). Output to stdout
(rank 0): `model,width,batch,ranks,bn,images_per_s,ms_per_step` (images/s counts
each batch once), then `comm,rank,ranks,allgather_fwd_bytes,reduce_scatter_bwd_bytes,total_bytes`
per rank, computed from shapes for ring collectives on f32 blocks
(B, c_k, H, W), C = sum_k c_k: a ring allgather makes rank r send P-1 blocks,
all but its successor's: 4*B*H*W*(C - c_{(r+1)%P}); a ring reduce-scatter
makes rank r send P-1 partial blocks, all but its own: 4*B*H*W*(C - c_r);
summed over the 13 convs (for P=2 and equal blocks both are 4*B*H*W*C/2). These
are model bytes, not what gloo actually moved (it may pad unequal blocks to the
largest one, and the all_reduce fallback sends about 2x). Run self-spawning:
`python3 torch_vgg16_channel_parallel.py --nproc 2 --batch 32 --width 1.0
--steps 10 --warmup 3`, or with `torchrun --nproc_per_node 2
torch_vgg16_channel_parallel.py --batch 32 ...` (torchrun's env wins over
--nproc). --check compares, on rank 0, the first step's loss and conv weight
gradients with an equivalent dense single-process model (block-masked weights;
tolerance 2e-2 relative L2 in f32, 1e-9 with --float64)
and checks after the run that losses and the fully replicated parameters
(last BN + classifier) agree bitwise across ranks.
"""
import argparse
import copy
import os
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# The model and the optimizer are torch_vgg16.py's (same directory): one
# definition for both peers.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_vgg16 import NUM_CLASSES, VGG16_CFG, build_vgg16, make_optimizer, scale  # noqa: E402,F401

RS_MODE = {"mode": None}  # "reduce_scatter" or "all_reduce", decided at start-up


def block_sizes(n, world):
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def _pad_channels(t, c):
    if t.shape[1] == c:
        return t.contiguous()
    pad = t.new_zeros(t.shape[0], c - t.shape[1], *t.shape[2:])
    return torch.cat([t, pad], dim=1)


class AllGatherChannels(torch.autograd.Function):
    """Forward: allgather of the per-rank (B, c_r, H, W) blocks, concatenated on dim 1.
    Backward: reduce-scatter (rank r gets the sum over ranks of the gradient for block r)."""

    @staticmethod
    def forward(ctx, y, sizes, rank, world):
        ctx.sizes, ctx.rank, ctx.world = sizes, rank, world
        if world == 1:
            return y.clone()
        cmax = max(sizes)
        bufs = [y.new_empty(y.shape[0], cmax, *y.shape[2:]) for _ in range(world)]
        dist.all_gather(bufs, _pad_channels(y, cmax))
        return torch.cat([b[:, :c] for b, c in zip(bufs, sizes)], dim=1)

    @staticmethod
    def backward(ctx, g):
        sizes, rank, world = ctx.sizes, ctx.rank, ctx.world
        if world == 1:
            return g, None, None, None
        off = sum(sizes[:rank])
        if RS_MODE["mode"] == "reduce_scatter":
            cmax = max(sizes)
            blocks = [_pad_channels(b, cmax) for b in torch.split(g, sizes, dim=1)]
            out = g.new_empty(g.shape[0], cmax, *g.shape[2:])
            dist.reduce_scatter(out, blocks, op=dist.ReduceOp.SUM)
            gx = out[:, :sizes[rank]]
        else:
            g = g.contiguous().clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
            gx = g[:, off:off + sizes[rank]]
        return gx.contiguous(), None, None, None


class ParallelConv2d(nn.Module):
    """ChainerMN-style ParallelConvolution2D built from a full Conv2d by slicing its weights."""

    def __init__(self, conv, rank, world):
        super().__init__()
        cout, cin = conv.out_channels, conv.in_channels
        self.rank, self.world = rank, world
        self.sizes = block_sizes(cout, world)
        self.off = sum(self.sizes[:rank])
        if min(self.sizes) == 0 or cin < world:
            raise SystemExit(f"conv {cin}->{cout} cannot be split over {world} ranks (a rank would get 0 channels)")
        w = conv.weight.detach()[self.off:self.off + self.sizes[rank], rank::world]
        self.weight = nn.Parameter(w.clone())
        self.bias = None
        if conv.bias is not None:
            self.bias = nn.Parameter(conv.bias.detach()[self.off:self.off + self.sizes[rank]].clone())

    def forward(self, x):
        y = F.conv2d(x[:, self.rank::self.world], self.weight, self.bias, stride=1, padding=1)
        return AllGatherChannels.apply(y, self.sizes, self.rank, self.world)


def make_parallel(full, rank, world):
    layers = [ParallelConv2d(m, rank, world) if isinstance(m, nn.Conv2d) else copy.deepcopy(m) for m in full]
    return nn.Sequential(*layers)


def make_dense_equivalent(full, world):
    """Same model with each conv weight zeroed outside the blocks the ranks own."""
    dense = copy.deepcopy(full)
    for m in dense:
        if isinstance(m, nn.Conv2d):
            mask = torch.zeros_like(m.weight)
            sizes = block_sizes(m.out_channels, world)
            off = 0
            for r, c in enumerate(sizes):
                mask[off:off + c, r::world] = 1
                off += c
            with torch.no_grad():
                m.weight.mul_(mask)
    return dense


def comm_bytes(width, batch, in_channels, world):
    """Ring-collective model bytes sent per rank per step: (allgather_fwd, reduce_scatter_bwd) lists."""
    ag = [0] * world
    rs = [0] * world
    side = 32
    for v in VGG16_CFG:
        if v == "M":
            side //= 2
            continue
        cout = scale(v, width)
        sizes = block_sizes(cout, world)
        per_ch = 4 * batch * side * side
        for r in range(world):
            ag[r] += per_ch * (cout - sizes[(r + 1) % world])
            rs[r] += per_ch * (cout - sizes[r])
    return ag, rs


def pick_reduce_scatter_mode(world):
    if world == 1:
        return "none"
    try:
        out = torch.zeros(1)
        dist.reduce_scatter(out, [torch.ones(1) for _ in range(world)], op=dist.ReduceOp.SUM)
        if out.item() != world:
            raise RuntimeError("bad reduce_scatter result")
        return "reduce_scatter"
    except (RuntimeError, NotImplementedError, ValueError):
        dist.barrier()
        return "all_reduce"


def run(rank, world, args):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if world > 1 or not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    RS_MODE["mode"] = pick_reduce_scatter_mode(world) if args.backward_collective == "auto" else args.backward_collective
    if world == 1:
        RS_MODE["mode"] = "none"
    if rank == 0:
        print(f"# ranks={world} backward_collective={RS_MODE['mode']} threads_per_rank=1", file=sys.stderr, flush=True)

    if args.float64:
        torch.set_default_dtype(torch.float64)
    torch.manual_seed(args.seed)  # identical on all ranks -> identical full init, sliced per rank
    full = build_vgg16(args.width, args.batch_norm, args.in_channels)
    model = make_parallel(full, rank, world)
    model.train()
    dense = make_dense_equivalent(full, world) if (args.check and rank == 0) else None
    del full
    opt = make_optimizer(args.optimizer, model.parameters())
    torch.manual_seed(args.seed + 1)  # data and dropout RNG: identical stream on all ranks
    x = torch.randn(args.batch, args.in_channels, 32, 32)
    y = torch.randint(0, NUM_CLASSES, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    if args.check:
        check_against_dense(model, dense, x, y, loss_fn, rank, world)

    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    dt = dt.item()

    # Post-run consistency: losses and replicated parameters must match bitwise on all ranks.
    lt = torch.stack(losses)
    all_l = [torch.empty_like(lt) for _ in range(world)]
    dist.all_gather(all_l, lt)
    # Only layers after the last parallel conv (last BN + classifier) are read in full by every rank;
    # an earlier BN channel is read only by the rank whose next conv takes that channel (see docstring).
    last = max(i for i, m in enumerate(model) if isinstance(m, ParallelConv2d))
    rep = torch.cat([p.detach().reshape(-1) for m in list(model)[last + 1:] for p in m.parameters()])
    all_rep = [torch.empty_like(rep) for _ in range(world)]
    dist.all_gather(all_rep, rep)

    if rank == 0:
        same_l = all(torch.equal(all_l[0], t) for t in all_l)
        same_p = all(torch.equal(all_rep[0], t) for t in all_rep)
        finite = bool(torch.isfinite(lt).all())
        pdiff = max((all_rep[0] - t).abs().max().item() for t in all_rep)
        print("# losses rank0: " + " ".join(f"{v:.6f}" for v in lt.tolist()), file=sys.stderr)
        print(f"# losses_identical_across_ranks={same_l} last_bn_and_classifier_params_identical={same_p} (max|diff|={pdiff:.1e}) "
              f"losses_finite={finite}", file=sys.stderr, flush=True)
        ms = dt * 1e3 / max(1, args.steps)
        ips = args.batch * args.steps / dt if dt > 0 else float("nan")
        print("model,width,batch,ranks,bn,images_per_s,ms_per_step")
        print(f"vgg16_channel_parallel,{args.width},{args.batch},{world},{int(args.batch_norm)},{ips:.2f},{ms:.2f}")
        ag, rs = comm_bytes(args.width, args.batch, args.in_channels, world)
        print("comm,rank,ranks,allgather_fwd_bytes,reduce_scatter_bwd_bytes,total_bytes")
        for r in range(world):
            print(f"comm,{r},{world},{ag[r]},{rs[r]},{ag[r] + rs[r]}")
        sys.stdout.flush()
        if args.check and not (same_l and same_p and finite):
            dist.destroy_process_group()
            raise SystemExit("consistency check failed")
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's background threads occasionally abort the process
    # ("terminate called without an active exception") during C++ static destruction.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_against_dense(model, dense, x, y, loss_fn, rank, world):
    """First-step loss and conv-gradient comparison with the block-masked dense model (rank 0)."""
    rng = torch.get_rng_state()
    bn_state = copy.deepcopy(model.state_dict())
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    ok = True
    if rank == 0:
        rng_after = torch.get_rng_state()
        torch.set_rng_state(rng)
        dense.train()
        dloss = loss_fn(dense(x), y)
        dloss.backward()
        torch.set_rng_state(rng_after)
        dconvs = [m for m in dense if isinstance(m, nn.Conv2d)]
        pconvs = [m for m in model if isinstance(m, ParallelConv2d)]
        worst = 0.0
        per_layer = []
        for dm, pm in zip(dconvs, pconvs):
            ref = world * dm.weight.grad[pm.off:pm.off + pm.sizes[0], 0::world]
            got = pm.weight.grad
            worst = max(worst, ((got - ref).norm() / (ref.norm() + 1e-30)).item())
            per_layer.append(f"{((got - ref).norm() / (ref.norm() + 1e-30)).item():.1e}")
        dl = abs(loss.item() - dloss.item())
        # f32: near-ties in max-pool / ReLU flip between the dense and the split summation order at width 1,
        # giving ~1e-3..1e-2 relative gradient differences; --float64 makes the comparison exact (~1e-15).
        tol = 1e-9 if torch.get_default_dtype() == torch.float64 else 2e-2
        ok = dl < 1e-4 and worst < tol
        print(f"# check: parallel_loss={loss.item():.6f} dense_loss={dloss.item():.6f} |diff|={dl:.2e} "
              f"max_rel_l2_conv_grad_err(rank0, vs {world}x dense)={worst:.2e} -> {'OK' if ok else 'FAIL'} per-layer: {' '.join(per_layer)}",
              file=sys.stderr, flush=True)
    model.zero_grad(set_to_none=True)
    model.load_state_dict(bn_state)  # undo the BN running-stat update of the check step
    torch.set_rng_state(rng)  # keep the RNG stream identical on all ranks
    flag = torch.tensor([1 if ok else 0])
    dist.broadcast(flag, 0)
    if flag.item() == 0:
        raise SystemExit("dense-equivalence check failed")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to self-spawn (default 2; ignored under torchrun)")
    ap.add_argument("--batch", type=int, default=32, help="batch size, the same batch on every rank (default 32)")
    ap.add_argument("--width", type=float, default=1.0, help="channel width multiplier W (default 1.0)")
    ap.add_argument("--batch-norm", dest="batch_norm", action=argparse.BooleanOptionalAction, default=True,
                    help="use BatchNorm2d after each conv (default on; --no-batch-norm gives biased convs)")
    ap.add_argument("--in-channels", type=int, default=3, help="input channels (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (default 3)")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="adam (default) or sgd")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed, the same on every rank (default 0)")
    ap.add_argument("--backward-collective", choices=["auto", "reduce_scatter", "all_reduce"], default="auto",
                    help="allgather backward: dist.reduce_scatter, or dist.all_reduce + slice; auto (default) "
                         "uses reduce_scatter when the gloo build supports it")
    ap.add_argument("--float64", action="store_true",
                    help="run in float64 (only to make --check exact; byte counts still assume f32)")
    ap.add_argument("--check", action="store_true",
                    help="verify against a dense single-process equivalent and cross-rank consistency")
    args = ap.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.nproc == 1:
        run(0, 1, args)
    else:
        mp.spawn(run, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
