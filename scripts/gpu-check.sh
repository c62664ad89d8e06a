#!/usr/bin/env bash
# Prove and measure the CUDA path on one lent GPU: build and pack here,
# then one command there.
#
#   scripts/gpu-check.sh prepare [--out .gpu] [--no-build]
#       Here (no GPU needed): build the release shardnet with `cuda,nccl`
#       (scripts/build-cuda.sh, pinned CUDA 13.0 wheels; no MPI, which the GPU
#       image lacks), into target/gpu; check that it links only against
#       libraries the GPU image has (glibc's, the driver's libcuda.so.1, and
#       CUDA 13's runtime, cuBLAS(Lt), cuRAND, NVRTC and NCCL 2, which the
#       image's PyTorch environment holds); strip and xz it; add MNIST,
#       Debian's fortunes (the GPT's text) and the PyTorch peers
#       (bench/torch_face_head.py, torch_vgg16.py, torch_gpt.py) and a
#       manifest.json. The folder (ignored by git) must stay under 60 MiB: it
#       travels beside the tree, which may be 64 MiB in all.
#
#   scripts/gpu-check.sh run --out DIR [--prepared .gpu] [--budget 450] [...]
#       There: the checks, each under its own timeout, all within --budget
#       seconds (default 450: under 8 minutes); writes DIR/report.md,
#       DIR/report.json and DIR/log.txt whatever happens. The checks and the
#       other flags: scripts/gpu_check.py (`run --help`).
#
# The call on a lent GPU (the device tool), after `prepare` here:
#   run(command="bash scripts/gpu-check.sh run --out $OUT", carry=[".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

usage() { sed -n '2,24p' "$0"; }

prepare() {
  local out=$root/.gpu build=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out=$(realpath -m "$2"); shift ;;
      --no-build) build=0 ;;
      -h|--help) usage; exit 0 ;;
      *) echo "gpu-check prepare: unknown argument '$1' (--out DIR, --no-build)" >&2; exit 2 ;;
    esac
    shift
  done
  local target=$root/target/gpu
  local bin=$target/release/shardnet
  if [ $build = 1 ]; then
    SHARDNET_CUDA_FEATURES=cuda,nccl CARGO_TARGET_DIR=$target scripts/build-cuda.sh
  fi
  [ -x "$bin" ] || { echo "gpu-check prepare: $bin is missing (run without --no-build)" >&2; exit 1; }

  # Only libraries the GPU image has, asked for by name.
  local allowed
  allowed=" $(echo libc.so.6 libm.so.6 libgcc_s.so.1 libstdc++.so.6 libpthread.so.0 libdl.so.2 \
    librt.so.1 ld-linux-x86-64.so.2 libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 \
    libcurand.so.10 libnvrtc.so.13 libnccl.so.2) "
  local needed bad=()
  needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for lib in $needed; do
    [[ $allowed == *" $lib "* ]] || bad+=("$lib")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "gpu-check prepare: the binary needs libraries the GPU image may lack: ${bad[*]}" >&2
    exit 1
  fi
  local glibc
  glibc=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)

  rm -rf "$out"
  mkdir -p "$out/peers" "$out/data"
  strip -o "$out/shardnet" "$bin"
  local raw
  raw=$(stat -c %s "$out/shardnet")
  xz -T2 -9 -f "$out/shardnet"
  cp bench/torch_face_head.py bench/torch_vgg16.py bench/torch_gpt.py \
    bench/torch_mlp_tensor_parallel.py "$out/peers/"
  local data=${SHARDNET_DATA:-$root/../shared/data}
  if [ -d "$data/mnist" ]; then
    cp -r "$data/mnist" "$out/data/"
  else
    echo "gpu-check prepare: no MNIST in $data/mnist (set SHARDNET_DATA): the MNIST checks will fail there" >&2
  fi
  if [ -d /usr/share/games/fortunes ]; then
    mkdir -p "$out/data/fortunes"
    find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' -exec cp {} "$out/data/fortunes/" \;
  else
    echo "gpu-check prepare: no fortunes (apt-get install fortunes): the GPT checks will fail there" >&2
  fi
  python3 - "$out" "$raw" "$glibc" $needed <<'PY'
import hashlib, json, subprocess, sys, datetime
out, raw, glibc, needed = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
packed = open(f"{out}/shardnet.xz", "rb").read()
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                       text=True).stdout.strip()
json.dump({"commit": commit + ("+changes" if dirty else ""), "features": "cuda,nccl",
           "cuda": "13.0", "compute_cap": 90, "built": datetime.datetime.now(datetime.timezone.utc)
           .isoformat(timespec="seconds"), "binary_bytes": raw, "packed_bytes": len(packed),
           "packed_sha256": hashlib.sha256(packed).hexdigest(), "needs": needed, "glibc": glibc},
          open(f"{out}/manifest.json", "w"), indent=2)
PY
  local size
  size=$(du -sb "$out" | cut -f1)
  echo "gpu-check prepare: $out is $((size / 1024 / 1024)) MiB ($size bytes; binary $((raw / 1024 / 1024)) MiB stripped, xz-packed), needs $glibc"
  if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "gpu-check prepare: $out is over 60 MiB: it cannot travel with the tree" >&2
    exit 1
  fi
  if ! git -C "$(dirname "$out")" check-ignore -q "$out/shardnet.xz" 2>/dev/null; then
    echo "gpu-check prepare: note: git does not ignore $out: a folder that travels by carry must be ignored" >&2
  fi
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; exec python3 scripts/gpu_check.py "$@" ;;
  -h|--help|"") usage ;;
  *) echo "gpu-check: unknown command '$1' (prepare or run)" >&2; exit 2 ;;
esac
