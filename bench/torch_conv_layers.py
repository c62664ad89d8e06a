#!/usr/bin/env python3
"""Per-layer 3x3 convolution timing for every distinct VGG16 conv shape at 32x32 input (PyTorch CPU peer of shardnet's conv benchmark).

For each (cin, cout, side) in (3,64,32), (64,64,32), (64,128,16), (128,128,16),
(128,256,8), (256,256,8), (256,512,4), (512,512,4), (512,512,2) it builds a
Conv2d(cin, cout, 3, stride 1, padding 1, bias=True) and a seeded random input of
shape (batch, cin, side, side), then measures (a) the forward pass alone under
torch.no_grad() and (b) forward + backward from a fixed random output gradient g
(`y.backward(g)`; shardnet's side runs `functions::backward_from(y, g)`), where
the input requires grad, so dx, dW and db are all computed.
Each number is the median over --reps timed repetitions after 3 untimed warm-ups,
with torch.set_num_threads(--threads). One CSV line per shape goes to stdout,
after the header `cin,cout,side,batch,threads,fwd_ms,fwdbwd_ms,gflop_fwd`, where
gflop_fwd = 2*B*cout*cin*9*side*side/1e9. Run: `python3 torch_conv_layers.py
--batch 32 --threads 1 --reps 10`.
"""
import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")
import torch  # noqa: E402

SHAPES = [(3, 64, 32), (64, 64, 32), (64, 128, 16), (128, 128, 16), (128, 256, 8),
          (256, 256, 8), (256, 512, 4), (512, 512, 4), (512, 512, 2)]
WARMUP = 3


def median_ms(fn, reps):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="batch size B (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement; median is reported (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print("cin,cout,side,batch,threads,fwd_ms,fwdbwd_ms,gflop_fwd", flush=True)
    for cin, cout, side in SHAPES:
        conv = torch.nn.Conv2d(cin, cout, 3, stride=1, padding=1, bias=True)
        x = torch.randn(args.batch, cin, side, side)
        g = torch.randn(args.batch, cout, side, side)

        def fwd():
            with torch.no_grad():
                conv(x)

        xg = x.clone().requires_grad_(True)

        def fwdbwd():
            conv.zero_grad(set_to_none=True)
            xg.grad = None
            y = conv(xg)
            y.backward(g)

        fwd_ms = median_ms(fwd, args.reps)
        fwdbwd_ms = median_ms(fwdbwd, args.reps)
        assert xg.grad is not None and conv.weight.grad is not None and conv.bias.grad is not None
        gflop = 2.0 * args.batch * cout * cin * 9 * side * side / 1e9
        print(f"{cin},{cout},{side},{args.batch},{args.threads},{fwd_ms:.3f},{fwdbwd_ms:.3f},{gflop:.4f}", flush=True)


if __name__ == "__main__":
    main()
