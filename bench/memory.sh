#!/usr/bin/env bash
# Each rank's memory by part: for VGG16 (synthetic 32x32 images, batch 32
# and 128), the wide MLP under GPipe and 1F1B, the face head's backbone
# and the GPT, on 1 rank (one process, 2 threads) and on 2 ranks (one
# MPI process each, one thread) in each split (the MLP also as 2 data-
# parallel pipelines of 2 stages on 4 ranks, and as 4 on 8), with the
# optimizer's state whole or sharded over the replicas (--shard-state
# optimizer), the gradients too (gradients: VGG16, the MLP), or everything
# sharded (--shard-state parameters; the face head's backbone too); VGG16
# and the face head also on 4 ranks. From each run's --metrics: samples/s, the
# peak resident memory of each rank's process, its baseline (resident
# before the model was built: code, runtime, threads), the heap's peak (what
# was live, from the counting allocator), and that peak by part (what the
# process held of each when the heap peaked). The difference between the
# resident peak and the heap peak is the baseline and the freed blocks the
# allocator keeps for reuse. The GPT also fully sharded (--shard-state
# parameters, with --recompute full). Then the GPT's and VGG16's data
# parallelism on 2 ranks beside PyTorch's DDP and FSDP2 (bench/torch_gpt.py,
# bench/torch_vgg16.py), where torch and NumPy are installed (torch_gpt.py fails without NumPy).
#
# MNIST is found as the CLI finds it (SHARDNET_DATA, --data's default).
#
# Usage: bash bench/memory.sh     (about 35 minutes)
# Environment: STEPS=13 (2 of them warm-up)
set -euo pipefail
cd "$(dirname "$0")/.."
export MPICC=${MPICC:-/usr/bin/mpicc.mpich}
cargo build --release --features mpi -q
BIN=target/release/shardnet
MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
STEPS=${STEPS:-13}

echo "| run | samples/s | peak MiB per rank | baseline | heap peak | parameters | gradients | optimizer | activations | communication | data | other |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"

# row NAME RANKS MODEL [FLAGS...]: RANKS 1 is one process on 2 threads,
# more are MPI processes of one thread each. Parts are MiB at each
# process's heap peak, ranks separated by /.
row() {
  local name=$1 ranks=$2 f="$OUT/m.json"; shift 2
  local args=(train "$@" --max-steps "$STEPS" --warmup-steps 2 --no-eval --metrics "$f")
  rm -f "$f"
  if [ "$ranks" = 1 ]; then
    RAYON_NUM_THREADS=2 "$BIN" "${args[@]}" --ranks 1 >/dev/null 2>"$OUT/err" || { echo "| $name | failed: $(tail -1 "$OUT/err") |"; return; }
  else
    RAYON_NUM_THREADS=1 "$MPIEXEC" -n "$ranks" "$BIN" "${args[@]}" --comm mpi >/dev/null 2>"$OUT/err" || { echo "| $name | failed: $(tail -1 "$OUT/err") |"; return; }
  fi
  python3 - "$f" "$name" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
mib = lambda b: '%.0f' % (b / 2**20)
per = lambda xs: ' / '.join(mib(x) for x in xs)
parts = m['peak_heap_parts']
cells = [per(p[k] for p in parts) for k in
         ('parameters', 'gradients', 'optimizer', 'activations', 'communication', 'data', 'other')]
print('| %s | %.0f | %s | %s | %s | %s |' % (
    sys.argv[2], m['epochs'][0]['samples_per_s'], per(m['peak_memory_bytes']),
    per(m['baseline_memory_bytes']), per(m['peak_heap_bytes']), ' | '.join(cells)))
EOF
}

for b in 32 128; do
  V=(vgg16 --dataset synthetic --synthetic-examples 2048 --batch-size "$b")
  row "VGG16, batch $b, 1 rank" 1 "${V[@]}"
  row "VGG16, batch $b, exact input split" 2 "${V[@]}" --parallel-conv input
  row "VGG16, batch $b, exact output split" 2 "${V[@]}" --parallel-conv output
  row "VGG16, batch $b, data parallel, --shard-state none" 2 "${V[@]}" --parallel-conv none --data-parallel 2 --shard-state none
  row "VGG16, batch $b, data parallel, --shard-state optimizer" 2 "${V[@]}" --parallel-conv none --data-parallel 2
  row "VGG16, batch $b, data parallel, --shard-state gradients" 2 "${V[@]}" --parallel-conv none --data-parallel 2 --shard-state gradients
  row "VGG16, batch $b, data parallel, --shard-state parameters" 2 "${V[@]}" --parallel-conv none --data-parallel 2 --shard-state parameters
