set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD:$PWD/tests SYMCOMM_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
L=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'; nproc; } >>$L 2>&1
echo "== sim" >>$L; timeout 60 python3 -m pytest tests/gpu_sim/test_sim_training_graphs.py -q -s -p no:cacheprovider >>$L 2>&1; echo "rc $?" >>$L
echo "== w1 backward" >>$L; timeout 45 torchrun --nproc-per-node=1 --standalone h28/w1_backward.py >>$L 2>&1; echo "rc $?" >>$L
echo "== examples eager,graph + many" >>$L; timeout 50 torchrun --nproc-per-node=1 --standalone h28/examples_part.py eager,graph many >>$L 2>&1; echo "rc $?" >>$L
echo "== examples compile" >>$L; timeout 70 torchrun --nproc-per-node=1 --standalone h28/examples_part.py compile >>$L 2>&1; echo "rc $?" >>$L
grep -E "^== |^rc |passed|failed|FAIL|Error|error" $L | head -80
