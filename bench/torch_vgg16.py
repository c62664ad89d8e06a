#!/usr/bin/env python3
"""Single-process PyTorch CPU training throughput of VGG16 for 32x32 inputs (peer of shardnet's plain VGG16 benchmark).

The model matches shardnet's: conv config [64,64,M,128,128,M,256,256,256,M,
512,512,512,M,512,512,512,M], each conv 3x3 / stride 1 / padding 1, then
BatchNorm2d (conv without bias) or, with --no-batch-norm, a conv with bias, then
ReLU; M = MaxPool2d(2,2). Channels are scaled by --width W as c -> max(1,
round(c*W)); the classifier is Dropout(0.5), Linear(C5,H), ReLU, Dropout(0.5),
Linear(H,10) with H = max(1, round(512*W)). Loss is softmax cross-entropy (mean
over the batch); optimizer Adam(lr 1e-3, betas (0.9,0.999), eps 1e-8) or, with
--optimizer sgd, SGD(lr 0.01, momentum 0.9). Data is one seeded torch.randn
batch with random labels reused every step. It runs --warmup untimed training
steps, then times --steps full steps (forward, backward, optimizer step) and
prints `model,width,batch,threads,bn,images_per_s,ms_per_step` (header + one
line) to stdout. Run: `python3 torch_vgg16.py --threads 2 --batch 32 --width 1.0
--steps 10 --warmup 3` (add --no-batch-norm to drop batch norm). With
--device cuda the model and data live on cuda:0, the timing ends with a
device synchronisation, and a line `# peak_gpu_bytes N`
(torch.cuda.max_memory_allocated) goes to stderr.

With --ddp N it runs PyTorch's DistributedDataParallel instead: N processes
over gloo on this machine, each with --threads threads and batch/N examples
(the global batch is --batch), gradients allreduced in DDP's buckets during
backward; images_per_s counts the global batch, timed on rank 0 between
barriers. Batch norm is per process (PyTorch's SyncBatchNorm needs a GPU) —
shardnet's data parallelism normalises over the global batch, which costs
it allreduces PyTorch skips here. The line's `threads` field reads `N x T`.
With --fsdp N it runs FSDP2 instead (`fully_shard` on each convolution and
linear layer, then on the whole model: each process holds a share of every
parameter, gradient and Adam moment, a layer's parameters gathered while it
runs), otherwise as --ddp. Both print a line `# peak_rss_mb A / B ...` (each
process's peak resident memory, MiB) to stderr.
"""
import os
import argparse
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
NUM_CLASSES = 10


def scale(c, width):
    return max(1, int(round(c * width)))


def build_vgg16(width, batch_norm, in_channels=3, num_classes=NUM_CLASSES):
    layers = []
    cin = in_channels
    for v in VGG16_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        cout = scale(v, width)
        layers.append(nn.Conv2d(cin, cout, 3, stride=1, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(cout))
        layers.append(nn.ReLU(inplace=True))
        cin = cout
    hidden = scale(512, width)
    classifier = [nn.Flatten(), nn.Dropout(0.5), nn.Linear(cin, hidden), nn.ReLU(inplace=True),
                  nn.Dropout(0.5), nn.Linear(hidden, num_classes)]
    return nn.Sequential(*layers, *classifier)


def make_optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    ap.add_argument("--width", type=float, default=1.0, help="channel width multiplier W (default 1.0)")
    ap.add_argument("--batch-norm", dest="batch_norm", action=argparse.BooleanOptionalAction, default=True,
                    help="use BatchNorm2d after each conv (default on; --no-batch-norm gives biased convs)")
    ap.add_argument("--in-channels", type=int, default=3, help="input channels (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (default 3)")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="adam (default) or sgd")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    ap.add_argument("--print-loss", action="store_true", help="print '# step,loss' lines to stderr")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (default) or cuda (cuda:0)")
    ap.add_argument("--ddp", type=int, default=0,
                    help="N > 0: DistributedDataParallel over N gloo processes, batch/N each")
    ap.add_argument("--fsdp", type=int, default=0,
                    help="N > 0: FSDP2 (fully_shard per layer) over N gloo processes, batch/N each")
    args = ap.parse_args()
    if args.fsdp > 0:
        args.ddp = args.fsdp
    if args.ddp > 0:
        import torch.multiprocessing as mp
        if args.batch % args.ddp:
            raise SystemExit(f"--batch {args.batch} must be a multiple of --ddp {args.ddp}")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        mp.spawn(ddp_worker, args=(args,), nprocs=args.ddp, join=True)
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    model = build_vgg16(args.width, args.batch_norm, args.in_channels).to(dev)
    model.train()
    opt = make_optimizer(args.optimizer, model.parameters())
    torch.manual_seed(args.seed + 1)  # data/dropout stream, same as torch_vgg16_channel_parallel.py
    x = torch.randn(args.batch, args.in_channels, 32, 32).to(dev)
    y = torch.randint(0, NUM_CLASSES, (args.batch,)).to(dev)
    loss_fn = nn.CrossEntropyLoss()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if args.print_loss:
            import sys
            print(f"# {i},{loss.item():.6f}", file=sys.stderr, flush=True)

    for i in range(args.warmup):
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    sync()
    dt = time.perf_counter() - t0
    ms = dt * 1e3 / max(1, args.steps)
    ips = args.batch * args.steps / dt if dt > 0 else float("nan")
    print("model,width,batch,threads,bn,images_per_s,ms_per_step")
    print(f"vgg16,{args.width},{args.batch},{args.threads},{int(args.batch_norm)},{ips:.2f},{ms:.2f}", flush=True)
    if dev.type == "cuda":
        import sys
        print(f"# peak_gpu_bytes {torch.cuda.max_memory_allocated(dev)}", file=sys.stderr, flush=True)


def ddp_worker(rank, args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    n = args.ddp
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_vgg16(args.width, args.batch_norm, args.in_channels)
    if args.fsdp > 0:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (n,))
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model)
    model.train()
    opt = make_optimizer(args.optimizer, model.parameters())
    torch.manual_seed(args.seed + 1 + rank)
    b = args.batch // n
    x = torch.randn(b, args.in_channels, 32, 32)
    y = torch.randint(0, NUM_CLASSES, (b,))
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    dt = time.perf_counter() - t0
    import resource
    import sys
    peaks = [None] * n
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print("# peak_rss_mb " + " / ".join("%.0f" % p for p in peaks), file=sys.stderr, flush=True)
        ms = dt * 1e3 / max(1, args.steps)
        ips = args.batch * args.steps / dt if dt > 0 else float("nan")
        print("model,width,batch,threads,bn,images_per_s,ms_per_step")
        kind = "fsdp" if args.fsdp > 0 else "ddp"
        print(f"vgg16-{kind},{args.width},{args.batch},{n}x{args.threads},{int(args.batch_norm)},{ips:.2f},{ms:.2f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
