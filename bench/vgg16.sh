#!/usr/bin/env bash
# VGG16 (32x32 inputs, batch norm) training images/s, one core per rank:
# shardnet on 1 rank (1 and 2 threads), data-parallel on 2 ranks
# (--parallel-conv none --data-parallel 2, batch norm over the whole
# batch, and with --local-batch-norm: over each replica's images, as
# PyTorch's DDP normalises) and on 2 ranks with each
# --parallel-conv kind, on both backends (thread ranks and MPI processes),
# with the bytes each rank receives per step; next to PyTorch's plain VGG16
# in one process (1 and 2 threads) and under DistributedDataParallel on 2
# gloo processes (bench/torch_vgg16.py --ddp 2), and seed 000's
# channel-wise parallel scheme written with torch.distributed over 2 gloo
# processes (bench/torch_vgg16_channel_parallel.py). Same model, Adam,
# synthetic data. Ends with the scaling of each data-parallel run from its
# one-rank, one-thread run, beside two ceilings measured in the same run
# that no communication can beat: one rank at half the batch (twice its
# images/s: what 2 ranks would reach if a step's fixed costs, the weight
# transforms and Adam, cost nothing more), and two independent one-rank
# runs at half the batch at once (their images/s summed: the same plus
# the cores sharing memory and caches).
#
#
# Every measurement is taken ROUNDS times, the whole sequence repeated
# round after round (so a slow minute of a shared machine touches one
# round of each row, not every round of one row); the CSV and the table
# give each row's median, with its lowest and highest round beside it,
# and the scalings are taken between medians.
#
# Usage: bash bench/vgg16.sh [CSV]        (default bench/vgg16.csv)
# Environment: WIDTH=1.0 BATCHES="32 128" STEPS=4 WARMUP=2 ROUNDS=3
#   LOCK=/tmp/cargo.lock  run every measurement under flock LOCK
set -euo pipefail
cd "$(dirname "$0")/.."
CSV=${1:-bench/vgg16.csv}
WIDTH=${WIDTH:-1.0}
BATCHES=${BATCHES:-"32 128"}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
case $ROUNDS in '' | *[!0-9]* | 0) echo "ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 2 ;; esac
export MPICC=${MPICC:-/usr/bin/mpicc.mpich} RAYON_NUM_THREADS=1
BIN=target/release/shardnet
locked() { if [ -n "${LOCK:-}" ]; then flock "$LOCK" "$@"; else "$@"; fi; }
cargo build --release --features mpi -q
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
RAW="$OUT/rounds.csv"
echo "round,impl,kind,comm,ranks,threads,batch,width,images_per_s,bytes_received_per_step_rank0" >"$RAW"

