#!/usr/bin/env bash
# Final call F1 (2026-11-28 session 4), nvidia-h200-x2, world 2 on the final commit:
# tests/gpu and the six examples, then the same-call comparison with nccl-tests (-R 0, -R 2) and
# PyTorch's symmetric memory (with the link copy), then FlashInfer's all-reduce and fused norm.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?} TEST_TIMEOUT=200
tar xJf diag/nt.tar.xz && chmod +x .nccl-tests/bin/*
mkdir -p "$OUT/f1"; F=$OUT/f1
DEADLINE=330 PART=1 bash scripts/gpu_check.sh verify "$F/v" >"$F/verify_screen.txt" 2>&1
echo "verify part 1: done at $((SECONDS-T0)) s"; tail -12 "$F/verify_screen.txt"
WORLD=2 ROUNDS=3 DEADLINE=180 bash scripts/gpu_check.sh compare "$F/cmp" >"$F/compare_screen.txt" 2>&1
echo "compare: done at $((SECONDS-T0)) s"; tail -45 "$F/compare_screen.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl >"$F/fi_install.log" 2>&1
tar xJf .fi/flashinfer.tar.xz -C /tmp/site
L=$((560 - (SECONDS-T0))); ((L > 90)) && L=90
timeout "$L" env PYTHONPATH=/tmp/site:$PWD FLASHINFER_DISABLE_JIT=1 torchrun --nproc-per-node=2 bench/flashinfer_norm.py \
  --hidden 7168 --rounds 3 --tokens 1,8,64,512,2048 --json "$F/fi.json" >"$F/fi.log" 2>&1
echo "fi: exit $? at $((SECONDS-T0)) s"; grep -v "Deprecation\|handles, workspace\|return lambda\|^tokens .* done" "$F/fi.log" | tail -18
tar -czf "$OUT/f1.tgz" -C "$OUT" f1 build.log && rm -rf "$F"
