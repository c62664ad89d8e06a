#!/usr/bin/env bash
# Pipeline schedules (issue: 1F1B, interleaved, zero-bubble) on the wide MLP
# (U=4096): samples/s and each rank's peak memory per schedule, next to one
# rank with both cores. One MPI process per rank, one core each
# (RAYON_NUM_THREADS=1); the one-rank run has both cores (2 threads).
# Usage: bash bench/pipeline.sh            (PARTS="goal table" picks parts)
# p = 4 runs 4 processes on this 2-core machine: its memory is real, its
# time is not (each rank has half a core).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features mpi -q
BIN=${BIN:-target/release/shardnet}
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
export SHARDNET_DATA="${SHARDNET_DATA:-$(pwd)/../shared/data}"
OUT=$(mktemp -d)

# run NAME RANKS THREADS ARGS... → "samples/s peak-MiB-per-rank(,…)"
run() {
  local ranks=$1 threads=$2; shift 2
  local f="$OUT/$RANDOM.json"
  local args=(train mnist-mlp --units 4096 --epochs 1 --no-eval --metrics "$f" "$@")
  if [ "$ranks" = 1 ]; then
    RAYON_NUM_THREADS=$threads "$BIN" "${args[@]}" --comm local --ranks 1 >/dev/null 2>&1
  else
    RAYON_NUM_THREADS=$threads "$MPIEXEC" -n "$ranks" "$BIN" "${args[@]}" --comm mpi >/dev/null 2>&1
  fi
  python3 - "$f" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
sps = m["epochs"][-1]["samples_per_s"]
peaks = ",".join(str(round(b / 2**20)) for b in m["peak_memory_bytes"])
print(f"{sps:.0f} {peaks}")
PY
}

PARTS=${PARTS:-"goal table"}
for part in $PARTS; do
  case $part in
    goal)
      echo "### Wide MLP, U=4096, 5 stages, B=3200, M=8 (steps 3-5 timed)"
      echo
      echo "| run | samples/s | / one rank, 2 threads | peak MiB per rank |"
      echo "|---|---:|---:|---|"
      read -r base mem < <(run 1 2 --stages 5 --batch-size 3200 --micro-batches 8 --max-steps 5 --warmup-steps 2)
      echo "| 1 rank, 2 threads | $base | 1.00 | $mem |"
      for s in gpipe 1f1b interleaved zero-bubble; do
        read -r sps mem < <(run 2 1 --stages 5 --batch-size 3200 --micro-batches 8 --schedule "$s" --max-steps 5 --warmup-steps 2)
        printf '| 2 ranks, %s | %s | %.3f | %s |\n' "$s" "$sps" "$(python3 -c "print($sps/$base)")" "$mem"
      done
      echo ;;
    table)
      echo "### Per schedule: samples/s and peak MiB per rank (U=4096, B=3200)"
      echo
      echo "| p | stages | M | gpipe | 1f1b | interleaved (V=2) | zero-bubble |"
      echo "|---|---|---|---|---|---|---|"
      for p in 2 4; do
        s=$([ "$p" = 2 ] && echo 5 || echo 8)
        for m in 4 8 16; do
          row="| $p | $s | $m |"
          for sch in gpipe 1f1b interleaved zero-bubble; do
            read -r sps mem < <(run "$p" 1 --stages "$s" --batch-size 3200 --micro-batches "$m" --schedule "$sch" --max-steps 3 --warmup-steps 1)
            row="$row $sps/s, $mem MiB |"
          done
          echo "$row"
        done
      done
      echo ;;
  esac
done
rm -rf "$OUT"
