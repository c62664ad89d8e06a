#!/usr/bin/env bash
# The sharded classifier at the GEMM roofline, in one go: step time and peak
# memory per rank of `shardnet train face-head` (2 MPI ranks, one core each:
# RAYON_NUM_THREADS=1; d = 512, B = 256, plain softmax: --margin none) for
# C in 100k, 1M, 2M, 5M. Per C: f32 SGD, f32 Adam, bf16 SGD (r = 1), f32 SGD
# under Partial FC r = 0.3 and 0.1; at 1M also f32 SGD with --unfused-update;
# at 5M also bf16 SGD r = 0.3. SGD: momentum 0.9, weight decay 5e-4. Each row
# stands next to:
#   - the GEMM bound: the three head GEMMs of one step on rank 0 (logits, dx,
#     dW: 2·B·C_r·d flops each, C_r = ⌈C/2⌉, ⌈r·C_r⌉ under Partial FC) at
#     this machine's one-thread GEMM rates, measured first in the same run by
#     `shardnet bench gemm --json` at the head's own shapes (bf16 rows: the
#     bf16 rates; the f32 ones where the CPU has no bf16 kernel: null; f32
#     logits on AVX-512: our sgemm's rate, the kernel the head calls there);
#   - the same balanced scheme in PyTorch with the same optimizer, precision
#     and update (bench/torch_face_head.py: fused torch.optim, or its default
#     path for the --unfused-update row; r = 1 rows only, "—" otherwise),
#     skipped with "would not fit (N GB)" where its W, gradient and optimizer
#     slots (f32, both ranks, + 2 GB) exceed MemAvailable.
# ms/step = B / samples_per_s of the epoch. The warm-up step is left out: the
# trainer restarts its clock after each of the --warmup-steps (1 here) and
# counts only the later steps' samples, so samples_per_s is (S − 1)·B over
# the wall time from the end of step 1 to the end of step S (the ranks'
# per-step agreement and the step log included). PyTorch: the mean wall time
# of its S − 1 steps after one warm-up step. Peak MiB: each rank's
# peak_memory_bytes (PyTorch: ru_maxrss). A run that shardnet refuses (its
# memory plan says it will not fit; it says so on stderr before building
# anything) prints "refused: ..." in place of its figures; a run that fails
# prints "failed (...)"; the script goes on either way.
#
# Usage: bash bench/head_roofline.sh            (builds first; about 15 minutes
#                                                on a 2-core machine, most of it
#                                                at 1M and 2M, PyTorch included)
#        CLASSES="100000 1000000" bash bench/head_roofline.sh   (picks rows)
#        BIN=path/to/shardnet bash bench/head_roofline.sh       (that binary, no build)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release --features mpi -q
  BIN=target/release/shardnet
fi
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export RAYON_NUM_THREADS=1
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
B=256 D=512 N=2

RATES=$("$BIN" bench gemm --json) || {
  echo "head_roofline: \`$BIN bench gemm --json\` failed (a shardnet without it?)" >&2
  exit 1
}
python3 - "$RATES" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
def line(k):
    g = r[k]
    return ", ".join(f"{n} {g[n]:.1f}" for n in ("logits", "dx", "dw", "square")) if g else "none"
print("One-thread GEMM rates at the head's shapes (GFLOP/s), measured now by "
      "`shardnet bench gemm`:")
print(f"f32: {line('f32_gflops')}; bf16: {line('bf16_gflops')}; "
      f"AVX-512 BF16: {'yes' if r.get('avx512_bf16') else 'no'}")
if r.get("fma_isa") == "avx512" and r.get("sgemm_gflops"):
    print(f"f32 logits on our sgemm (what the head calls on AVX-512): {r['sgemm_gflops']['logits']:.1f}")
PY
echo

# bound_ms C r precision: the three GEMMs of rank 0 at the measured rates.
bound_ms() {
  python3 - "$RATES" "$1" "$2" "$3" "$B" "$D" "$N" <<'PY'
import json, math, sys
rates, c, r, prec = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
b, d, n = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
cr = math.ceil(c / n)
cols = min(cr, math.ceil(r * cr))
f32 = not (prec == "bf16" and rates["bf16_gflops"])
use = dict(rates["f32_gflops"] if f32 else rates["bf16_gflops"])
# The f32 logits (x̂ · Wᵀ) run on our sgemm on AVX-512 (kernels::dot::matmul_abt).
if f32 and rates.get("fma_isa") == "avx512" and rates.get("sgemm_gflops"):
    use["logits"] = rates["sgemm_gflops"]["logits"]
flops = 2 * b * cols * d
print(f"{sum(flops / (use[k] * 1e9) for k in ('logits', 'dx', 'dw')) * 1e3:.6f}")
PY
}

