#!/usr/bin/env bash
# The GPT (L=6, D=384, H=6, T=256, batch 8 windows = 2,048 tokens, AdamW,
# clipping) on fortunes: shardnet beside PyTorch (bench/torch_gpt.py, the
# same model, data and optimizer), tokens/s and each rank's peak memory.
# One process: 2 threads; 2 ranks: one thread each (shardnet under mpiexec,
# PyTorch over gloo). Needs `apt-get install fortunes` and torch.
# Then a size that does not fit one rank's memory budget, split over two.
# JAX's one process (bench/jax_gpt.py) where jax is installed. bf16: ours
# --precision bf16, PyTorch's autocast. Then activations per block under
# sequence parallelism, and recomputation at batch 32.
# Usage: bash bench/gpt.sh   (about 25 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features mpi -q
BIN=target/release/shardnet
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
OUT=$(mktemp -d)
SHAPE=(--layers 6 --dim 384 --heads 6 --seq 256 --batch-size 8)
STEPS=${STEPS:-12}  # 2 of them warm-up

ours() {  # ranks threads flags...
  local ranks=$1 threads=$2 f="$OUT/$RANDOM.json"; shift 2
  local args=(train gpt "${SHAPE[@]}" --max-steps "$STEPS" --warmup-steps 2 --no-eval
              --lr-warmup 2 --metrics "$f" "$@")
  if [ "$ranks" = 1 ]; then
    RAYON_NUM_THREADS=$threads "$BIN" "${args[@]}" --ranks 1 >/dev/null 2>&1
  else
    RAYON_NUM_THREADS=$threads "$MPIEXEC" -n "$ranks" "$BIN" "${args[@]}" --comm mpi >/dev/null 2>&1
  fi
  cp "$f" "$OUT/last.json"
  python3 -c "
import json; m = json.load(open('$f'))
print(m['epochs'][0]['samples_per_s'], ' / '.join('%.0f' % (b / 2**20) for b in m['peak_memory_bytes']))"
}

theirs() {  # scheme ranks threads [flags...]
  python3 bench/torch_gpt.py --scheme "$1" --ranks "$2" --threads "$3" "${@:4}" --layers 6 \
      --dim 384 --heads 6 --seq 256 --batch-size 8 --steps "$((STEPS - 2))" --warmup 2 2>/dev/null \
    | tail -1 | python3 -c "
import json, sys; m = json.loads(sys.stdin.read())
print(m['tokens_per_s'], ' / '.join('%.0f' % p for p in m['peak_rss_mb']))"
}

row() {  # name "our ranks threads flags" "their scheme ranks threads"
  local name=$1 o t
  read -r -a ours_args <<<"$2"
  o=$(ours "${ours_args[@]}")
  if [ -n "$3" ]; then t=$(theirs $3); else t="- -"; fi
  read -r otok omem <<<"$o"
  read -r ttok tmem <<<"$t"
  LAST=("$otok" "$omem" "$ttok" "$tmem")
  local ratio="-"
  if [ "$ttok" != "-" ]; then ratio=$(python3 -c "print('%.2f' % ($otok / $ttok))"); fi
  printf '| %s | %.0f | %s | %s | %s | %s |\n' "$name" "$otok" "$omem" \
    "$( [ "$ttok" = - ] && echo - || printf '%.0f' "$ttok")" "$tmem" "$ratio"
}

echo "| split | shardnet tokens/s | shardnet peak MiB per rank | PyTorch tokens/s | PyTorch peak MiB per rank | shardnet / PyTorch |"
echo "|---|---|---|---|---|---|"
row "1 process × 2 threads" "1 2" "single 1 2"
ONE=("${LAST[@]}")
row "1 process, --recompute full" "1 2 --recompute full" ""
row "1 process, --precision bf16 (PyTorch: autocast bf16)" "1 2 --precision bf16" "single 1 2 --precision bf16"
row "tensor parallel t = 2" "2 1 --tensor-parallel 2" "tensor 2 1"
row "t = 2, sequence parallel" "2 1 --tensor-parallel 2 --sequence-parallel" ""
row "data parallel d = 2" "2 1 --data-parallel 2" "ddp 2 1"
for s in gpipe 1f1b; do
  row "pipeline p = 2, $s, M = 4" "2 1 --pipeline 2 --micro-batches 4 --schedule $s" \
    "pipeline 2 1 --schedule $s --micro-batches 4"
done
row "pipeline p = 2, zero-bubble, M = 4" "2 1 --pipeline 2 --micro-batches 4 --schedule zero-bubble" ""
row "pipeline p = 2, interleaved, M = 4" "2 1 --pipeline 2 --micro-batches 4 --schedule interleaved" ""

# One process beside JAX too (bench/jax_gpt.py: the same model, data and
# optimizer in jax.numpy, jitted whole; XLA's CPU pool of 2 threads).
echo
echo "| one process × 2 threads | tokens/s | peak MiB | shardnet / it |"
echo "|---|---|---|---|"
printf '| shardnet | %.0f | %s | 1.00 |\n' "${ONE[0]}" "${ONE[1]}"
printf '| PyTorch | %.0f | %s | %s |\n' "${ONE[2]}" "${ONE[3]}" \
  "$(python3 -c "print('%.2f' % (${ONE[0]} / ${ONE[2]}))")"
