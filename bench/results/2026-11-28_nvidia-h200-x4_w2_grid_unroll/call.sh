#!/usr/bin/env bash
# Call E1 (2026-11-28 session 3). GPUs 0,1: all_reduce / all_gather / reduce_scatter kernels at
# 1-64 MiB with four builds of the library (base = main 159a1db; u4 = one-shot loads 4 vectors
# per thread before storing; g64 = grid cap 64 instead of 36; g64u4 = both), torch's symm-mem
# two-shot in the same process; then the norm table at 1..2048 tokens of hidden 7168 and the
# MoE table. GPUs 2,3: tests/gpu, layer steps and train_step on main (never-run commits).
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
mkdir -p "$OUT/a" "$OUT/b" /tmp/v
for v in base u4 g64 g64u4; do xz -dc diag/v/$v.so.xz > /tmp/v/$v.so; done
( export CUDA_VISIBLE_DEVICES=0,1; A=$OUT/a
  s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; ((t > 535 - SECONDS)) && t=$((535 - SECONDS)); ((t < 15)) && { echo "$n: SKIPPED" >>"$A/summary.txt"; return; }; timeout "$t" "$@" >"$A/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s" >>"$A/summary.txt"; }
  F=(-b 1M -e 64M -f 4 -n 20 -w 5 -G 10 -R 3)
  for v in base u4 g64 g64u4; do
    s ar_$v 60 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench all_reduce -g 2 "${F[@]}" --algo custom-oneshot,custom-twoshot,symm_mem-twoshot --json "$A/ar_$v.json"
  done
  for v in base g64; do
    s ag_$v 50 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench all_gather -g 2 "${F[@]}" --algo custom-push,nccl --json "$A/ag_$v.json"
    s rs_$v 50 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench reduce_scatter -g 2 "${F[@]}" --algo custom-oneshot,nccl --json "$A/rs_$v.json"
  done
  s norm 110 symcomm-bench all_reduce_rmsnorm -g 2 -b 14336 -e 29360128 -f 2 -n 20 -w 5 -G 10 -R 3 --algo all --json "$A/norm.json"
  s moe 110 symcomm-bench moe -g 2 --tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo all --json "$A/moe.json"
) &
( export CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 MASTER_PORT=29611 SKIP_BUILD=1 COMMIT=159a1db TEST_TIMEOUT=240 DEADLINE=530 PART=all ONLY="tests_gpu layer_step_* train_step"
  bash scripts/gpu_check.sh verify "$OUT/b" >"$OUT/b/screen.txt" 2>&1 ) &
wait
cat "$OUT/a/summary.txt"; tail -30 "$OUT/b/screen.txt"
for f in "$OUT"/a/ar_*.log "$OUT"/a/ag_*.log "$OUT"/a/rs_*.log; do echo "== $f"; grep -A12 "^# Summary" "$f" | grep "│" ; done
tar -czf "$OUT/e1.tgz" -C "$OUT" a b build.log && rm -rf "$OUT/a" "$OUT/b"
