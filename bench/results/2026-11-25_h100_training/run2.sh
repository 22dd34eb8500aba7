set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD:$PWD/tests SYMCOMM_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
L=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'; } >>$L 2>&1
echo "== examples eager,graph + many" >>$L; timeout 45 torchrun --nproc-per-node=1 --standalone h28/examples_part.py eager,graph many >>$L 2>&1; echo "rc $?" >>$L
echo "== train_step bench world 1 (smoke)" >>$L; timeout 40 torchrun --nproc-per-node=1 --standalone bench/train_step.py --tokens 64,512 --iters 10 --rounds 3 --json $OUT/train_step_w1.json >>$L 2>&1; echo "rc $?" >>$L
echo "== examples_world1 full" >>$L; timeout 145 torchrun --nproc-per-node=1 --standalone scripts/examples_world1.py >$OUT/examples_world1.txt 2>&1; echo "rc $?" >>$L; tail -8 $OUT/examples_world1.txt >>$L
grep -E "^== |^rc |passed|failed|FAIL|Error|error|^  (tp|fsdp)" $L | head -80
