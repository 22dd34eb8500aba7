#!/usr/bin/env bash
# Packs FlashInfer for the GPU machine, which has no network and takes at most 64 MiB of
# working tree a call: flashinfer-python's wheel alone is 62 MB and, with apache-tvm-ffi and
# cuda-bindings, over that limit, and it compiles its kernels at first use (about 5 minutes
# for the all-reduce fusion module on two cores). So this, run on a machine with network and
# nvcc:
#   - keeps the wheel's Python files, headers and the three all-reduce sources, drops the rest
#     of its kernel sources (about 420 MB unpacked, 157 MB kept, 16 MB as .tar.xz);
#   - compiles the trtllm_comm module here for sm_90a and places it where FlashInfer looks for
#     a prebuilt module (data/aot/trtllm_comm/), so the GPU machine never compiles;
#   - adds the apache-tvm-ffi wheel for Python 3.12 (the GPU image's; the image has
#     cuda-bindings, nvidia-ml-py, tqdm and einops already).
#
#   bash bench/flashinfer_pack.sh [DEST]      (default .fi; add "/.fi/" to .git/info/exclude)
#
# On the GPU machine, with DEST carried:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl
#   tar xJf .fi/flashinfer.tar.xz -C /tmp/site
#   PYTHONPATH=/tmp/site:$PWD FLASHINFER_DISABLE_JIT=1 torchrun --nproc-per-node=N bench/flashinfer_norm.py
set -euo pipefail
DEST=$(realpath -m "${1:-.fi}")
VERSION=0.7.2.post1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}

"$PY" -m pip download -q --no-deps flashinfer-python=="$VERSION" -d "$WORK/wheel"
for py in 3.12 "$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 apache-tvm-ffi==0.1.15.post2 -d "$WORK/tvm$py"
done
mkdir -p "$WORK/full" "$WORK/site"
(cd "$WORK/full" && unzip -q "$WORK"/wheel/*.whl)

# Trim: every .py, the dist-info, the headers under data/ except the kernel sources, of which
# only the all-reduce ones (and csrc's own headers) stay.
KERNELS=flashinfer/data/csrc
(cd "$WORK/full" && find . -type f | sed 's|^\./||' | while read -r f; do
  case $f in
    *.py|*.dist-info/*) echo "$f" ;;
    "$KERNELS"/trtllm_allreduce.cu|"$KERNELS"/trtllm_allreduce_fusion.cu|\
    "$KERNELS"/trtllm_moe_allreduce_fusion.cu|"$KERNELS"/*.h) echo "$f" ;;
    "$KERNELS"/*) ;;
    flashinfer/data/*) echo "$f" ;;
    *.cu|*.cuh|*.cubin|*.so) ;;
    *) if [[ $(stat -c %s "$f") -lt 200000 ]]; then echo "$f"; fi ;;  # not `&&`: set -e
  esac
done) >"$WORK/keep.txt"
tar -C "$WORK/full" -cf - -T "$WORK/keep.txt" | tar -C "$WORK/site" -xf -

# Compile the module with FlashInfer's own build (ninja), then link it here: its link line
# names -lcuda, which a machine without a driver lacks, and the module calls only the runtime.
# Importing flashinfer to build needs what it imports (torch comes from $PY's environment).
"$PY" -m pip install -q --no-deps --target "$WORK/site" "$WORK"/tvm"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"/*.whl
"$PY" -m pip install -q --target "$WORK/deps" requests nvidia-ml-py tqdm einops tabulate click packaging ninja \
  cuda-bindings cuda-pathfinder
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$WORK/ws" PATH="$WORK/deps/bin:$PATH"
PYTHONPATH="$WORK/site:$WORK/deps" "$PY" -c '
from flashinfer.jit.comm import gen_trtllm_comm_module
spec = gen_trtllm_comm_module()
try:
    spec.build()
except RuntimeError as exc:  # the link step; the objects are what is needed
    print("FlashInfer link step failed here, linking by hand:", str(exc).splitlines()[-3:])
print(spec.build_dir)' | tee "$WORK/build.txt"
BUILD=$(tail -1 "$WORK/build.txt")
CUDA_LIB=${CUDA_LIB:-$(ls -d "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda-*/lib64 2>/dev/null | head -1)}
mkdir -p "$WORK/site/flashinfer/data/aot/trtllm_comm"
c++ "$BUILD"/*.o -shared -L"$CUDA_LIB" -lcudart -o "$WORK/site/flashinfer/data/aot/trtllm_comm/trtllm_comm.so"

mkdir -p "$DEST"
rm -rf "$WORK/site/tvm_ffi" "$WORK"/site/apache_tvm_ffi*  # the GPU machine installs its own (3.12) copy
tar -C "$WORK/site" -cJf "$DEST/flashinfer.tar.xz" flashinfer "flashinfer_python-$VERSION.dist-info"
cp "$WORK"/tvm3.12/*.whl "$DEST/"
ls -la "$DEST"
