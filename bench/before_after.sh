#!/bin/bash
# One training throughput per model and `bench functions`, for comparing two
# binaries (BIN=path/to/shardnet bash bench/before_after.sh; default: this
# tree's release build). Issue 23's before/after table in BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/shardnet}
export SHARDNET_DATA="${SHARDNET_DATA:-$(pwd)/../shared/data}" RAYON_NUM_THREADS=1
OUT=$(mktemp -d)
sps() { python3 -c "import json; e=json.load(open('$1'))['epochs'][0]; print(round(e['samples_per_s'],1))"; }
f=$OUT/a.json; $BIN train mnist-mlp --units 100 --stages 2 --batch-size 100 --micro-batches 1 --max-steps 500 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --comm local --ranks 2 >/dev/null 2>&1; echo "mnist-mlp U=100 B=100 local 2 ranks M=1: $(sps $f) samples/s (BENCHMARKS 99,408)"
f=$OUT/b.json; $BIN train mnist-mlp --units 4096 --stages 5 --batch-size 800 --micro-batches 4 --max-steps 8 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --comm local --ranks 2 >/dev/null 2>&1; echo "mnist-mlp U=4096 5 stages B=800 M=4 local 2 ranks: $(sps $f) samples/s (BENCHMARKS 328)"
f=$OUT/c.json; $BIN train mnist-mlp --parallel tensor --units 1000 --batch-size 100 --max-steps 200 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --comm local --ranks 2 >/dev/null 2>&1; echo "mnist-mlp --parallel tensor U=1000 B=100 2 ranks: $(sps $f) samples/s (BENCHMARKS 8,754)"
f=$OUT/d.json; $BIN train mnist-mlp-parallel --units 1000 --batch-size 100 --max-steps 100 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --comm local --ranks 2 >/dev/null 2>&1; echo "mnist-mlp-parallel U=1000 B=100 2 ranks: $(sps $f) samples/s (BENCHMARKS 4,792)"
f=$OUT/e.json; "$(command -v mpiexec.mpich || command -v mpiexec)" -n 2 $BIN train face-head --comm mpi --classes 100000 --dim 512 --batch-size 256 --max-steps 6 --warmup-steps 1 --steps-per-epoch 6 --epochs 1 --no-eval --metrics $f --margin none >/dev/null 2>&1; echo "face-head 100k plain mpi 2: $(python3 -c "import json; e=json.load(open('$f'))['epochs'][0]; print(round(256/e['samples_per_s']*1000,1))") ms/step (BENCHMARKS 641)"
f=$OUT/g.json; $BIN train vgg16 --dataset synthetic --synthetic-examples 224 --width 1 --batch-size 32 --max-steps 6 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --parallel-conv none --ranks 1 --comm local >/dev/null 2>&1; echo "vgg16 none 1x1 b32: $(sps $f) images/s (BENCHMARKS 38.4)"
f=$OUT/h.json; $BIN train vgg16 --dataset synthetic --synthetic-examples 224 --width 1 --batch-size 32 --max-steps 6 --warmup-steps 2 --epochs 1 --no-eval --metrics $f --parallel-conv output --ranks 2 --comm local >/dev/null 2>&1; echo "vgg16 output local 2x1 b32: $(sps $f) images/s (BENCHMARKS 53.8)"
$BIN bench functions --ranks 2 --comm local 2>&1 | tail -14
