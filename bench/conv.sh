#!/usr/bin/env bash
# Every VGG16 convolution shape (32x32 inputs, 3x3, padding 1) at batch 32:
# forward and forward+backward (dx, dW, db) time of shardnet's Conv2d
# (`shardnet bench conv`: Winograd's F(2x2,3x3) where it applies, else im2col
# GEMMs; the same layer on im2col GEMMs beside it) next to PyTorch's
# (bench/torch_conv_layers.py), same threads, same shapes.
#
# Ours and PyTorch's run one after the other, ROUNDS times over (so a slow
# minute of a shared machine touches one round of each, not every layer of
# one side); each time in the table is the median of its rounds (each
# round's own time is already the median of REPS repetitions), and the
# ratio is taken between those medians. The header says the rounds' range
# of the crate's 1024³ rate, a gauge of how quiet the machine was.
#
# Usage: bash bench/conv.sh [THREADS...]      (default: 1 2)
# Environment: BATCH=32 REPS=10 ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH=${BATCH:-32}
REPS=${REPS:-10}
ROUNDS=${ROUNDS:-3}
THREADS=${*:-1 2}
case $ROUNDS in '' | *[!0-9]* | 0) echo "ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 2 ;; esac
cargo build --release --features mpi -q
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for t in $THREADS; do
  for round in $(seq "$ROUNDS"); do
    target/release/shardnet bench conv --batch "$BATCH" --reps "$REPS" --threads "$t" >"$OUT/ours.$round"
    python3 bench/torch_conv_layers.py --batch "$BATCH" --reps "$REPS" --threads "$t" 2>/dev/null >"$OUT/torch.$round"
  done
  python3 - "$OUT" "$ROUNDS" <<'PY'
import csv, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
ours, torch, rates, head = {}, {}, [], None
for r in range(1, rounds + 1):
    lines = open(f"{out}/ours.{r}").read().splitlines()
    head = lines[0]
    rates.append(float(re.search(r"GEMM rate ([0-9.]+)", head).group(1)))
    for line in lines:
        f = [c.strip() for c in line.split("|")[1:-1]]
        if not f or not f[0][:1].isdigit():
            continue
        # layer, GFLOP fwd, fwd, fwd+bwd, bound fwd+bwd, ours/bound, im2col fwd, im2col fwd+bwd
        ours.setdefault(f[0], []).append([float(v) for v in f[1:]])
    for row in csv.DictReader(open(f"{out}/torch.{r}")):
        key = f"{row['cin']} → {row['cout']} @ {row['side']}"
        torch.setdefault(key, []).append((float(row["fwd_ms"]), float(row["fwdbwd_ms"])))
print(re.sub(r"GEMM rate [0-9.]+", f"GEMM rate {min(rates):.1f}–{max(rates):.1f}", head)
      + f"; medians of {rounds} rounds")
print()
print("| in → out @ side | GFLOP fwd | ours fwd (ms) | PyTorch fwd (ms) | ours fwd+bwd (ms) | PyTorch fwd+bwd (ms) | ours / PyTorch (fwd+bwd) | lowest–highest round of that ratio | ours / GEMM bound | im2col fwd+bwd (ms) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key, rs in ours.items():
    col = lambda i: med([r[i] for r in rs])
    ts = torch.get(key, [])
    tf = med([t[0] for t in ts]) if ts else float("nan")
    tb = med([t[1] for t in ts]) if ts else float("nan")
    per_round = [o[2] / t[1] for o, t in zip(rs, ts)]
    span = f"{min(per_round):.2f}–{max(per_round):.2f}" if per_round else ""
    print(f"| {key} | {rs[0][0]:.2f} | {col(1):.1f} | {tf:.1f} | {col(2):.1f} | {tb:.1f} | "
          f"{col(2) / tb:.2f} | {span} | {col(4):.2f} | {col(6):.1f} |")
print()
PY
done
