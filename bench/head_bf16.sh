#!/usr/bin/env bash
# The sharded classifier's bf16 goal, in one go: f32 and bf16 steps of
# `shardnet train face-head` side by side (2 MPI ranks, one core each:
# RAYON_NUM_THREADS=1; d = 512, B = 256, plain softmax, SGD with momentum
# 0.9, fused update), run alternately R times each so that a neighbour's
# load falls on both, and the ratio f32 / bf16 of the medians. The goal:
# bf16 ≥ 1.6× faster than f32 at C = 1M. The bf16 kernel in use (AMX
# tiles, AVX-512 BF16, or none: the f32 fallback) is printed first, from
# `shardnet bench gemm --json`, with the one-thread GEMM rates.
#
# ms/step = B / samples_per_s of the run's one epoch (the warm-up step left
# out; see bench/head_roofline.sh).
#
# Usage: bash bench/head_bf16.sh                  (C = 1M, R = 3; ~4 minutes)
#        C=100000 R=5 bash bench/head_bf16.sh
#        BIN=path/to/shardnet bash bench/head_bf16.sh   (that binary, no build)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release --features mpi -q
  BIN=target/release/shardnet
fi
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export RAYON_NUM_THREADS=1
C=${C:-1000000} R=${R:-3} B=256 D=512
STEPS=$(( C >= 1000000 ? 5 : 8 ))
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

"$BIN" bench gemm --json | python3 -c '
import json, sys
r = json.load(sys.stdin)
k = r.get("bf16_kernel") or "none (the f32 fallback)"
f = r["f32_gflops"]; h = r["bf16_gflops"] or {}
print(f"bf16 kernel: {k}; one-thread GFLOP/s at the head shapes (f32 / bf16): " +
      ", ".join(f"{n} {f[n]:.0f} / {h[n]:.0f}" if n in h else f"{n} {f[n]:.0f}" for n in ("logits", "dx", "dw")))'

step_ms() {  # precision -> ms per step
  local extra=()
  [ "$1" = bf16 ] && extra+=(--precision bf16)
  "$MPIEXEC" -n 2 "$BIN" train face-head --comm mpi --classes "$C" --dim $D --batch-size $B \
    --max-steps "$STEPS" --warmup-steps 1 --steps-per-epoch "$STEPS" --epochs 1 --no-eval \
    --margin none --optimizer sgd --metrics "$OUT/m.json" "${extra[@]}" >/dev/null
  python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))["epochs"][0]
print(f"{int(sys.argv[2]) / e["samples_per_s"] * 1e3:.0f}")' "$OUT/m.json" $B
}

f32=() bf16=()
for _ in $(seq "$R"); do
  f32+=("$(step_ms f32)")
  bf16+=("$(step_ms bf16)")
done
python3 - "$C" "${f32[*]}" "${bf16[*]}" <<'PY'
import statistics, sys
c, f, h = int(sys.argv[1]), [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
mf, mh = statistics.median(f), statistics.median(h)
print(f"C = {c:,}: f32 ms/step {', '.join(f'{v:.0f}' for v in f)} (median {mf:.0f}); "
      f"bf16 {', '.join(f'{v:.0f}' for v in h)} (median {mh:.0f}); f32 / bf16 = {mf / mh:.2f} "
      f"(goal ≥ 1.6)")
PY
