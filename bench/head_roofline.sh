#!/usr/bin/env bash
# The sharded classifier at the GEMM roofline, in one go: step time and peak
# memory per rank of `shardnet train face-head` (2 MPI ranks, one core each,
# d = 512, B = 256, plain softmax) for C in 100k, 1M, 2M, 5M; f32 and bf16;
# SGD (momentum 0.9, weight decay 5e-4) and Adam; Partial FC r = 1, 0.3, 0.1;
# the fused update and (at 1M) the unfused one. Each row stands next to:
#   - the GEMM bound: the three head GEMMs of one step on one rank
#     (2·B·C_r·d flops each, C_r = ⌈C/2⌉, times r under Partial FC) at this
#     machine's one-thread GEMM rates, measured first in the same run by
#     `shardnet bench gemm --json` at the head's own shapes (bf16 rows: the
#     bf16 rates, where the CPU has AVX-512 BF16);
#   - the same balanced scheme in PyTorch with the same optimizer and
#     precision (bench/torch_face_head.py; r = 1 rows; skipped, with the
#     reason, where its W, gradient and optimizer state would not fit).
# ms/step excludes the first (warm-up) step: the trainer leaves
# --warmup-steps out of samples/s. A run that shardnet refuses (its memory
# plan says it will not fit) or that fails prints the reason instead.
# Usage: bash bench/head_roofline.sh            (about 25 minutes)
#        CLASSES="100000 1000000" bash bench/head_roofline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features mpi -q
BIN=target/release/shardnet
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export RAYON_NUM_THREADS=1
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
B=256 D=512 N=2

RATES=$("$BIN" bench gemm --json)
echo "One-thread GEMM rates at the head's shapes (GFLOP/s), measured now: $RATES"
echo

# bound_ms C r precision: the three GEMMs of rank 0 at the measured rates.
bound_ms() {
  python3 - "$RATES" "$1" "$2" "$3" <<'PY'
import json, math, sys
rates, c, r, prec = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
cr = math.ceil(c / 2)
cols = min(cr, math.ceil(r * cr)) if r < 1 else cr
use = rates["bf16_gflops"] if prec == "bf16" and rates["bf16_gflops"] else rates["f32_gflops"]
flops = 2 * 256 * cols * 512
print(f"{sum(flops / (use[k] * 1e9) for k in ('logits', 'dx', 'dw')) * 1e3:.0f}")
PY
}

torch_cols() {  # classes steps optimizer precision
  local c=$1 steps=$2 opt=$3 prec=$4 slots=1
  [ "$opt" = adam ] && slots=2
  local need avail
  # W, its gradient and the optimizer's slots (f32), per rank, both ranks, + 2 GB.
  need=$(python3 -c "import math; print(int(2 * math.ceil($c / 2) * $D * 4 * (2 + $slots) + 2e9))")
  avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))
  if [ "$need" -gt "$avail" ]; then
    echo "would not fit ($(( need / 1000000000 )) GB) | |"
    return
  fi
  local j
  j=$(python3 bench/torch_face_head.py --classes "$c" --dim $D --batch-size $B --ranks $N \
      --steps "$((steps - 1))" --warmup 1 --threads 1 --optimizer "$opt" --precision "$prec" \
      2>/dev/null | tail -1) || { echo "failed | |"; return; }
  python3 - "$j" <<'PY'
import json, sys
m = json.loads(sys.argv[1])
print(f"{m['step_ms']:.0f} | {' / '.join(f'{p / 2**20:.0f}' for p in m['peak_rss_bytes'])} |")
PY
}

row() {  # classes steps optimizer precision rate update
  local c=$1 steps=$2 opt=$3 prec=$4 r=$5 upd=$6
  local f="$OUT/$RANDOM.json" err="$OUT/err.txt" extra=()
  [ "$prec" = bf16 ] && extra+=(--precision bf16)
  [ "$r" != 1 ] && extra+=(--sample-rate "$r")
  [ "$upd" = unfused ] && extra+=(--unfused-update)
  local head="| ${c} | $opt | $prec | $r | $upd |"
  if ! "$MPIEXEC" -n $N "$BIN" train face-head --comm mpi --classes "$c" --dim $D --batch-size $B \
      --max-steps "$steps" --warmup-steps 1 --steps-per-epoch "$steps" --epochs 1 --no-eval \
      --margin none --optimizer "$opt" --metrics "$f" "${extra[@]}" >/dev/null 2>"$err"; then
    local why
    why=$(grep -o "does not fit in memory: the plan estimates [^,]*" "$err" | head -1 || true)
    echo "$head ${why:-failed: $(grep -m1 -i error "$err" | cut -c1-80)} | | | | | |"
    return
  fi
  local bound torch="— | — |"
  bound=$(bound_ms "$c" "$r" "$prec")
  if [ "$r" = 1 ] && [ "$upd" = fused ]; then
    torch=$(torch_cols "$c" "$steps" "$opt" "$prec")
  fi
  python3 - "$f" "$head" "$bound" "$torch" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); e = m["epochs"][0]
ms = 256 / e["samples_per_s"] * 1e3
peaks = " / ".join(f"{p / 2**20:.0f}" for p in m["peak_memory_bytes"])
bound = float(sys.argv[3])
print(f"{sys.argv[2]} {ms:.0f} | {peaks} | {bound:.0f} | {ms / bound:.2f} | {sys.argv[4]}")
PY
}

echo "| C | optimizer | precision | r | update | ms / step | peak MiB rank 0 / 1 | GEMM bound ms | step / bound | PyTorch ms / step | PyTorch peak MiB |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for c in ${CLASSES:-100000 1000000 2000000 5000000}; do
  steps=$(( c >= 2000000 ? 3 : (c >= 1000000 ? 4 : 6) ))
  row "$c" $steps sgd f32 1 fused
  row "$c" $steps adam f32 1 fused
  row "$c" $steps sgd bf16 1 fused
  row "$c" $steps sgd f32 0.3 fused
  row "$c" $steps sgd f32 0.1 fused
  [ "$c" = 1000000 ] && row "$c" $steps sgd f32 1 unfused
  [ "$c" -ge 5000000 ] && row "$c" $steps sgd bf16 0.3 fused
done
