#!/usr/bin/env bash
# VGG16 (32x32 inputs, batch norm) training images/s, one core per rank:
# shardnet on 1 rank and on 2 ranks with each --parallel-conv kind, on both
# backends (thread ranks and MPI processes), with the bytes each rank
# receives per step; next to PyTorch's plain VGG16 in one process (1 and 2
# threads, bench/torch_vgg16.py) and seed 000's channel-wise parallel scheme
# written with torch.distributed over 2 gloo processes
# (bench/torch_vgg16_channel_parallel.py). Same model, Adam, synthetic data.
#
# Usage: bash bench/vgg16.sh [CSV]        (default bench/vgg16.csv)
# Environment: WIDTH=1.0 BATCHES="32 128" STEPS=4 WARMUP=2
#   LOCK=/tmp/cargo.lock  run every measurement under flock LOCK
set -euo pipefail
cd "$(dirname "$0")/.."
CSV=${1:-bench/vgg16.csv}
WIDTH=${WIDTH:-1.0}
BATCHES=${BATCHES:-"32 128"}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}
export MPICC=${MPICC:-/usr/bin/mpicc.mpich} RAYON_NUM_THREADS=1
BIN=target/release/shardnet
locked() { if [ -n "${LOCK:-}" ]; then flock "$LOCK" "$@"; else "$@"; fi; }
cargo build --release --features mpi -q
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "impl,kind,comm,ranks,threads,batch,width,images_per_s,bytes_received_per_step_rank0" >"$CSV"

ours() {  # comm ranks kind batch
  local comm=$1 n=$2 kind=$3 b=$4 f="$OUT/m.json"
  local args=(train vgg16 --dataset synthetic --synthetic-examples $((b * (STEPS + WARMUP + 1)))
    --width "$WIDTH" --batch-size "$b" --max-steps $((STEPS + WARMUP)) --warmup-steps "$WARMUP"
    --no-eval --parallel-conv "$kind" --metrics "$f")
  if [ "$comm" = mpi ]; then
    locked mpiexec -n "$n" "$BIN" "${args[@]}" --comm mpi >/dev/null 2>&1
  else
    locked "$BIN" "${args[@]}" --ranks "$n" --comm local >/dev/null 2>&1
  fi
  python3 - "$f" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"{m['epochs'][0]['samples_per_s']:.2f},{(m.get('bytes_received_per_step') or [0])[0]:.0f}")
PY
}

for b in $BATCHES; do
  echo "shardnet,none,local,1,1,$b,$WIDTH,$(ours local 1 none "$b")" >>"$CSV"
  for comm in local mpi; do
    for kind in grouped output input; do
      echo "shardnet,$kind,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 "$kind" "$b")" >>"$CSV"
    done
  done
  for t in 1 2; do
    r=$(locked python3 bench/torch_vgg16.py --threads "$t" --batch "$b" --width "$WIDTH" \
      --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | tail -1 | cut -d, -f6)
    echo "pytorch,none,-,1,$t,$b,$WIDTH,$r,0" >>"$CSV"
  done
  r=$(locked python3 bench/torch_vgg16_channel_parallel.py --nproc 2 --batch "$b" --width "$WIDTH" \
    --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | grep '^vgg16' | tail -1 | cut -d, -f6)
  echo "pytorch-distributed,grouped,gloo,2,1,$b,$WIDTH,$r,0" >>"$CSV"
done
echo "| implementation | conv kind | comm | ranks × threads | batch | images/s | bytes received per step (rank 0) |"
echo "|---|---|---|---|---|---|---|"
tail -n +2 "$CSV" | awk -F, '{ printf "| %s | %s | %s | %s × %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $8, $9 }'
