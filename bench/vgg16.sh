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

for b in $BATCHES; do
  echo "shardnet,none,local,1,1,$b,$WIDTH,$(ours local 1 none "$b")" >>"$CSV"
  # The ceilings of 2-rank data parallelism (kind names the measurement;
  # batch is the global batch, each run takes half).
  echo "shardnet,one-rank-half-batch,local,1,1,$b,$WIDTH,$(ours local 1 none $((b / 2)))" >>"$CSV"
  echo "shardnet,two-independent-half-batch,local,2,1,$b,$WIDTH,$(pair $((b / 2)))" >>"$CSV"
  echo "shardnet,none,local,1,2,$b,$WIDTH,$(RAYON_NUM_THREADS=2 ours local 1 none "$b")" >>"$CSV"
  for comm in local mpi; do
    echo "shardnet,data-parallel,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 none "$b" --data-parallel 2)" >>"$CSV"
    echo "shardnet,data-parallel-local-bn,$comm,2,1,$b,$WIDTH,$(ours "$comm" 2 none "$b" --data-parallel 2 --local-batch-norm)" >>"$CSV"
  done
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
  r=$(locked python3 bench/torch_vgg16.py --ddp 2 --threads 1 --batch "$b" --width "$WIDTH" \
    --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | tail -1 | cut -d, -f6)
  echo "pytorch-ddp,data-parallel,gloo,2,1,$b,$WIDTH,$r,0" >>"$CSV"
  r=$(locked python3 bench/torch_vgg16_channel_parallel.py --nproc 2 --batch "$b" --width "$WIDTH" \
    --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | grep '^vgg16' | tail -1 | cut -d, -f6)
  echo "pytorch-distributed,grouped,gloo,2,1,$b,$WIDTH,$r,0" >>"$CSV"
done
echo "| implementation | conv kind | comm | ranks × threads | batch | images/s | bytes received per step (rank 0) |"
echo "|---|---|---|---|---|---|---|"
tail -n +2 "$CSV" | awk -F, '{ printf "| %s | %s | %s | %s × %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $8, $9 }'
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
