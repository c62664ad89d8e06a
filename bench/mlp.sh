#!/usr/bin/env bash
# ChainerMN's model-parallel MLP: shardnet (local and MPI) next to PyTorch (gloo), samples/s.
# Each rank has one core (RAYON_NUM_THREADS=1 / torch threads 1).
# Usage: bash bench/mlp.sh   (about 25 minutes; MODELS="seed wide wide-3200" picks rows)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features mpi -q
BIN=target/release/shardnet
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export SHARDNET_DATA="${SHARDNET_DATA:-$(pwd)/../shared/data}" RAYON_NUM_THREADS=1
OUT=$(mktemp -d)
declare -A TORCH  # PyTorch has one backend: measured once per configuration

row() {  # name comm ranks M units stages batch steps (2 of them warm-up)
  local name=$1 comm=$2 ranks=$3 m=$4 u=$5 s=$6 b=$7 steps=$8 f="$OUT/$RANDOM.json"
  local args=(train mnist-mlp --units "$u" --stages "$s" --batch-size "$b" --micro-batches "$m"
              --max-steps "$steps" --warmup-steps 2 --epochs 1 --no-eval --metrics "$f")
  if [ "$comm" = mpi ]; then
    "$MPIEXEC" -n "$ranks" "$BIN" "${args[@]}" --comm mpi >/dev/null 2>&1
  else
    "$BIN" "${args[@]}" --comm local --ranks "$ranks" >/dev/null 2>&1
  fi
  local sps
  sps=$(python3 -c "import json; print(json.load(open('$f'))['epochs'][0]['samples_per_s'])")
  local key="$ranks-$m-$u-$s-$b" t
  if [ -z "${TORCH[$key]:-}" ]; then
    local tstages=$ranks
    TORCH[$key]=$(python3 bench/torch_mlp_pipeline.py --stages "$tstages" --model-stages "$s" --units "$u" \
        --batch-size "$b" --micro-batches "$m" --steps "$((steps - 2))" --warmup 2 --threads 1 2>/dev/null \
        | python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['samples_per_s'])")
  fi
  t=${TORCH[$key]}
  printf '| %s | %s | %s | %s | %.0f | %.0f | %.2f |\n' "$name" "$comm" "$ranks" "$m" "$sps" "$t" \
    "$(python3 -c "print($sps/$t)")"
}

echo "| model | comm | ranks | micro-batches | shardnet samples/s | PyTorch samples/s | shardnet / PyTorch |"
echo "|---|---|---|---|---|---|---|"
# MODELS: which groups of rows (default: all).
MODELS=${MODELS:-"seed wide wide-3200"}
for comm in local mpi; do
  for model in $MODELS; do
    case $model in
      seed)
        row "U=100, 2 stages, B=100" "$comm" 1 1 100 2 100 500
        for m in 1 2 4 8; do row "U=100, 2 stages, B=100" "$comm" 2 "$m" 100 2 100 500; done ;;
      wide)
        row "U=4096, 5 stages, B=800" "$comm" 1 1 4096 5 800 10
        for m in 1 2 4 8; do row "U=4096, 5 stages, B=800" "$comm" 2 "$m" 4096 5 800 10; done ;;
      wide-3200)
        # Micro-batches of 400 rows: GEMMs as efficient as unsplit.
        for m in 1 8; do row "U=4096, 5 stages, B=3200" "$comm" 2 "$m" 4096 5 3200 5; done ;;
    esac
  done
done
rm -rf "$OUT"