torch_cols() {  # classes steps optimizer precision update
  local c=$1 steps=$2 opt=$3 prec=$4 upd=$5 slots=1
  [ "$opt" = adam ] && slots=2
  local need avail extra=()
  [ "$upd" = unfused ] && extra+=(--unfused-update)
  # W, its gradient and the optimizer's slots (f32), per rank, both ranks, + 2 GB.
  need=$(python3 -c "import math; print(int($N * math.ceil($c / $N) * $D * 4 * (2 + $slots) + 2e9))")
  avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))
  if [ "$need" -gt "$avail" ]; then
    echo "would not fit ($(( need / 1000000000 )) GB) | |"
    return
  fi
  local j
  j=$(python3 bench/torch_face_head.py --classes "$c" --dim $D --batch-size $B --ranks $N \
      --steps "$((steps - 1))" --warmup 1 --threads 1 --optimizer "$opt" --precision "$prec" \
      "${extra[@]}" 2>"$OUT/torch_err.txt" | tail -1) || true
  python3 - "$j" "$OUT/torch_err.txt" <<'PY'
import json, sys
try:
    m = json.loads(sys.argv[1])
except ValueError:
    err = [l.strip() for l in open(sys.argv[2], errors="replace") if l.strip()]
    why = next((l for l in reversed(err) if "Error" in l or "Killed" in l), err[-1] if err else "")
    print(f"failed ({why[:80]}) | |" if why else "failed | |")
    sys.exit()
print(f"{m['step_ms']:.0f} | {' / '.join(f'{p / 2**20:.0f}' for p in m['peak_rss_bytes'])} |")
PY
}

row() {  # classes steps optimizer precision rate update
  local c=$1 steps=$2 opt=$3 prec=$4 r=$5 upd=$6
  local f="$OUT/metrics.json" err="$OUT/err.txt" extra=()
  rm -f "$f"
  [ "$prec" = bf16 ] && extra+=(--precision bf16)
  [ "$r" != 1 ] && extra+=(--sample-rate "$r")
  [ "$upd" = unfused ] && extra+=(--unfused-update)
  local head="| ${c} | $opt | $prec | $r | $upd |"
  if ! "$MPIEXEC" -n $N "$BIN" train face-head --comm mpi --classes "$c" --dim $D --batch-size $B \
      --max-steps "$steps" --warmup-steps 1 --steps-per-epoch "$steps" --epochs 1 --no-eval \
      --margin none --optimizer "$opt" --metrics "$f" "${extra[@]}" >/dev/null 2>"$err"; then
    python3 - "$err" "$head" <<'PY'
import re, sys
lines = [l.strip() for l in open(sys.argv[1], errors="replace") if l.strip()]
first = lines[0] if lines else ""
first = re.sub(r"^shardnet: rank \d+ failed: ", "", first)
if "does not fit in memory" in first:
    # "<model> does not fit in memory: the plan estimates X for one node (2 ranks),
    #  Y for rank 0 (parameters ...), but Z is available (MemAvailable ...). ..."
    why = first.split("does not fit in memory: ", 1)[1]
    why = re.sub(r" \(parameters [^)]*\)", "", why)
    why = re.split(r" \(MemAvailable|\. ", why)[0]
    print(f"{sys.argv[2]} refused: {why} | | | | | |")
else:
    print(f"{sys.argv[2]} failed ({first[:80]}) | | | | | |" if first else f"{sys.argv[2]} failed | | | | | |")
PY
    return
  fi
  local bound torch="— | — |"
  bound=$(bound_ms "$c" "$r" "$prec")
  if [ "$r" = 1 ]; then
    torch=$(torch_cols "$c" "$steps" "$opt" "$prec" "$upd")
  fi
  if python3 - "$f" "$head" "$bound" "$torch" "$B" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); e = m["epochs"][0]
ms = int(sys.argv[5]) / e["samples_per_s"] * 1e3
peaks = " / ".join(f"{p / 2**20:.0f}" for p in m["peak_memory_bytes"])
bound = float(sys.argv[3])  # unrounded: a small C's bound is under 1 ms
shown = f"{bound:.0f}" if bound >= 10 else f"{bound:.1f}" if bound >= 0.1 else f"{bound:.2g}"
ratio = f"{ms / bound:.2f}" if bound > 0 else "—"
print(f"{sys.argv[2]} {ms:.0f} | {peaks} | {shown} | {ratio} | {sys.argv[4]}")
PY
  then :; else echo "$head failed (metrics unreadable: $f) | | | | | |"; fi
}

echo "| C | optimizer | precision | r | update | ms / step | peak MiB rank 0 / 1 | GEMM bound ms | step / bound | PyTorch ms / step | PyTorch peak MiB (rank 0 / 1) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for c in ${CLASSES:-100000 1000000 2000000 5000000}; do
  steps=$(( c >= 2000000 ? 3 : (c >= 1000000 ? 4 : 6) ))
  row "$c" $steps sgd f32 1 fused
  row "$c" $steps adam f32 1 fused
  row "$c" $steps sgd bf16 1 fused
  row "$c" $steps sgd f32 0.3 fused
  row "$c" $steps sgd f32 0.1 fused
  if [ "$c" = 1000000 ]; then row "$c" $steps sgd f32 1 unfused; fi
  if [ "$c" -ge 5000000 ]; then row "$c" $steps sgd bf16 0.3 fused; fi
done
