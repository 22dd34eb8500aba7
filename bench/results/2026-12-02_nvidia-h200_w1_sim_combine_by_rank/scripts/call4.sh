#!/usr/bin/env bash
# Session 33: build, the EP simulated-rank tests, then main (diag/w33/old) against the branch, twice.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py tests/gpu_sim/test_sim_fp4_dispatch.py >$S/sim_ep.txt 2>&1
echo "sim ep rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep.txt)"; grep -E "^(FAILED|E  )" $S/sim_ep.txt | head -8
NEW=$PWD
for round in 1 2; do
  (cd diag/w33/old && PYTHONPATH=$PWD timeout 100 python3 $NEW/diag/w33/ep_time.py old >>$S/time.txt 2>&1); echo "old $round rc $? at ${SECONDS}s"
  timeout 100 python3 diag/w33/ep_time.py new >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
done
grep -E "tokens" $S/time.txt | awk '{print $1,$3,$5,$7,$9,$11,$13,$15}'
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
