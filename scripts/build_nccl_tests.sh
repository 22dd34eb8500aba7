#!/usr/bin/env bash
# Builds NVIDIA's nccl-tests (the external yardstick of `gpu_check.sh compare`) on a machine
# without a GPU, so that the GPU session spends no device time compiling:
#
#   bash scripts/build_nccl_tests.sh
#
# Four binaries (all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf), MPI=0,
# sm_90 only (H100 and H200; one architecture keeps them small enough to carry), compiled against
# the headers of the nvidia-nccl-cu13 wheel that the GPU image's torch loads, and linked against
# that wheel's libnccl. They land in .nccl-tests/bin/ (ignored by git; the device call carries
# it), with BUILD_INFO saying what they were built from. Objects, the unpacked wheel and the
# wheel itself stay in build/nccl-tests/, which is never carried (libnccl alone is 218 MB).
#
# The binaries find libnccl.so.2 at run time through LD_LIBRARY_PATH, pointed at the GPU image's
# own copy of the same wheel (gpu_check.sh's nccl_tests_env), so the yardstick runs the NCCL that
# symcomm runs. cudart is linked statically: the image's CUDA libraries need not be on the path.
# libstdc++ stays dynamic: built on Debian 12 they need glibc 2.34 and GLIBCXX_3.4.30 (Ubuntu
# 22.04 and later have both), where a static libstdc++ would raise glibc to 2.36.
#
# NCCL_INSTALLED=1 builds against the nvidia-nccl-cu13 that python3 imports instead of a wheel:
# gpu_check.sh's fallback on the GPU machine, with NCCL_TESTS_SRC=.nccl-tests/src.
#
# Settings: NCCL_VERSION (default 2.28.9, the image's), NCCL_TESTS_SRC (default the shared
# checkout in the folder beside the repository: shared, then nccl-tests), NCCL_WHEEL_DIR (a folder that already
# holds the wheel; otherwise it is downloaded into build/nccl-tests/wheel/), CUDA_HOME (default
# /usr/local/cuda), NVCC_GENCODE (default sm_90 only), JOBS (make -j, default the core count).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
NCCL_VERSION=${NCCL_VERSION:-2.28.9}
SRC=${NCCL_TESTS_SRC:-$ROOT/../shared/nccl-tests}
WORK=$ROOT/build/nccl-tests
WHEELS=${NCCL_WHEEL_DIR:-$WORK/wheel}
OUT=$ROOT/.nccl-tests
# /usr/local/cuda, else the toolkit of the nvcc on PATH (which may be a wrapper script elsewhere).
if [[ -z ${CUDA_HOME:-} ]]; then
  CUDA_HOME=/usr/local/cuda
  [[ -x $CUDA_HOME/bin/nvcc ]] || CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
GENCODE=${NVCC_GENCODE:--gencode=arch=compute_90,code=sm_90}
BINARIES=(all_reduce_perf all_gather_perf reduce_scatter_perf alltoall_perf)

[[ -f $SRC/src/Makefile ]] || { echo "no nccl-tests checkout at $SRC (set NCCL_TESTS_SRC)" >&2; exit 1; }
SRC=$(cd "$SRC" && pwd)

# NCCL_HOME as nccl-tests' Makefile wants it: include/ and lib/ with an unversioned libnccl.so
# for the linker (the wheel ships only libnccl.so.2, which is also the name the binaries record).
# Symlinks, so that the GPU machine's fallback build copies nothing out of its 218 MB library.
NCCL=$WORK/nccl-home
stage_nccl() {  # stage_nccl DIR: the folder that holds the headers (include) and libnccl.so.2 (lib)
  rm -rf "$NCCL" && mkdir -p "$NCCL/lib"
  ln -s "$1/include" "$NCCL/include"
  ln -s "$1/lib/libnccl.so.2" "$NCCL/lib/libnccl.so"
}
if [[ -n ${NCCL_INSTALLED:-} ]]; then
  # The GPU machine's own nvidia-nccl-cu13 (no network there): a namespace package, no __file__.
  stage_nccl "$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])')"
