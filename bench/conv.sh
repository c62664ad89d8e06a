#!/usr/bin/env bash
# Every VGG16 convolution shape (32x32 inputs, 3x3, padding 1) at batch 32:
# forward and forward+backward (dx, dW, db) time of shardnet's Conv2d
# (`shardnet bench conv`: Winograd's F(2x2,3x3) where it applies, else im2col
# GEMMs; the same layer on im2col GEMMs beside it) next to PyTorch's
# (bench/torch_conv_layers.py), same threads, same shapes, one after the other.
#
# Usage: bash bench/conv.sh [THREADS...]      (default: 1 2)
# Environment: BATCH=32 REPS=10
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH=${BATCH:-32}
REPS=${REPS:-10}
THREADS=${*:-1 2}
cargo build --release --features mpi -q
for t in $THREADS; do
  ours=$(target/release/shardnet bench conv --batch "$BATCH" --reps "$REPS" --threads "$t")
  torch=$(python3 bench/torch_conv_layers.py --batch "$BATCH" --reps "$REPS" --threads "$t" 2>/dev/null)
  echo "$ours" | head -1
  echo
  echo "| in → out @ side | GFLOP fwd | ours fwd (ms) | PyTorch fwd (ms) | ours fwd+bwd (ms) | PyTorch fwd+bwd (ms) | ours / PyTorch (fwd+bwd) | ours / GEMM bound | im2col fwd+bwd (ms) |"
  echo "|---|---|---|---|---|---|---|---|---|"
  paste -d'|' <(echo "$ours" | grep '^| [0-9]') <(echo "$torch" | grep -v '^cin' ) |
    awk -F'|' '{
      split($11, t, ","); tf = t[6]; tb = t[7];
      printf "|%s|%s|%s| %.1f |%s| %.1f | %.2f |%s|%s|\n", $2, $3, $4, tf, $5, tb, $5 / tb, $7, $9 }'
  echo
done
