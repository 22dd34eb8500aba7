#!/usr/bin/env bash
# Session 15, call 2 (world 2): build the combine-by-rank branch; all of tests/gpu_sim on GPU 0;
# the MoE sweep (every path, 3 interleaved rounds); nccl-tests alltoall at 512/2048 tokens' bytes.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/c2
echo "$COMMIT" > $OUT/c2/commit.txt
nvidia-smi topo -m > $OUT/c2/topo.txt 2>&1; nvidia-smi --query-gpu=name,driver_version --format=csv >> $OUT/c2/topo.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/c2/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 170 env CUDA_VISIBLE_DEVICES=0 CUDA_MODULE_LOADING=EAGER SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/c2/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/c2/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/c2/gpu_sim.log | head -8 | cut -c2-220
timeout 200 symcomm-bench moe -g 2 --tokens 1,8,64,512,2048 -n 10 -w 3 -G 10 -R 3 --algo all --json $OUT/c2/moe.json >$OUT/c2/moe.log 2>&1
echo "moe rc $? at ${SECONDS}s"; grep -E "#wrong|Using algo|^ +(1|8|64|512|2048) |Error|error" $OUT/c2/moe.log | head -70 | cut -c2-170
LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
chmod +x .nccl-tests/bin/* 2>/dev/null
for reg in 0 2; do
  timeout 60 env LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" .nccl-tests/bin/alltoall_perf -g 2 \
    -b 58720256 -e 234881024 -f 4 -n 20 -w 5 -G 20 -d bfloat16 -R $reg >$OUT/c2/alltoall_R$reg.txt 2>&1
  echo "alltoall R$reg rc $? at ${SECONDS}s"; grep -E "^ +[0-9]{6,}" $OUT/c2/alltoall_R$reg.txt
done
tar -czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2
grep -qE "[0-9]+ (failed|errors?)\b" <(tar xzf $OUT/c2.tgz -O c2/gpu_sim.log) && { echo "gpu_sim failed: verify skipped"; exit 0; }
left=$(( ${BUDGET:-585} - SECONDS - 15 ))
mkdir -p $OUT/v1
SKIP_BUILD=1 COMMIT=$COMMIT PART=1 TEST_TIMEOUT=170 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/v1/v >$OUT/v1/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/v1/v/summary.txt | cut -c1-200
tar -czf $OUT/v1.tgz -C $OUT v1 && rm -rf $OUT/v1