done
# 4 ranks (4 MPI processes on the machine's cores: memory, not speed):
# each exact split, data parallelism fully sharded, and a 2 × 2 grid.
V=(vgg16 --dataset synthetic --synthetic-examples 2048 --batch-size 128)
row "VGG16, batch 128, 4 ranks, exact input split" 4 "${V[@]}" --parallel-conv input
row "VGG16, batch 128, 4 ranks, exact output split" 4 "${V[@]}" --parallel-conv output
row "VGG16, batch 128, 4 ranks, data parallel, --shard-state parameters" 4 "${V[@]}" --parallel-conv none --data-parallel 4 --shard-state parameters
row "VGG16, batch 128, 4 ranks, input split × 2 replicas, --shard-state parameters" 4 "${V[@]}" --parallel-conv input --data-parallel 2 --shard-state parameters

M=(mnist-mlp --units 4096 --batch-size 3200 --micro-batches 8)
row "MLP 4096 units, 2 stages on 1 rank, M = 8" 1 "${M[@]}" --stages 2 --schedule gpipe
for s in gpipe 1f1b; do
  row "MLP 4096 units, 2 stages, $s, M = 8" 2 "${M[@]}" --stages 2 --schedule "$s"
done
# 2 pipelines of 2 stages (4 ranks), each on its half of a batch of 6400
# (3200 a pipeline, as above), sharding more and more over the 2 groups:
# ranks 1 and 3 hold the second stage (4096 x 4096 and 4096 x 10), ranks 0
# and 2 the first (784 x 4096); rank 0 also MNIST. Fewer steps: memory.
D=(mnist-mlp --units 4096 --batch-size 6400 --micro-batches 8 --stages 2 --data-parallel 2)
for s in gpipe 1f1b; do
  for st in none optimizer gradients parameters; do
    STEPS=5 row "MLP 4096 units, 2 stages × 2 replicas, $s, M = 8, --shard-state $st" 4 "${D[@]}" --schedule "$s" --shard-state "$st"
  done
done
# Fully sharded with each weight gathered whole (--gather-block-mib 0), not
# 8 MiB at a time: what the blocks save.
STEPS=5 row "MLP 4096 units, 2 stages × 2 replicas, 1f1b, M = 8, --shard-state parameters --gather-block-mib 0" 4 "${D[@]}" --schedule 1f1b --shard-state parameters --gather-block-mib 0
# 4 pipelines of 2 stages (8 ranks), 3200 a pipeline as above: each
# share a quarter of its layer.
D4=(mnist-mlp --units 4096 --batch-size 12800 --micro-batches 8 --stages 2 --data-parallel 4)
for s in gpipe 1f1b; do
  for st in optimizer parameters; do
    STEPS=5 row "MLP 4096 units, 2 stages × 4 replicas, $s, M = 8, --shard-state $st" 8 "${D4[@]}" --schedule "$s" --shard-state "$st"
  done
done

H=(face-head --classes 100000 --batch-size 256)
row "face head, 100k classes, 1 rank" 1 "${H[@]}"
row "face head, 100k classes, 2 ranks" 2 "${H[@]}"
row "face head, 100k classes, 4 ranks" 4 "${H[@]}"
for n in 2 4; do
  row "face head, 100k classes, $n ranks, --shard-state parameters" "$n" "${H[@]}" --shard-state parameters
done

G=(gpt --layers 6 --dim 384 --heads 6 --seq 256 --batch-size 8 --lr-warmup 2)
row "GPT, 1 rank" 1 "${G[@]}"
row "GPT, d = 2" 2 "${G[@]}" --data-parallel 2
row "GPT, d = 2, --shard-state optimizer" 2 "${G[@]}" --data-parallel 2 --shard-state optimizer
row "GPT, d = 2, --recompute full" 2 "${G[@]}" --data-parallel 2 --recompute full
row "GPT, d = 2, --recompute full --shard-state optimizer" 2 "${G[@]}" --data-parallel 2 --recompute full --shard-state optimizer
row "GPT, d = 2, --recompute full --shard-state parameters" 2 "${G[@]}" --data-parallel 2 --recompute full --shard-state parameters
row "GPT, t = 2" 2 "${G[@]}" --tensor-parallel 2
row "GPT, t = 2, sequence parallel" 2 "${G[@]}" --tensor-parallel 2 --sequence-parallel
row "GPT, p = 2, 1F1B, M = 4" 2 "${G[@]}" --pipeline 2 --micro-batches 4 --schedule 1f1b

