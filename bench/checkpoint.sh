#!/usr/bin/env bash
# One checkpoint and one resume of the 1M-class sharded head on 2 ranks
# (d = 512: W, Adam's two moments = 6.1 GB in all), next to the disk's
# sequential write (fsync'd) and read (O_DIRECT) speed measured in the same
# run. Page caches are dropped before the disk read and the resume when this
# user may (root); otherwise the read figures may come from memory.
#
#   bash bench/checkpoint.sh [DIR] [CLASSES] [COMM]    (COMM: local or mpi)
#   BIN=path/to/shardnet bash bench/checkpoint.sh …     (another build, for before/after)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-./ckbench}
CLASSES=${2:-1000000}
COMM=${3:-mpi}
mkdir -p "$DIR"
if [ -z "${BIN:-}" ]; then cargo build --release --features mpi -q; fi
B=${BIN:-target/release/shardnet}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(caches not dropped)"; }
launch() {
  if [ "$COMM" = mpi ]; then RAYON_NUM_THREADS=1 mpiexec.mpich -n 2 "$B" "$@" --comm mpi
  else "$B" "$@" --ranks 2 --comm local; fi
}

echo "== disk, sequential, 4 GiB"
dd if=/dev/zero of="$DIR/dd" bs=8M count=512 conv=fsync 2>&1 | tail -1 | sed 's/^/write (fsync): /'
drop
dd if="$DIR/dd" of=/dev/null bs=8M iflag=direct 2>&1 | tail -1 | sed 's/^/read (O_DIRECT): /'
rm -f "$DIR/dd"

MODEL=(train face-head --classes "$CLASSES" --dim 512 --batch-size 256 --steps-per-epoch 4
      --no-eval --margin none)
HEAD=("${MODEL[@]}" --epochs 1)
rm -rf "$DIR/ck" "$DIR/log1" "$DIR/log0"
# First, so that the runs with checkpoints do not start on a warmer machine.
echo "== 4 steps without checkpoints (step times)"
launch "${HEAD[@]}" --log-dir "$DIR/log0" 2>&1 | grep -E "epoch 1" || true
echo "== $CLASSES classes, 2 ranks ($COMM): 4 steps, a checkpoint after step 2 and after step 4"
launch "${HEAD[@]}" --checkpoint-dir "$DIR/ck" --checkpoint-every 2 --keep 1 --stop-after 2 \
  --log-dir "$DIR/log1" 2>&1 | grep -E "checkpoint|stopped" || true
du -sb "$DIR"/ck/step-* | sed 's/^/on disk: /'
drop
echo "== resume on 2 ranks, 2 more steps"
launch "${HEAD[@]}" --checkpoint-dir "$DIR/ck" --checkpoint-every 2 --keep 1 --resume "$DIR/ck" \
  --log-dir "$DIR/log1" 2>&1 | grep -E "resumed|checkpoint" || true
drop
echo "== the checkpoint of step 4 resumed on 3 ranks (re-split; each rank reads its byte ranges)"
launch3() {
  if [ "$COMM" = mpi ]; then RAYON_NUM_THREADS=1 mpiexec.mpich -n 3 "$B" "$@" --comm mpi
  else "$B" "$@" --ranks 3 --comm local; fi
}
# One step more (the run's end is step 4): the read is what is timed.
launch3 "${MODEL[@]}" --resume "$DIR/ck" --epochs 2 --max-steps 5 2>&1 | grep -E "resumed" || true
python3 - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
def times(log):
    t = {}
    prev = None
    for l in open(f"{d}/{log}/steps.jsonl"):
        s = json.loads(l)
        t[s["step"]] = s["samples_per_s"]
    return t
a, b = times("log1"), times("log0")
for k in sorted(b):
    sa = a.get(k); sb = b.get(k)
    ms = lambda v: f"{256 / v * 1e3:.0f} ms" if v else "-"
    print(f"step {k}: with checkpoints {ms(sa)}, without {ms(sb)}")
PY
rm -rf "$DIR/ck"
