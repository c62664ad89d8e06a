#!/usr/bin/env bash
# The memory-balanced sharded classifier: shardnet (balanced, naive, bf16, Partial FC)
# next to the balanced scheme in PyTorch (bench/torch_face_head.py).
# 2 MPI ranks, one core each; d = 512, B = 256; C from 10k to 1M (2M if the
# memory is there). Per row: ms per step (forward, backward, gradient
# allreduce, Adam), peak resident memory of each rank, bytes received per
# step by rank 0 (measured by the communicator) and the formula's figure.
# Usage: bash bench/face_head.sh   (about 15 minutes; CLASSES="10000 100000" picks rows)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features mpi -q
BIN=target/release/shardnet
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export RAYON_NUM_THREADS=1
OUT=$(mktemp -d)
B=256 D=512 N=2

# Bytes rank 0 receives per step (n = 2): features in (B/2·d·e) and their
# gradient back (B·d·e/2), the 5B f32 statistics (two allreduces: 2·b·(n−1)/n
# each), the backbone's gradients (2 × (d² + d) f32, allreduced); naive: no
# statistics but rank 1's logits (C_1 × B f32); half precision: the loss
# scaler's flag.
formula() {  # e (bytes per feature value), naive C_1 (0: balanced)
  python3 -c "
B,d,e,c1=$B,$D,$1,$2
feat = B//2*d*e + B*d*e//2
stats = 0 if c1 else (4*B*4 + B*4)
scaler = 4 if e == 2 else 0  # the loss scaler's inf/NaN flag (one f32)
backbone = 2*(d*d+d)*4
naive = c1*B*4  # rank 0 gathers rank 1's logits (C_1 x B)
print(feat + stats + backbone + naive + scaler)"
}

shardnet_row() {  # label classes steps extra-args...
  local label=$1 c=$2 steps=$3; shift 3
  local f="$OUT/$RANDOM.json"
  "$MPIEXEC" -n $N "$BIN" train face-head --comm mpi --classes "$c" --dim $D --batch-size $B \
    --max-steps "$steps" --warmup-steps 1 --steps-per-epoch "$steps" --epochs 1 --no-eval \
    --metrics "$f" "$@" >/dev/null 2>&1 || { echo "| $label | $c | failed | | | | |"; return; }
  local e=4 c1=0
  [[ " $* " == *" bf16 "* || " $* " == *" f16 "* ]] && e=2
  [[ " $* " == *" --naive-head "* ]] && c1=$((c / N))
  python3 - "$f" "$label" "$c" "$(formula $e $c1)" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); e = m["epochs"][0]
peaks = [p / 2**20 for p in m["peak_memory_bytes"]]
print(f"| {sys.argv[2]} | {int(sys.argv[3]):,} | {256 / e['samples_per_s'] * 1e3:.0f} | "
      f"{' / '.join(f'{p:.0f}' for p in peaks)} | {max(peaks) / min(peaks):.3f} | "
      f"{m['bytes_received_per_step'][0]:,.0f} | {int(sys.argv[4]):,} |")
PY
}

torch_row() {  # classes steps
  local j
  j=$(python3 bench/torch_face_head.py --classes "$1" --dim $D --batch-size $B --ranks $N \
      --steps "$(($2 - 1))" --warmup 1 --threads 1 2>/dev/null | tail -1)
  python3 - "$j" <<'PY'
import json, sys
m = json.loads(sys.argv[1]); peaks = [p / 2**20 for p in m["peak_rss_bytes"]]
print(f"| PyTorch balanced (gloo) | {m['classes']:,} | {m['step_ms']:.0f} | "
      f"{' / '.join(f'{p:.0f}' for p in peaks)} | {max(peaks) / min(peaks):.3f} | | |")
PY
}

echo "| scheme | C | ms / step | peak MiB rank 0 / 1 | max/min | bytes received / step (rank 0) | formula |"
echo "|---|---|---|---|---|---|---|"
for c in ${CLASSES:-10000 100000 1000000}; do
  steps=$(( c >= 1000000 ? 4 : (c >= 100000 ? 6 : 11) ))
  shardnet_row "shardnet balanced, plain logits" "$c" $steps --margin none
  shardnet_row "shardnet naive (logits on rank 0)" "$c" $steps --margin none --naive-head
  torch_row "$c" $steps
  shardnet_row "shardnet balanced, ArcFace" "$c" $steps --margin arcface
  shardnet_row "shardnet ArcFace, bf16" "$c" $steps --margin arcface --precision bf16
  for r in 0.5 0.1; do
    shardnet_row "shardnet ArcFace, Partial FC r=$r" "$c" $steps --margin arcface --sample-rate $r
  done
done
avail=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
if [ "${CLASSES:-}" = "" ] && [ "$avail" -gt $((21 * 1024 * 1024)) ]; then
  shardnet_row "shardnet balanced, plain logits" 2000000 3 --margin none
fi
rm -rf "$OUT"