else
  # The wheel, the exact version the GPU image has: headers of another NCCL would make
  # nccl-tests refuse to run ("Incompatible NCCL versions") or call functions the library lacks.
  wheel=$(ls "$WHEELS"/nvidia_nccl_cu13-"$NCCL_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [[ -z $wheel ]]; then
    mkdir -p "$WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_18_x86_64 -d "$WHEELS" "nvidia-nccl-cu13==$NCCL_VERSION"
    wheel=$(ls "$WHEELS"/nvidia_nccl_cu13-"$NCCL_VERSION"-*.whl | head -1)
  fi
  unpacked=$WORK/wheel-$NCCL_VERSION
  if [[ ! -f $unpacked/nvidia/nccl/lib/libnccl.so.2 ]]; then
    rm -rf "$unpacked" && python3 -m zipfile -e "$wheel" "$unpacked"
  fi
  stage_nccl "$unpacked/nvidia/nccl"
fi
IFS=. read -r major minor patch <<<"$NCCL_VERSION"
grep -qE "define NCCL_VERSION_CODE +$((major * 10000 + minor * 100 + patch))\$" "$NCCL/include/nccl.h" \
  || { echo "$NCCL/include/nccl.h is not NCCL $NCCL_VERSION" >&2; exit 1; }

# Objects go to BUILDDIR, outside the shared source tree, which stays untouched. Always from
# scratch: make would not relink when only the flags or the NCCL changed.
rm -rf "$WORK/obj"
targets=("${BINARIES[@]/#/$WORK/obj/}")
make -C "$SRC/src" -j "${JOBS:-$(nproc)}" MPI=0 BUILDDIR="$WORK/obj" NCCL_HOME="$NCCL" \
  CUDA_HOME="$CUDA_HOME" NVCC="$CUDA_HOME/bin/nvcc" CUDARTLIB=cudart_static \
  NVCC_GENCODE="$GENCODE" "${targets[@]}"

rm -rf "$OUT/bin"
mkdir -p "$OUT/bin"
# The sources travel too (450 KB, ignored like the rest of .nccl-tests/, never committed): the
# GPU image's system libraries may refuse binaries built here, and its machine has no network,
# so gpu_check.sh compare rebuilds from this copy there (NCCL_INSTALLED=1) when they do.
if [[ $SRC != "$OUT/src" ]]; then
  rm -rf "$OUT/src" && mkdir -p "$OUT/src"
  cp -r "$SRC"/{src,os,verifiable,LICENSE.txt,ORIGIN.txt} "$OUT/src/"
  find "$OUT/src" -name '*.o' -delete
fi
for bin in "${BINARIES[@]}"; do
  # The Makefile builds with -g; symbols and debug info are a fifth of the size, and nothing
  # here debugs nccl-tests. The device code lives in .nv_fatbin, which strip keeps.
  strip -o "$OUT/bin/$bin" "$WORK/obj/$bin"
done
{
  echo "nccl-tests: $(grep -m1 -o 'NCCL_TESTS_VERSION "[^"]*"' "$SRC/src/common.h") from $SRC ($(head -1 "$SRC/ORIGIN.txt" 2>/dev/null || echo 'origin unknown'))"
  echo "nccl headers: $NCCL_VERSION ($(readlink "$NCCL/include")); libnccl.so.2 from LD_LIBRARY_PATH at run time"
  echo "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -1); gencode: $GENCODE; cudart static; MPI=0"
  echo "built: $(date -u +%FT%TZ) on $(uname -n)"
} >"$OUT/BUILD_INFO"
cat "$OUT/BUILD_INFO"
du -b "$OUT"/bin/* | awk '{printf "%8.1f MiB  %s\n", $1 / 1048576, $2}'
du -sb "$OUT" | awk '{printf "total: %.1f MiB (the device call carries at most 64 MiB)\n", $1 / 1048576}'
