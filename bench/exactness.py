#!/usr/bin/env python3
"""Exactness of shardnet's training trajectory against PyTorch (f32 and f64).

Acceptance check: the trajectory of VGG16 and of the 5-layer MLP (full batch,
3 optimizer steps) is within 3x PyTorch-f32's own error of float64 PyTorch, on
every exact split.

For each model, split and optimizer (Adam: lr 1e-3, betas 0.9/0.999, eps 1e-8
as torch.optim.Adam; SGD: momentum 0.9, weight decay 5e-4 as torch.optim.SGD,
lr 0.1 by default, --sgd-lr) it

1. takes the initial weights from shardnet itself: one step with lr 1e-30
   (`--max-steps 1 --lr 1e-30 --save-params`). An Adam step moves each weight
   by at most ~lr, below half an ulp of any weight over ~1e-23, so the file
   holds the initial weights bit for bit; the only elements it moves are
   exact zeros (batch norm's biases), which become +-1e-30 and are set back to
   0. This is checked: the run is repeated with lr 1e-31 and every element
   not below 1e-25 must have the same bits in both files;
2. runs shardnet for 3 full-batch steps (`--epochs 3 --max-steps 3`, one step
   per epoch) and reads its parameters (`--save-params`) and per-step losses
   (`--log-dir`);
3. runs PyTorch (CPU) from the same initial weights on the same data in
   float64 (the reference) and in float32, the latter --orders times (8) with
   the full batch in another example order each time: the same step
   mathematically, other roundings;
4. prints, per parameter tensor and overall (all parameters as one vector),
   err_ours   = ||ours    - ref64|| / ||ref64 - init||,
   err_torch32 = ||torch32 - ref64|| / ||ref64 - init|| (the batch's own order;
   the spread over the orders beside it) and ratio = err_ours / err_torch32.
   Batch norm's running statistics (buffers) are reported on their own line
   (same normalisation, against their initial 0 / 1), not gated.

Why the orders: both f32 errors are dominated by discrete events, a ReLU
input (or a max-pool near-tie) within f32 rounding of zero landing on the
other side than in f64. One such flip on a unit active for few examples moves
the Adam trajectory of every earlier layer by ~1e-4 relative, so an f32 run
that has it and one that does not differ by 100x (VGG16 here: 4.5e-6 without,
4.8e-4 with, depending on the example order alone). A ratio to one f32 run is
then a coin toss; the spread gate (default) asks instead that on every split
err_ours <= 3 x the largest err_torch32 over the orders, and that the median
err_ours over the splits <= 3 x the median err_torch32 over the orders (a
systematic error would raise every split). --gate plain is the literal check:
err_ours / err_torch32 <= 3 on every split.

Exit status 1 if a gate fails, or shardnet's step-1 loss is not PyTorch's to
1e-5 relative (wrong data or model).

Models:
* mnist-mlp: 784-100-100-100-100-10 (`--stages 4 --units 100`), ReLU,
  the 60,000 MNIST training images as one batch (pixels f32(byte) * f32(1/255),
  as crates/shardnet/src/data/mnist.rs), splits --ranks 1, 2, 4 (pipeline stages).
* vgg16: width 1/16 (channels 4..32), batch norm, dropout 0, --dataset
  synthetic with 64 images as one batch (the generator of crates/shardnet/src/data/images.rs,
  ported below with numpy f32 arithmetic, which matches its step-1 loss to
  ~3e-8 relative), splits
  none/1, output/2, input/2, output/4, input/4 and output/4 with
  --data-parallel 2.

Usage (1-3 minutes on 2 cores):
    python3 bench/exactness.py target/release/shardnet ../shared/data
    python3 bench/exactness.py BIN DATA --models vgg16 --optimizers adam
Needs torch, numpy and safetensors (pip install torch numpy safetensors).
"""
import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

STEPS = 3
MASK64 = (1 << 64) - 1

# ---------------------------------------------------------------- data


