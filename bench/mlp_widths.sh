#!/usr/bin/env bash
# When does splitting an MLP within its layers pay? Training samples/s against
# the hidden width U, batch 100 and 1000, 1 rank against 2 (one core each), for
# shardnet's tensor-parallel MLP, Chainer's MnistMLPParallel scheme and the
# 2-stage pipeline, next to PyTorch (bench/torch_mlp_tensor_parallel.py: one
# process with 1 and 2 threads, Megatron-style tensor parallel over 2 gloo
# processes, MnistMLPParallel over 2 processes).
#
# Usage: bash bench/mlp_widths.sh [CSV [PNG]]
#   (default bench/mlp_widths.csv and bench/mlp_widths.png; writes the CSV,
#   prints a markdown table and the crossovers, draws the PNG with
#   examples/plot_widths.rs)
# Environment:
#   UNITS="100 250 ..."   widths (default 100 250 500 1000 2000 4000 8000 16000)
#   BATCHES="100 1000"    batch sizes
#   RUN_SECONDS=3         timed seconds aimed at per run (one core), at least 1 timed step
#   LOCK=/tmp/cargo.lock  wrap every build and every run, one at a time, in flock LOCK
#                         (on a shared machine: no build overlaps a measurement)
#   PLOT_ONLY=1           skip the runs: table and PNG from an existing CSV
# Every run is short: the number of steps comes from an estimate of the step's
# multiply-adds at 60 GFLOP/s; 2 warm-up steps (1 where a step takes over a
# second). Chainer's scheme is skipped at U > 8000 (3U² parameters: 12 GB of
# parameters, gradients and Adam moments at U = 16000, and ~75 s per step of
# batch 1000 on one core).
set -euo pipefail
cd "$(dirname "$0")/.."
CSV=${1:-bench/mlp_widths.csv}
PNG=${2:-bench/mlp_widths.png}
UNITS=${UNITS:-"100 250 500 1000 2000 4000 8000 16000"}
BATCHES=${BATCHES:-"100 1000"}
RUN_SECONDS=${RUN_SECONDS:-3}
export SHARDNET_DATA="${SHARDNET_DATA:-$(pwd)/../shared/data}" RAYON_NUM_THREADS=1
BIN=target/release/shardnet
TORCH=bench/torch_mlp_tensor_parallel.py

locked() { if [ -n "${LOCK:-}" ]; then flock "$LOCK" "$@"; else "$@"; fi; }

# Multiply-adds per example of a training step's forward (x 6 for forward and
# backward in flops): the 784-U-U-10 MLP, or Chainer's four half-width MLPs.
macs() {  # scheme units
  if [ "$1" = chainer ]; then echo $((3 * $2 * $2 + 794 * $2)); else echo $(($2 * $2 + 794 * $2)); fi
}

# warm-up and timed steps for a run: about RUN_SECONDS of one core's work.
plan() {  # scheme units batch -> "warmup timed"
  local ms=$(($3 * $(macs "$1" "$2") / 10000000))  # 6 flops / 60 GFLOP/s, in ms
  local timed=$((RUN_SECONDS * 1000 / (ms > 0 ? ms : 1)))
  local cap=$((60000 / $3 / 2))  # stay inside one epoch of MNIST
  timed=$((timed < 1 ? 1 : (timed > cap ? cap : timed)))
  echo "$((ms < 1000 ? 2 : 1)) $timed"
}

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

shardnet() {  # scheme ranks micro units batch
  local scheme=$1 ranks=$2 m=$3 u=$4 b=$5 w t args f="$OUT/m.json"
  read -r w t < <(plan "$scheme" "$u" "$b")
  case $scheme in
    tensor) args=(train mnist-mlp --parallel tensor) ;;
    chainer) args=(train mnist-mlp-parallel) ;;
    pipeline) args=(train mnist-mlp --stages 2 --micro-batches "$m") ;;
  esac
  rm -f "$f"
  if ! locked "$BIN" "${args[@]}" --units "$u" --batch-size "$b" --ranks "$ranks" --comm local \
      --max-steps $((w + t)) --warmup-steps "$w" --epochs 1 --no-eval --metrics "$f" >"$OUT/log" 2>&1; then
    echo "failed: shardnet $scheme ranks $ranks M $m U $u B $b" >&2; tail -3 "$OUT/log" >&2; return
  fi
  local sps
  sps=$(python3 -c "import json; print(json.load(open('$f'))['epochs'][0]['samples_per_s'])")
  echo "shardnet,$scheme,$ranks,1,$m,$b,$u,$w,$t,$sps" >>"$CSV"
  echo "shardnet $scheme ranks=$ranks M=$m U=$u B=$b: $sps samples/s ($t timed steps)" >&2
}

pytorch() {  # scheme ranks threads units batch
  local scheme=$1 ranks=$2 threads=$3 u=$4 b=$5 w t sps
  read -r w t < <(plan "$scheme" "$u" "$b")
  if ! sps=$(locked python3 "$TORCH" --scheme "$scheme" --ranks "$ranks" --threads "$threads" \
      --units "$u" --batch-size "$b" --steps "$t" --warmup "$w" 2>"$OUT/log" \
      | python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['samples_per_s'])"); then
    echo "failed: pytorch $scheme ranks $ranks threads $threads U $u B $b" >&2; tail -3 "$OUT/log" >&2; return
  fi
  echo "pytorch,$scheme,$ranks,$threads,1,$b,$u,$w,$t,$sps" >>"$CSV"
  echo "pytorch $scheme ranks=$ranks threads=$threads U=$u B=$b: $sps samples/s ($t timed steps)" >&2
}

