#!/usr/bin/env bash
# Smoke call S1 (2026-11-28 session 4), nvidia-h200-x2: the link copy (test + CLI), FlashInfer's
# all-reduce and fused norm beside symcomm's, and a short grid-width probe (64/96/128 blocks).
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS-T0)) s"
S=$OUT/s; mkdir -p "$S" /tmp/v
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version --format=csv; } >"$S/env.txt" 2>&1
s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" >"$S/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s" | tee -a "$S/steps.txt"; }
s link_test 150 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -m pytest tests/gpu/test_bench_link.py -q -rs -p no:cacheprovider >$S/link_test_r\$RANK.log 2>&1"
tail -3 "$S"/link_test_r*.log
s ar_link 90 symcomm-bench all_reduce -g 2 -b 1K -e 256M -f 4 -n 20 -w 5 -G 10 --algo all --json "$S/ar.json"
grep -B3 -A16 "^# Summary" "$S/ar_link.log" | cut -c1-330
python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl >"$S/fi_install.log" 2>&1
tar xJf .fi/flashinfer.tar.xz -C /tmp/site
s fi 200 env PYTHONPATH=/tmp/site:$PWD FLASHINFER_DISABLE_JIT=1 torchrun --nproc-per-node=2 bench/flashinfer_norm.py \
  --hidden 7168 --rounds 1 --tokens 1,8,64,512,2048 --json "$S/fi.json"
grep -v "^tokens .* done\|^\[" "$S/fi.log" | tail -25
for v in g64_eea13f3 g96 g128; do xz -dc diag/v/$v.so.xz > /tmp/v/$v.so; done
for v in g64_eea13f3 g96 g128; do
  s "ar_$v" 45 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench all_reduce -g 2 -b 4M -e 16M -f 4 -n 20 -w 5 -G 10 -R 3 --algo custom-oneshot,symm_mem-twoshot
  s "ag_$v" 45 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench all_gather -g 2 -b 16M -e 256M -f 4 -n 20 -w 5 -G 10 -R 3 --algo custom-push
done
for f in "$S"/ar_g*.log "$S"/ag_g*.log; do echo "== $f"; grep -E "^ +[0-9]+ " "$f" | cut -c1-120; done
echo "total: $((SECONDS-T0)) s"
tar -czf "$OUT/s1.tgz" -C "$OUT" s build.log && rm -rf "$S"