def splitmix64(state):
    """(new state, output) of one splitmix64 step (crates/comm/src/rng.rs)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def unit16(bits):
    """crates/shardnet/src/data/images.rs `unit`: (bits & 0xFFFF) as f32 / 32768 - 1 (exact)."""
    return np.float32(bits & 0xFFFF) / np.float32(32768.0) - np.float32(1.0)


def synthetic_images(n, channels, side, classes, seed):
    """Port of crates/shardnet/src/data/images.rs `synthetic_images`: (x (n, C*side*side) f32, labels)."""
    grid = 4
    f32 = np.float32
    at = []
    for p in range(side):
        u = f32(p * (grid - 1)) / f32(side - 1) if side > 1 else f32(0.0)
        i = min(int(u), grid - 2)
        at.append((i, f32(u - f32(i))))
    state = seed & MASK64
    patterns = []
    for _ in range(classes):
        out = []
        for _ in range(channels):
            g = []
            for _ in range(grid * grid):
                state, r = splitmix64(state)
                g.append(unit16(r))
            for iy, fy in at:
                for ix, fx in at:
                    top = (f32(1.0) - fx) * g[iy * grid + ix] + fx * g[iy * grid + ix + 1]
                    bottom = (f32(1.0) - fx) * g[(iy + 1) * grid + ix] + fx * g[(iy + 1) * grid + ix + 1]
                    out.append((f32(1.0) - fy) * top + fy * bottom)
        patterns.append(np.array(out, dtype=np.float32))
    features = channels * side * side
    draws = (features + 3) // 4
    x = np.empty((n, features), dtype=np.float32)
    t = np.empty(n, dtype=np.int64)
    for e in range(n):
        state, r = splitmix64(state)
        label = r % classes
        state, r = splitmix64(state)
        contrast = f32(1.0) + f32(0.5) * unit16(r)
        noise = np.empty(draws * 4, dtype=np.float32)
        for d in range(draws):
            state, r = splitmix64(state)
            for k in range(4):
                noise[4 * d + k] = unit16(r >> (16 * k))
        # NOISE = 1.0: NOISE * u is u exactly; contrast * p rounded, then + u.
        x[e] = (f32(contrast) * patterns[label]).astype(np.float32) + noise[:features]
        t[e] = label
    return x, t


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def mnist_train(data_dir):
    d = os.path.join(data_dir, "mnist")

    def find(name):
        for cand in (name, name + ".gz"):
            if os.path.exists(os.path.join(d, cand)):
                return os.path.join(d, cand)
        sys.exit(f"exactness: {name}(.gz) not in {d}")

    images = read_idx(find("train-images-idx3-ubyte"))
    labels = read_idx(find("train-labels-idx1-ubyte"))
    # crates/shardnet/src/data/mnist.rs: to f32, then candle's affine(1/255, 0): v * f32(1/255) + 0.
    x = images.reshape(len(images), -1).astype(np.float32) * np.float32(1.0 / 255.0) + np.float32(0.0)
    return x, labels.astype(np.int64)


# ---------------------------------------------------------------- models

VGG16 = [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0]


def scaled(c, width):
    return max(1, int(round(c * width)))


def mlp_forward(p, x, stages):
    h = x
    for l in range(stages + 1):
        h = F.linear(h, p[f"layer{l}.weight"], p[f"layer{l}.bias"])
        if l != stages:
            h = F.relu(h)
    return h


def vgg_forward(p, bufs, x):
    """VGG16 with batch norm in training mode (updating bufs as PyTorch's BatchNorm2d)."""
    h = x
    k = 0
    for at, c in enumerate(VGG16):
        if c == 0:
            continue
        k += 1
        h = F.conv2d(h, p[f"conv{k}.weight"], p.get(f"conv{k}.bias"), padding=1)
        h = F.batch_norm(h, bufs[f"bn{k}.running_mean"], bufs[f"bn{k}.running_var"],
                         p[f"bn{k}.weight"], p[f"bn{k}.bias"], training=True, momentum=0.1, eps=1e-5)
        h = F.relu(h)
        if at + 1 < len(VGG16) and VGG16[at + 1] == 0:
            h = F.max_pool2d(h, 2)
    h = h.flatten(1)
    h = F.relu(F.linear(h, p["fc1.weight"], p["fc1.bias"]))
    return F.linear(h, p["fc2.weight"], p["fc2.bias"])


def torch_train(model, init, x, t, dtype, optimizer, lr):
    """STEPS full-batch steps from `init` in `dtype`: (params, buffers, losses) as f64 numpy."""
    params = {k: torch.tensor(v, dtype=dtype, requires_grad=True)
              for k, v in init.items() if ".running_" not in k}
    bufs = {k: torch.tensor(v, dtype=dtype) for k, v in init.items() if ".running_" in k}
    names = sorted(params)
    plist = [params[k] for k in names]
    if optimizer == "adam":
        opt = torch.optim.Adam(plist, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.SGD(plist, lr=lr, momentum=0.9, weight_decay=5e-4)
    xt = torch.tensor(x).to(dtype)
    tt = torch.tensor(t)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if model == "mnist-mlp":
            y = mlp_forward(params, xt, stages=4)
        else:
            y = vgg_forward(params, bufs, xt.reshape(len(xt), 3, 32, 32))
        loss = F.cross_entropy(y, tt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {k: v.detach().double().numpy() for k, v in params.items()}
    return out, {k: v.double().numpy() for k, v in bufs.items()}, losses


# ---------------------------------------------------------------- shardnet runs

MLP_BASE = ["train", "mnist-mlp", "--batch-size", "60000", "--stages", "4", "--units", "100",
            "--no-eval"]
MLP_SPLITS = {"ranks1": ["--ranks", "1"], "ranks2": ["--ranks", "2"], "ranks4": ["--ranks", "4"]}
VGG_BASE = ["train", "vgg16", "--dataset", "synthetic", "--synthetic-examples", "64",
            "--batch-size", "64", "--width", "0.0625", "--dropout", "0", "--no-eval"]
VGG_SPLITS = {
    "none/1": ["--parallel-conv", "none", "--ranks", "1"],
    "output/2": ["--parallel-conv", "output", "--ranks", "2"],
    "input/2": ["--parallel-conv", "input", "--ranks", "2"],
    "output/4": ["--parallel-conv", "output", "--ranks", "4"],
    "input/4": ["--parallel-conv", "input", "--ranks", "4"],
    "output/2x2dp": ["--parallel-conv", "output", "--ranks", "4", "--data-parallel", "2"],
}


class Runner:
    def __init__(self, binary, data, workdir):
        self.binary, self.data, self.workdir, self.n = binary, data, workdir, 0

    def run(self, args):
        """Run shardnet with `args` + --save-params/--log-dir: (params, per-step losses)."""
        self.n += 1
        out = os.path.join(self.workdir, f"run{self.n}.safetensors")
        logs = os.path.join(self.workdir, f"logs{self.n}")
        cmd = [self.binary] + args + ["--save-params", out, "--log-dir", logs]
        env = dict(os.environ, SHARDNET_DATA=self.data)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"exactness: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
        with open(os.path.join(logs, "steps.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f if line.strip()]
        return load_file(out), losses


def initial_weights(runner, args, check):
    """The initial parameters (see the module doc): one Adam step of lr 1e-30."""
    a, _ = runner.run(args + ["--optimizer", "adam", "--lr", "1e-30", "--epochs", "1",
                              "--max-steps", "1"])
    init, zeroed = {}, 0
    b = None
    if check:
        b, _ = runner.run(args + ["--optimizer", "adam", "--lr", "1e-31", "--epochs", "1",
                                  "--max-steps", "1"])
    for k, v in a.items():
        if ".running_" in k:
            # The step updated them; a new layer's are 0 (mean) and 1 (var).
            init[k] = np.zeros_like(v) if k.endswith("mean") else np.ones_like(v)
            continue
        tiny = np.abs(v) < 1e-25
        if b is not None:
            same = a[k].view(np.uint32) == b[k].view(np.uint32)
            bad = ~same & ~tiny
            if bad.any():
                sys.exit(f"exactness: {k}: {bad.sum()} elements moved by a step of lr 1e-30 "
                         "(initial weights not recoverable this way)")
        zeroed += int(tiny.sum())
        init[k] = np.where(tiny, np.float32(0), v)
    return init, zeroed


def rel(num, den):
    return float(np.sqrt(num) / np.sqrt(den)) if den > 0 else float("nan")


def compare(init, ours, t32, t64, buf_ours, buf32, buf64):
    """Per-tensor and overall errors: rows (name, err_ours, err_t32, ratio)."""
    rows = []
    tot = {"o": 0.0, "t": 0.0, "d": 0.0}
    btot = {"o": 0.0, "t": 0.0, "d": 0.0}
    for k in sorted(t64):
        ref = t64[k]
        d = float(np.sum((ref - init[k].astype(np.float64)) ** 2))
        o = float(np.sum((ours[k].astype(np.float64) - ref) ** 2))
        t = float(np.sum((t32[k] - ref) ** 2))
        rows.append((k, rel(o, d), rel(t, d), rel(o, t)))
        tot["o"] += o
        tot["t"] += t
        tot["d"] += d
    for k in sorted(buf64):
        ref = buf64[k]
        btot["d"] += float(np.sum((ref - init[k]) ** 2))
        btot["o"] += float(np.sum((buf_ours[k].astype(np.float64) - ref) ** 2))
        btot["t"] += float(np.sum((buf32[k] - ref) ** 2))
    overall = (rel(tot["o"], tot["d"]), rel(tot["t"], tot["d"]), rel(tot["o"], tot["t"]))
    buffers = (rel(btot["o"], btot["d"]), rel(btot["t"], btot["d"]), rel(btot["o"], btot["t"])) \
        if buf64 else None
    return rows, overall, buffers


def total_err(a, ref, den):
    return rel(sum(float(np.sum((a[k] - ref[k]) ** 2)) for k in ref), den)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="the shardnet binary (e.g. target/release/shardnet)")
    ap.add_argument("data", help="data directory holding mnist/ (as $SHARDNET_DATA)")
    ap.add_argument("--models", default="mnist-mlp,vgg16")
    ap.add_argument("--optimizers", default="adam,sgd")
    ap.add_argument("--adam-lr", type=float, default=1e-3)
    ap.add_argument("--sgd-lr", type=float, default=0.1,
                    help="SGD's lr (default 0.1: at 1e-3 three steps move the weights by a few "
                         "hundred ulps, and both f32 errors are the weights' own f32 rounding)")
    ap.add_argument("--orders", type=int, default=8,
                    help="PyTorch-f32 runs, each on the full batch in another example order "
                         "(the same step mathematically; other roundings): its error's spread")
    ap.add_argument("--gate", choices=["plain", "spread"], default="spread",
                    help="plain: err_ours / err_torch32 (the batch's own order) <= --max-ratio on "
                         "every split; spread: on every split err_ours <= --max-ratio x the largest "
                         "err_torch32 over --orders, and the median err_ours over the splits <= "
                         "--max-ratio x the median err_torch32 over the orders")
    ap.add_argument("--max-ratio", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--tensors", action="store_true", help="print every tensor's row")
    ap.add_argument("--keep", help="keep shardnet's files in this directory")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    binary = os.path.abspath(a.binary)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {a.threads} torch threads, "
          f"binary {binary}, gate {a.gate} (max ratio {a.max_ratio})")
    workdir = a.keep or tempfile.mkdtemp(prefix="exactness-")
    os.makedirs(workdir, exist_ok=True)
    runner = Runner(binary, os.path.abspath(a.data), workdir)
    lrs = {"adam": a.adam_lr, "sgd": a.sgd_lr}
    failures = []
    summary = []
    typicals = []
    for model in a.models.split(","):
        t0 = time.time()
        if model == "mnist-mlp":
            x, t = mnist_train(a.data)
            base, splits = MLP_BASE + ["--data", os.path.abspath(a.data)], MLP_SPLITS
        elif model == "vgg16":
            x, t = synthetic_images(64, 3, 32, 10, 0)
            base, splits = VGG_BASE, VGG_SPLITS
        else:
            sys.exit(f"exactness: unknown model {model}")
        refs = {}
        same_init = True
        typical = {}
        for i, (split, sargs) in enumerate(splits.items()):
            init, zeroed = initial_weights(runner, base + sargs, check=(i == 0))
            key = b"".join(init[k].tobytes() for k in sorted(init))
            if i == 0:
                first = key
                n_params = sum(v.size for k, v in init.items() if ".running_" not in k)
                print(f"\n== {model}: {len(x)} examples (one batch), {n_params} parameters; "
                      f"initial weights from shardnet (lr 1e-30 step, checked against lr 1e-31; "
                      f"{zeroed} zero elements restored)")
            elif key != first:
                same_init = False
                print(f"   note: {split}'s initial weights differ from {list(splits)[0]}'s")
            for opt in a.optimizers.split(","):
                lr = lrs[opt]
                if (key, opt) not in refs:
                    r64 = torch_train(model, init, x, t, torch.float64, opt, lr)
                    r32 = torch_train(model, init, x, t, torch.float32, opt, lr)
                    den = sum(float(np.sum((r64[0][k] - init[k].astype(np.float64)) ** 2))
                              for k in r64[0])
                    spread = [total_err(r32[0], r64[0], den)]
                    for o in range(1, a.orders):
                        perm = np.random.default_rng(o).permutation(len(x))
                        p, _, _ = torch_train(model, init, x[perm], t[perm], torch.float32, opt, lr)
                        spread.append(total_err(p, r64[0], den))
                    refs[(key, opt)] = (r64, r32, spread)
                (p64, b64, l64), (p32, b32, l32), spread = refs[(key, opt)]
                ours, lours = runner.run(base + sargs + ["--optimizer", opt, "--lr", repr(lr),
                                                         "--epochs", str(STEPS), "--max-steps", str(STEPS)])
                pours = {k: v for k, v in ours.items() if ".running_" not in k}
                bours = {k: v for k, v in ours.items() if ".running_" in k}
                if set(pours) != set(p64):
                    sys.exit(f"exactness: parameter names differ: {sorted(set(pours) ^ set(p64))}")
                rows, (eo, et, ratio), buffers = compare(init, pours, p32, p64, bours, b32, b64)
                worst = max(rows, key=lambda r: r[3])
                lrel = abs(lours[0] - l64[0]) / abs(l64[0])
                smax = max(spread)
                print(f"-- {model} {split} {opt} (lr {lr:g}): err_ours {eo:.3e}  err_torch32 {et:.3e} "
                      f"(over {len(spread)} orders {min(spread):.2e}..{smax:.2e})  ratio {ratio:.2f} "
                      f"(vs the largest {eo / smax:.2f})")
                print(f"   worst tensor {worst[0]}: ratio {worst[3]:.2f} (err_ours {worst[1]:.2e}, "
                      f"err_torch32 {worst[2]:.2e})")
                print(f"   losses ours {['%.9f' % v for v in lours]}  f64 {['%.9f' % v for v in l64]}  "
                      f"f32 {['%.9f' % v for v in l32]}  (step-1 rel diff {lrel:.1e})")
                if buffers:
                    print(f"   bn running stats (not gated): err_ours {buffers[0]:.3e}  "
                          f"err_torch32 {buffers[1]:.3e}  ratio {buffers[2]:.2f}")
                if a.tensors:
                    for name, o, tt, rr in rows:
                        print(f"     {name:24s} err_ours {o:.3e}  err_torch32 {tt:.3e}  ratio {rr:.2f}")
                summary.append((model, split, opt, eo, et, min(spread), smax, ratio, worst))
                typical.setdefault(opt, ([], spread))[0].append(eo)
                gated = ratio if a.gate == "plain" else eo / smax
                if not gated <= a.max_ratio:
                    failures.append(f"{model} {split} {opt}: {a.gate} ratio {gated:.2f} > {a.max_ratio}")
                if not lrel <= 1e-5:
                    failures.append(f"{model} {split} {opt}: step-1 loss {lours[0]} vs PyTorch's "
                                    f"{l64[0]} (data or model differ)")
        for opt, (ours_errs, spread) in typical.items():
            mo, mt = float(np.median(ours_errs)), float(np.median(spread))
            print(f"   {model} {opt}: median err_ours over the splits {mo:.3e}, median err_torch32 "
                  f"over the orders {mt:.3e} ({' '.join('%.2e' % v for v in spread)}): "
                  f"ratio {mo / mt:.2f}")
            typicals.append((model, opt, mo, mt))
            if a.gate == "spread" and not mo <= a.max_ratio * mt:
                failures.append(f"{model} {opt}: median err_ours {mo:.2e} > {a.max_ratio} x median "
                                f"err_torch32 {mt:.2e}")
        if same_init:
            print(f"   (initial weights identical on every split; {model}: {time.time() - t0:.0f} s)")
    print("\nmodel      split         opt   err_ours   err_torch32 (orders: min..max)  ratio  "
          "vs max  worst tensor (ratio)")
    for model, split, opt, eo, et, smin, smax, ratio, worst in summary:
        print(f"{model:10s} {split:13s} {opt:5s} {eo:.3e}  {et:.3e}  ({smin:.2e}..{smax:.2e})  "
              f"{ratio:6.2f}  {eo / smax:6.2f}  {worst[0]} ({worst[3]:.2f})")
    for model, opt, mo, mt in typicals:
        print(f"{model:10s} median        {opt:5s} {mo:.3e}  {mt:.3e}  (median over splits / orders)  "
              f"{mo / mt:6.2f}")
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"\nPASS: every overall {a.gate} ratio <= {a.max_ratio}")


if __name__ == "__main__":
    main()