if python3 -c "import jax" 2>/dev/null; then
  read -r jtok jmem <<<"$(python3 bench/jax_gpt.py --threads 2 --layers 6 --dim 384 --heads 6 \
      --seq 256 --batch-size 8 --steps "$((STEPS - 2))" --warmup 2 2>/dev/null | tail -1 |
    python3 -c "
import json, sys; m = json.loads(sys.stdin.read())
print(m['tokens_per_s'], '%.0f' % m['peak_rss_mb'][0])")"
  printf '| JAX | %.0f | %s | %s |\n' "$jtok" "$jmem" \
    "$(python3 -c "print('%.2f' % (${ONE[0]} / $jtok))")"
else
  echo "| JAX | not installed (pip install jax) | | |"
fi

# Activations per block and rank (T=512, D=256, H=4, batch 8, 2 ranks under
# mpiexec): the peak at L=6 less the peak at L=2, over 4 blocks, less each
# block's parameters, gradients and AdamW moments on the rank (16 bytes a
# float). Outside the tensor-parallel regions a block keeps 6·D floats per
# token (its input, the residual, the layer norms' outputs, the branches'
# outputs): whole at t = 2, the rank's positions under sequence parallelism.
echo
echo "| T = 512, D = 256, batch 8, 2 ranks | activations per block, MiB per rank | of which outside the regions (6·D per token, counted) |"
echo "|---|---|---|"
SHAPE=(--dim 256 --heads 4 --seq 512 --batch-size 8)
STEPS=4
for split in "--tensor-parallel 2" "--tensor-parallel 2 --sequence-parallel"; do
  read -r _ m2 <<<"$(ours 2 1 --layers 2 $split)"
  read -r _ m6 <<<"$(ours 2 1 --layers 6 $split)"
  outside=24
  case "$split" in *sequence*) outside=12 ;; esac
  per=$(python3 -c "
a = [float(x) for x in '$m2'.split(' / ')]; b = [float(x) for x in '$m6'.split(' / ')]
params = 16 * (12 * 256 * 256 / 2 + 9 * 256) / 2**20
print(' / '.join('%.1f' % ((y - x) / 4 - params) for x, y in zip(a, b)))")
  printf '| %s | %s | %s |\n' "$split" "$per" "$outside"
done

# Recomputation where activations dominate: batch 32 windows (8,192
# tokens), one process × 2 threads. At batch 8 the parameters, gradients
# and AdamW moments (165 MiB) are a quarter of the peak and no
# recomputation touches them. Peak resident memory and the peak live heap
# (the allocator's counters: what the run held, less the freed blocks the
# allocator keeps and the process's code).
echo
echo "| batch 32, one process × 2 threads | tokens/s | peak MiB | peak heap MiB | time / none | peak / none |"
echo "|---|---|---|---|---|---|"
SHAPE=(--layers 6 --dim 384 --heads 6 --seq 256 --batch-size 32)
STEPS=5
for r in none selective full; do
  read -r tok mem <<<"$(ours 1 2 --recompute "$r")"
  heap=$(python3 -c "import json; print('%.0f' % (json.load(open('$OUT/last.json'))['peak_heap_bytes'][0] / 2**20))")
  if [ "$r" = none ]; then NONE=("$tok" "$mem"); fi
  printf '| --recompute %s | %.0f | %s | %s | %s | %s |\n' "$r" "$tok" "$mem" "$heap" \
    "$(python3 -c "print('%.2f' % (${NONE[0]} / $tok))")" \
    "$(python3 -c "print('%.2f' % ($mem / ${NONE[1]}))")"
done

# A size that does not fit one rank's budget of 1.5 GiB: L=12, D=768,
# H=12 (GPT-2 small's blocks), T=256, batch 8. One rank is refused by the
# memory plan before it allocates; split over 2 ranks (under mpiexec, 3 GiB
# for the node) it trains.
BIG=(--layers 12 --dim 768 --heads 12 --seq 256 --batch-size 8)
echo
echo "| GPT-2 small's blocks, T = 256, budget 1.5 GiB per rank | tokens/s | peak MiB per rank |"
echo "|---|---|---|"
if SHARDNET_MEMORY_LIMIT=1536M "$BIN" train gpt "${BIG[@]}" --ranks 1 --max-steps 1 --no-eval \
    >"$OUT/one.txt" 2>&1; then
  echo "| 1 rank | (fitted: the budget check did not refuse it) | |"
else
  est=$(grep -o 'the plan estimates [^,]*' "$OUT/one.txt" | head -1 | sed 's/the plan estimates //')
  echo "| 1 rank | refused before allocating: the plan estimates $est | - |"
fi
SHAPE=("${BIG[@]}")
STEPS=6
for split in "--pipeline 2 --micro-batches 4" "--tensor-parallel 2 --recompute full"; do
  read -r tok mem <<<"$(SHARDNET_MEMORY_LIMIT=3G ours 2 1 $split)"
  printf '| 2 ranks, %s | %.0f | %s |\n' "$split" "$tok" "$mem"
done
rm -rf "$OUT"