# The GPT's data parallelism on 2 ranks beside PyTorch's (bench/torch_gpt.py:
# the same model, data and AdamW; gloo, one thread a process): DDP, and
# FSDP2's fully_shard on each block and the whole with each block
# checkpointed (torch.utils.checkpoint), against ours fully sharded with
# full recomputation.
if python3 -c "import torch, numpy" 2>/dev/null; then
  echo
  echo "| GPT, 2 ranks | shardnet tokens/s | shardnet peak MiB per rank | PyTorch tokens/s | PyTorch peak MiB per rank | shardnet / PyTorch |"
  echo "|---|---|---|---|---|---|"
  pair() {  # name "our flags" "their flags"
    local f="$OUT/p.json"
    RAYON_NUM_THREADS=1 "$MPIEXEC" -n 2 "$BIN" train "${G[@]}" --max-steps "$STEPS" --warmup-steps 2 \
      --no-eval --metrics "$f" --comm mpi --data-parallel 2 $2 >/dev/null 2>&1
    read -r otok omem <<<"$(python3 -c "
import json; m = json.load(open('$f'))
print(m['epochs'][0]['samples_per_s'], ' / '.join('%.0f' % (b / 2**20) for b in m['peak_memory_bytes']))")"
    read -r ttok tmem <<<"$(python3 bench/torch_gpt.py --ranks 2 --layers 6 --dim 384 --heads 6 --seq 256 \
      --batch-size 8 --steps "$((STEPS - 2))" --warmup 2 $3 2>/dev/null | tail -1 | python3 -c "
import json, sys; m = json.loads(sys.stdin.read())
print(m['tokens_per_s'], ' / '.join('%.0f' % p for p in m['peak_rss_mb']))")"
    printf '| %s | %.0f | %s | %.0f | %s | %.2f |\n' "$1" "$otok" "$omem" "$ttok" "$tmem" \
      "$(python3 -c "print($otok / $ttok)")"
  }
  pair "data parallel (PyTorch: DDP)" "" "--scheme ddp"
  pair "fully sharded, full recompute (PyTorch: FSDP2 + checkpoint)" \
    "--shard-state parameters --recompute full" "--scheme fsdp --recompute full"
  pair "optimizer sharded, full recompute (PyTorch: FSDP2 + checkpoint)" \
    "--shard-state optimizer --recompute full" "--scheme fsdp --recompute full"

  # VGG16's data parallelism beside PyTorch's (bench/torch_vgg16.py: the
  # same model and Adam on the same synthetic images' shape; PyTorch's
  # batch norm per process): DDP, and FSDP2's fully_shard per layer.
  echo
  echo "| VGG16, batch 128, 2 ranks | shardnet images/s | shardnet peak MiB per rank | PyTorch images/s | PyTorch peak MiB per rank | shardnet / PyTorch |"
  echo "|---|---|---|---|---|---|"
  vpair() {  # name "our flags" "their flags"
    local f="$OUT/v.json"
    RAYON_NUM_THREADS=1 "$MPIEXEC" -n 2 "$BIN" train vgg16 --dataset synthetic --synthetic-examples 2048 \
      --batch-size 128 --parallel-conv none --data-parallel 2 --max-steps "$STEPS" --warmup-steps 2 \
      --no-eval --metrics "$f" --comm mpi $2 >/dev/null 2>&1
    read -r oimg omem <<<"$(python3 -c "
import json; m = json.load(open('$f'))
print(m['epochs'][0]['samples_per_s'], ' / '.join('%.0f' % (b / 2**20) for b in m['peak_memory_bytes']))")"
    python3 bench/torch_vgg16.py $3 --threads 1 --batch 128 --steps "$((STEPS - 2))" --warmup 2 \
      >"$OUT/t.out" 2>"$OUT/t.err"
    timg=$(tail -1 "$OUT/t.out" | cut -d, -f6)
    tmem=$(grep '^# peak_rss_mb' "$OUT/t.err" | sed 's/^# peak_rss_mb //')
    printf '| %s | %.0f | %s | %.0f | %s | %.2f |\n' "$1" "$oimg" "$omem" "$timg" "$tmem" \
      "$(python3 -c "print($oimg / $timg)")"
  }
  vpair "data parallel, --shard-state none (PyTorch: DDP)" "--shard-state none" "--ddp 2"
  vpair "fully sharded (PyTorch: FSDP2)" "--shard-state parameters" "--fsdp 2"
fi
