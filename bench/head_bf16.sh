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

RATES=$("$BIN" bench gemm --json)
echo "$RATES" | python3 -c '
import json, sys
r = json.load(sys.stdin)
k = r.get("bf16_kernel") or "none (the f32 fallback)"
f = r["f32_gflops"]; h = r["bf16_gflops"] or {}
print(f"bf16 kernel: {k}; one-thread GFLOP/s at the head shapes (f32 / bf16): " +
      ", ".join(f"{n} {f[n]:.0f} / {h[n]:.0f}" if n in h else f"{n} {f[n]:.0f}" for n in ("logits", "dx", "dw")))'

step_ms() {  # precision [env...] -> ms per step
  local extra=() prec=$1
  shift
  [ "$prec" = bf16 ] && extra+=(--precision bf16)
  env "$@" "$MPIEXEC" -n 2 "$BIN" train face-head --comm mpi --classes "$C" --dim $D --batch-size $B \
    --max-steps "$STEPS" --warmup-steps 1 --steps-per-epoch "$STEPS" --epochs 1 --no-eval \
    --margin none --optimizer sgd --metrics "$OUT/m.json" "${extra[@]}" >/dev/null 2>"$OUT/err" || {
    echo "head_bf16: the $prec run failed:" >&2; cat "$OUT/err" >&2; exit 1; }
  python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))["epochs"][0]
ms = int(sys.argv[2]) / e["samples_per_s"] * 1e3
print(f"{ms:.0f}")' "$OUT/m.json" $B
}

# Where the bf16 kernel is AMX, also bf16 on AVX-512 BF16 (SHARDNET_AMX=0):
# what a CPU with AVX-512 BF16 and no AMX gets.
AMX=$(echo "$RATES" | python3 -c 'import json, sys; print(json.load(sys.stdin).get("bf16_kernel") == "amx")')
f32=() bf16=() noamx=()
for _ in $(seq "$R"); do
  f32+=("$(step_ms f32)")
  bf16+=("$(step_ms bf16)")
  if [ "$AMX" = True ]; then noamx+=("$(step_ms bf16 SHARDNET_AMX=0)"); fi
done
python3 - "$C" "${f32[*]}" "${bf16[*]}" "${noamx[*]:-}" <<'PY'
import statistics, sys
c = int(sys.argv[1])
runs = [[float(v) for v in a.split()] for a in sys.argv[2:5]]
mf = statistics.median(runs[0])
for name, r in zip(("f32", "bf16", "bf16 on AVX-512 BF16 (SHARDNET_AMX=0)"), runs):
    if r:
        m = statistics.median(r)
        print(f"C = {c:,}, {name}: ms/step {', '.join(f'{v:.0f}' for v in r)} (median {m:.0f}); "
              f"f32 / this = {mf / m:.2f}")
print("goal: f32 / bf16 ≥ 1.6")
PY