ours() {  # comm ranks kind batch [extra flags...]
  local comm=$1 n=$2 kind=$3 b=$4 f="$OUT/m.json"
  shift 4
  local args=(train vgg16 --dataset synthetic --synthetic-examples $((b * (STEPS + WARMUP + 1)))
    --width "$WIDTH" --batch-size "$b" --max-steps $((STEPS + WARMUP)) --warmup-steps "$WARMUP"
    --no-eval --parallel-conv "$kind" --metrics "$f" "$@")
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

# Two independent one-rank runs at batch $1 at once: their images/s summed.
pair() {
  local b=$1 f1="$OUT/p1.json" f2="$OUT/p2.json"
  local args=(train vgg16 --dataset synthetic --synthetic-examples $((b * (STEPS + WARMUP + 1)))
    --width "$WIDTH" --batch-size "$b" --max-steps $((STEPS + WARMUP)) --warmup-steps "$WARMUP"
    --no-eval --parallel-conv none --ranks 1 --comm local)
  locked bash -c 'f1=$1 f2=$2; shift 2
    "$@" --metrics "$f1" >/dev/null 2>&1 & p=$!
    "$@" --metrics "$f2" >/dev/null 2>&1; s=$?; wait $p && exit $s' _ "$f1" "$f2" "$BIN" "${args[@]}"
  python3 - "$f1" "$f2" <<'PY'
import json, sys
print(f"{sum(json.load(open(f))['epochs'][0]['samples_per_s'] for f in sys.argv[1:]):.2f},0")
PY
}

for round in $(seq "$ROUNDS"); do
  for b in $BATCHES; do
    echo "$round,shardnet,none,local,1,1,$b,$WIDTH,$(ours local 1 none "$b")" >>"$RAW"
    # The ceilings of 2-rank data parallelism (kind names the measurement;
    # batch is the global batch, each run takes half).
    echo "$round,shardnet,one-rank-half-batch,local,1,1,$b,$WIDTH,$(ours local 1 none $((b / 2)))" >>"$RAW"
    echo "$round,shardnet,two-independent-half-batch,local,2,1,$b,$WIDTH,$(pair $((b / 2)))" >>"$RAW"
    echo "$round,shardnet,none,local,1,2,$b,$WIDTH,$(RAYON_NUM_THREADS=2 ours local 1 none "$b")" >>"$RAW"
    for comm in local mpi; do
      echo "$round,shardnet,data-parallel,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 none "$b" --data-parallel 2)" >>"$RAW"
      echo "$round,shardnet,data-parallel-local-bn,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 none "$b" --data-parallel 2 --local-batch-norm)" >>"$RAW"
    done
    for comm in local mpi; do
      for kind in grouped output input; do
        echo "$round,shardnet,$kind,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 "$kind" "$b")" >>"$RAW"
      done
    done
    for t in 1 2; do
      r=$(locked python3 bench/torch_vgg16.py --threads "$t" --batch "$b" --width "$WIDTH" \
        --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | tail -1 | cut -d, -f6)
      echo "$round,pytorch,none,-,1,$t,$b,$WIDTH,$r,0" >>"$RAW"
    done
    r=$(locked python3 bench/torch_vgg16.py --ddp 2 --threads 1 --batch "$b" --width "$WIDTH" \
      --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | tail -1 | cut -d, -f6)
    echo "$round,pytorch-ddp,data-parallel,gloo,2,1,$b,$WIDTH,$r,0" >>"$RAW"
    r=$(locked python3 bench/torch_vgg16_channel_parallel.py --nproc 2 --batch "$b" --width "$WIDTH" \
      --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | grep '^vgg16' | tail -1 | cut -d, -f6)
    echo "$round,pytorch-distributed,grouped,gloo,2,1,$b,$WIDTH,$r,0" >>"$RAW"
  done
done
# Each row's median over the rounds, with its lowest and highest round.
python3 - "$RAW" "$CSV" <<'PY'
import csv, os, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
key = ("impl", "kind", "comm", "ranks", "threads", "batch", "width")
groups = {}
for r in rows:
    groups.setdefault(tuple(r[k] for k in key), []).append(r)
tmp = sys.argv[2] + ".tmp"  # written whole, then moved into place
with open(tmp, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(list(key) + ["images_per_s", "images_per_s_min", "images_per_s_max",
                            "bytes_received_per_step_rank0", "rounds"])
    for k, rs in groups.items():
        v = [float(r["images_per_s"]) for r in rs if r["images_per_s"] not in ("", "nan")]
        med, lo, hi = (f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}") if v else ("", "", "")
        w.writerow(list(k) + [med, lo, hi, rs[0]["bytes_received_per_step_rank0"], len(v)])
os.replace(tmp, sys.argv[2])
PY
echo "| implementation | conv kind | comm | ranks × threads | batch | images/s (median of $ROUNDS) | lowest–highest round | bytes received per step (rank 0) |"
echo "|---|---|---|---|---|---|---|---|"
tail -n +2 "$CSV" | awk -F, '{ printf "| %s | %s | %s | %s × %s | %s | %s | %s–%s | %s |\n", $1, $2, $3, $4, $5, $6, $8, $9, $10, $11 }'
echo
echo "Data-parallel scaling, 2 ranks against the same implementation's 1 × 1:"
python3 - "$CSV" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def ips(impl, kind, comm, ranks, threads, b):
    for r in rows:
        if (r["impl"], r["kind"], r["comm"], r["ranks"], r["threads"], r["batch"]) == (impl, kind, comm, ranks, threads, b):
            return float(r["images_per_s"] or "nan")
    return float("nan")
for b in sorted({r["batch"] for r in rows}, key=int):
    one, torch1 = ips("shardnet", "none", "local", "1", "1", b), ips("pytorch", "none", "-", "1", "1", b)
    ddp = ips("pytorch-ddp", "data-parallel", "gloo", "2", "1", b)
    for kind in ("data-parallel", "data-parallel-local-bn"):
        for comm in ("local", "mpi"):
            dp = ips("shardnet", kind, comm, "2", "1", b)
            print(f"batch {b}: shardnet {kind} {comm} {dp / one:.2f}x one rank; {dp / ddp:.2f}x PyTorch DDP")
    half = ips("shardnet", "one-rank-half-batch", "local", "1", "1", b)
    two = ips("shardnet", "two-independent-half-batch", "local", "2", "1", b)
    print(f"batch {b}: ceilings without communication: one rank at half the batch, twice, "
          f"{2 * half / one:.2f}x one rank; two independent one-rank runs at half the batch at once {two / one:.2f}x")
    print(f"batch {b}: PyTorch DDP {ddp / torch1:.2f}x one process")
PY
