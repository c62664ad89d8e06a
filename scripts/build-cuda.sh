#!/usr/bin/env bash
# Build shardnet with its `cuda` and `nccl` features on a machine with no
# CUDA installed and no GPU needed: the toolkit comes from pinned PyPI
# wheels (NVIDIA's own), unpacked into target/cuda/.
#
#   scripts/build-cuda.sh                  # cargo build --release --features cuda,nccl,mpi
#   scripts/build-cuda.sh --tests          # also the test binaries, and a bundle
#   scripts/build-cuda.sh -- <cargo args>  # any cargo command line after -- (tests run
#                                          # here: the driver stub stands in where no driver is)
#
# What it does, each step skipped when already done:
#   1. pip install --no-deps --target target/cuda/wheels: nvcc, nvvm, crt,
#      cudart, cccl, cuBLAS, cuRAND, NVRTC (CUDA 13.0) and NCCL 2.30;
#   2. target/cuda/home: a CUDA_HOME of the usual layout (bin, include,
#      lib64 with the plain `libX.so` names the linker looks for) made of
#      symlinks into the wheels, and lib64/stubs/libcuda.so: a link stub of the
#      driver API (no wheel ships libcuda; the GPU machine's driver provides
#      the real libcuda.so.1 at run time);
#   3. cargo with CUDA_HOME, PATH to nvcc, CUDA_COMPUTE_CAP (default 90:
#      H100/H200; 80 for A100) and CUDARC_CUDA_VERSION=13000;
#   4. with --tests: target/cuda/bundle/, a folder to copy to a GPU machine:
#      the `shardnet` binary, the test binaries, the runtime libraries from
#      the same wheels and `run` (sets LD_LIBRARY_PATH, runs a command).
#
# Stay on CUDA 13.0: a newer nvcc emits PTX that 13.0-era drivers reject.
# Environment: SHARDNET_CUDA_DIR (default target/cuda), CUDA_COMPUTE_CAP,
# SHARDNET_CUDA_FEATURES (default cuda,nccl,mpi; mpi needs MPICC).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dir=${SHARDNET_CUDA_DIR:-$root/target/cuda}
features=${SHARDNET_CUDA_FEATURES:-cuda,nccl,mpi}
tests=0
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1 ;;
    --) shift; cargo_args=("$@"); break ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "build-cuda.sh: unknown argument '$1' (--tests, or cargo arguments after --)" >&2; exit 2 ;;
  esac
  shift
done

# The pinned wheels: one CUDA release (13.0) and the NCCL built for it.
wheels=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cublas==13.0.2.14
  nvidia-curand==10.4.0.35
  nvidia-cuda-nvrtc==13.0.88
  nvidia-nccl-cu13==2.30.7
)
site=$dir/wheels
stamp=$site/.pinned
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${wheels[*]}" ]; then
  echo "build-cuda: installing ${#wheels[@]} pinned CUDA wheels into $site (about 900 MB)"
  rm -rf "$site"
  python3 -m pip install --quiet --no-deps --target "$site" "${wheels[@]}"
  echo "${wheels[*]}" >"$stamp"
fi
cu=$site/nvidia/cu13
nccl=$site/nvidia/nccl
for f in "$cu/bin/nvcc" "$cu/include/cuda.h" "$cu/lib/libcudart.so.13" "$nccl/lib/libnccl.so.2" "$nccl/include/nccl.h"; do
  [ -e "$f" ] || { echo "build-cuda: $f is missing from the wheels; remove $site and run again" >&2; exit 1; }
done