if [ -z "${PLOT_ONLY:-}" ]; then
  locked cargo build --release --features mpi -q
  echo "impl,scheme,ranks,threads,micro_batches,batch,units,warmup,timed_steps,samples_per_s" >"$CSV"
  for u in $UNITS; do
    for b in $BATCHES; do
      for r in 1 2; do shardnet tensor "$r" 1 "$u" "$b"; done
      if [ "$u" -le 8000 ]; then
        for r in 1 2; do shardnet chainer "$r" 1 "$u" "$b"; done
      fi
      for r in 1 2; do shardnet pipeline "$r" 1 "$u" "$b"; done
      shardnet pipeline 2 4 "$u" "$b"
      for th in 1 2; do pytorch single 1 "$th" "$u" "$b"; done
      pytorch tensor 2 1 "$u" "$b"
      if [ "$u" -le 8000 ]; then
        for r in 1 2; do pytorch chainer "$r" 1 "$u" "$b"; done
      fi
    done
  done
fi

# The table and the crossovers, from the CSV.
python3 - "$CSV" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
sps = {}
for r in rows:
    sps[(r["impl"], r["scheme"], int(r["ranks"]), int(r["threads"]), int(r["micro_batches"]),
         int(r["batch"]), int(r["units"]))] = float(r["samples_per_s"])
batches = sorted({int(r["batch"]) for r in rows})
units = sorted({int(r["units"]) for r in rows})
# (name, 1-core key, parallel keys): keys without batch and units.
groups = [
    ("shardnet tensor", ("shardnet", "tensor", 1, 1, 1), [("shardnet", "tensor", 2, 1, 1)]),
    ("shardnet MnistMLPParallel", ("shardnet", "chainer", 1, 1, 1), [("shardnet", "chainer", 2, 1, 1)]),
    ("shardnet pipeline", ("shardnet", "pipeline", 1, 1, 1),
     [("shardnet", "pipeline", 2, 1, 1), ("shardnet", "pipeline", 2, 1, 4)]),
    ("PyTorch one process", ("pytorch", "single", 1, 1, 1), [("pytorch", "single", 1, 2, 1)]),
    ("PyTorch tensor", ("pytorch", "single", 1, 1, 1), [("pytorch", "tensor", 2, 1, 1)]),
    ("PyTorch MnistMLPParallel", ("pytorch", "chainer", 1, 1, 1), [("pytorch", "chainer", 2, 1, 1)]),
]
heads = {
    "shardnet tensor": "shardnet tensor: 1 / 2 ranks",
    "shardnet MnistMLPParallel": "shardnet MnistMLPParallel: 1 / 2 ranks",
    "shardnet pipeline": "shardnet pipeline: 1 / 2 ranks / 2 ranks M=4",
    "PyTorch one process": "PyTorch one process: 1 / 2 threads",
    "PyTorch tensor": "PyTorch tensor: 2 ranks (vs 1 thread)",
    "PyTorch MnistMLPParallel": "PyTorch MnistMLPParallel: 1 / 2 ranks",
}
def fmt(v):
    return "—" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")
print("| B | U | " + " | ".join(heads[g[0]] for g in groups) + " |")
print("|---|---:|" + "---|" * len(groups))
best = {}
for b in batches:
    for u in units:
        cells = []
        for name, one, par in groups:
            v1 = sps.get(one + (b, u))
            vs = [sps.get(k + (b, u)) for k in par]
            got = [v for v in vs if v is not None]
            if v1 is None and not got:
                cells.append("not run")
                continue
            text = " / ".join(fmt(v) for v in ([v1] if name != "PyTorch tensor" else []) + vs)
            if v1 is not None and got:
                s = max(got) / v1
                best[(name, b, u)] = s
                text += f" (**{s:.2f}×**)" if s > 1 else f" ({s:.2f}×)"
            cells.append(text)
        print(f"| {b} | {u} | " + " | ".join(cells) + " |")
print()
print("Speed-up: the best parallel figure over the one-core one. Crossover: the narrowest")
print("width from which 2 ranks (2 threads) beat 1 at every wider measured width.")
print()
for name, _, _ in groups:
    for b in batches:
        us = [u for u in units if (name, b, u) in best]
        if not us:
            continue
        wins = [best[(name, b, u)] > 1 for u in us]
        if not any(wins):
            text = f"never (up to U = {us[-1]})"
        else:
            k = len(us)
            while k > 0 and wins[k - 1]:
                k -= 1
            text = (f"U ≤ {us[0]} already (every measured width)" if k == 0 else
                    f"between U = {us[k - 1]} and U = {us[k]}" if k < len(us) else "—")
            if k == len(us):
                text = f"only at some widths: {[u for u, w in zip(us, wins) if w]}"
        print(f"- {name}, batch {b}: {text}")
EOF

locked cargo build --release --features mpi -q --example plot_widths
target/release/examples/plot_widths "$CSV" "$PNG"
