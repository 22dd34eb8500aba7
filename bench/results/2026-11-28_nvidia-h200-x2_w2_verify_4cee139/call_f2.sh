#!/usr/bin/env bash
# Final call F2 (2026-11-28 session 4), nvidia-h200-x2, world 2 on the final commit: every
# --algo all sweep (#wrong 0), the layer steps and train_step, then the MoE table at -R 3 and
# nccl-tests' all-to-all at the 512- and 2048-token byte counts.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?}
tar xJf diag/nt.tar.xz && chmod +x .nccl-tests/bin/*
mkdir -p "$OUT/f2"; F=$OUT/f2
# F1's deadline cut example_fsdp_train_step to 22 s (a timeout, not a failure of the example): again here.
DEADLINE=110 PART=1 ONLY="example_fsdp_train_step" bash scripts/gpu_check.sh verify "$F/v1" >"$F/verify1_screen.txt" 2>&1
echo "fsdp example: done at $((SECONDS-T0)) s"; tail -3 "$F/verify1_screen.txt"
DEADLINE=$((520 - (SECONDS-T0))) PART=2 bash scripts/gpu_check.sh verify "$F/v" >"$F/verify_screen.txt" 2>&1
echo "verify part 2: done at $((SECONDS-T0)) s"; tail -18 "$F/verify_screen.txt"
L=$((575 - (SECONDS-T0))); ((L > 60)) && L=60
timeout "$L" symcomm-bench moe -g 2 --tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo all --json "$F/moe.json" >"$F/moe.log" 2>&1
echo "moe: exit $? at $((SECONDS-T0)) s"; grep -A12 "^# Summary" "$F/moe.log" | cut -c1-260
LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
L=$((590 - (SECONDS-T0))); ((L > 30)) && L=30
timeout "$L" env LD_LIBRARY_PATH="$LIB" .nccl-tests/bin/alltoall_perf -g 2 -b 58720256 -e 234881024 -f 4 -n 20 -w 5 -G 20 -d bfloat16 >"$F/alltoall.log" 2>&1
echo "alltoall: exit $? at $((SECONDS-T0)) s"; grep -E "^ +[0-9]+ " "$F/alltoall.log"
tar -czf "$OUT/f2.tgz" -C "$OUT" f2 build.log && rm -rf "$F"