# A CUDA_HOME of the usual layout.
home=$dir/home
rm -rf "$home"
mkdir -p "$home/lib64/stubs"
ln -s "$cu/bin" "$home/bin"
ln -s "$cu/include" "$home/include"
ln -s "$cu/nvvm" "$home/nvvm"
for lib in "$cu"/lib/*.so.* "$nccl"/lib/*.so.*; do
  name=$(basename "$lib")
  ln -s "$lib" "$home/lib64/$name"
  ln -sf "$lib" "$home/lib64/${name%%.so.*}.so"
done
# nccl.h beside the toolkit's headers, for anything that looks for it there.
export NCCL_INCLUDE_DIR=$nccl/include

# The driver API link stub: every cu* function cudarc's bindings declare,
# as an empty function, in a library named like the driver (soname
# libcuda.so.1), so the binary asks for the real one at run time.
cudarc=$(cargo metadata --format-version 1 --features "$features" 2>/dev/null |
  python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc"))')
python3 - "$(dirname "$cudarc")/src/driver/sys/mod.rs" "$home/lib64/stubs/cuda_stub.c" <<'EOF'
import re, sys
names = sorted(set(re.findall(r"^\s+(?:pub )?fn (cu[A-Za-z0-9_]+)\(", open(sys.argv[1]).read(), re.M)))
with open(sys.argv[2], "w") as out:
    out.write("/* Link stub of the CUDA driver API: never run. */\n")
    # CUDA_ERROR_NO_DEVICE (100): what a machine without a GPU says.
    out.writelines(f"int {n}(void) {{ return 100; }}\n" for n in names)
print(f"build-cuda: link stub of {len(names)} driver functions")
EOF
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" "$home/lib64/stubs/cuda_stub.c"
ln -sf libcuda.so "$home/lib64/stubs/libcuda.so.1"

export CUDA_HOME=$home CUDA_PATH=$home CUDA_ROOT=$home
export PATH=$home/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH=$home/lib64:$home/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
if [[ ",$features," == *,mpi,* ]] && [ -z "${MPICC:-}" ] && [ -x /usr/bin/mpicc.mpich ]; then
  export MPICC=/usr/bin/mpicc.mpich
fi

start=$(date +%s)
if [ ${#cargo_args[@]} -gt 0 ]; then
  # What cargo runs (tests) starts here too: the wheels' libraries, and the
  # driver stub where no driver is installed (every CUDA call then fails,
  # and the GPU tests say they skip).
  stubs=""
  [ -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ] || stubs=":$home/lib64/stubs"
  export LD_LIBRARY_PATH=$home/lib64$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cargo "${cargo_args[@]}"
else
  cargo build --release --features "$features" --bins
  if [ $tests = 1 ]; then
    cargo test --release --features "$features" --no-run
  fi
fi
echo "build-cuda: cargo took $(($(date +%s) - start)) s (compute capability $CUDA_COMPUTE_CAP)"

if [ $tests = 1 ]; then
  # A folder to copy to a GPU machine: binaries, the runtime libraries of
  # the same wheels (not the stub: the driver's libcuda.so.1 is the real one).
  bundle=$dir/bundle
  rm -rf "$bundle"
  mkdir -p "$bundle/lib" "$bundle/tests"
  cp -L "$cu"/lib/*.so.* "$nccl"/lib/libnccl.so.2 "$bundle/lib/"
  cp target/release/shardnet "$bundle/"
  cargo test --release --features "$features" --no-run --message-format json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" "$bundle/tests/"; done
  # MNIST for the tests that train on it (a GPU machine may reach no network).
  data=${SHARDNET_DATA:-$root/../shared/data}
  if [ -d "$data/mnist" ]; then
    mkdir -p "$bundle/data" && cp -r "$data/mnist" "$bundle/data/"
  fi
  cat >"$bundle/run" <<'EOF'
#!/usr/bin/env bash
# Run a command with this bundle's CUDA libraries: ./run ./shardnet selftest --device cuda
# or ./run ./tests/<binary>. The NVIDIA driver (libcuda.so.1) comes from the machine.
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -d "$here/data/mnist" ] && export SHARDNET_DATA=${SHARDNET_DATA:-$here/data}
export SHARDNET_BIN=$here/shardnet
export SHARDNET_REQUIRE_GPU=${SHARDNET_REQUIRE_GPU:-1}
exec "$@"
EOF
  chmod +x "$bundle/run"
  echo "build-cuda: bundle in $bundle ($(du -sh "$bundle" | cut -f1)); copy it to a GPU machine and use ./run"
fi
