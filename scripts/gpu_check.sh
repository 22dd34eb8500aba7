#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests at 2 and 4 ranks, benchmarks.
#
#   bash scripts/gpu_check.sh [all|tests|bench|quick] [OUT]
#   (quick = tests, then the host-side costs: membership and eager overhead, no sweeps)
#   release = the published numbers in one bounded call: tune + `--algo all` (auto measured
#   with the freshly tuned table) per world, FP4 bench, eager costs, then GPU tests as time
#   allows. Each step has its own timeout and everything is re-packed after every step, so
#   what finished comes back even if the call is cut off (DEADLINE seconds, default 420).
#   Narrower runs: TESTS (pytest paths, default tests/gpu), BENCH_OPS (default all_reduce
#   all_gather reduce_scatter), BENCH_MAX (largest size, default 256M), WORLDS (default "2 4").
#
# Writes logs and JSON under $OUT (default ./out), packed as logs.tgz and results.tgz so the
# device tool's few-files limit holds, and prints a short summary last. A GPU test that skips
# fails the run (SYMCOMM_REQUIRE_GPU=1): a GPU run must never pass by skipping.
set -uo pipefail
MODE=${1:-all}
OUT=${2:-${OUT:-$PWD/out}}
mkdir -p "$OUT/logs" "$OUT/results"
cd "$(dirname "$0")/.."

# NVLink multicast stays off: it can take the host's shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONUNBUFFERED=1
# bench/*.py run as scripts: make the checkout importable whatever the editable install did.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
pack() {  # also on timeout: whatever was measured still comes back
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
  echo "==== summary ===="
  cat "$SUMMARY"
}
trap pack EXIT

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sort | uniq -c
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
  nvcc --version | tail -2
} >"$OUT/logs/env.txt" 2>&1
note "$(grep -E '^date|torch ' "$OUT/logs/env.txt" | tr '\n' ' ')"
note "gpus: $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

if ! pip install --no-build-isolation --no-deps -e . >"$OUT/logs/build.log" 2>&1; then
  note "BUILD FAILED (see logs/build.log)"; tail -20 "$OUT/logs/build.log"; exit 1
fi
note "build: ok ($(ls symcomm/_native/))"

run_tests() {
  local world=$1
  # Each rank writes its own log; the wrapper keeps the per-rank pytest summary line.
  SYMCOMM_REQUIRE_GPU=1 timeout 420 torchrun --nproc-per-node="$world" --no-python bash -c \
    "python3 -m pytest ${TESTS:-tests/gpu} -q -s -rs -p no:cacheprovider >$OUT/logs/gpu_w${world}_r\$RANK.log 2>&1"
  local rc=$?
  for log in "$OUT"/logs/gpu_w"${world}"_r*.log; do
    note "tests world=$world $(basename "$log" .log): $(tail -1 "$log")"
  done
  note "tests world=$world exit: $rc"
}

run_bench() {
  local world=$1
  for op in ${BENCH_OPS:-all_reduce all_gather reduce_scatter}; do
    timeout 240 torchrun --nproc-per-node="$world" -m symcomm.bench "$op" -b 1K -e "${BENCH_MAX:-256M}" -f 2 \
      -w 5 -n 20 -G ${GRAPH_REPLAYS:-20} -d bfloat16 --algo all --json "$OUT/results/${op}_w${world}.json" \
      >"$OUT/results/${op}_w${world}.txt" 2>"$OUT/logs/bench_${op}_w${world}.err"
    note "bench $op world=$world exit: $? ($(grep -c '^ ' "$OUT/results/${op}_w${world}.txt") rows)"
  done
  run_eager "$world"
}

run_eager() {
  local world=$1
  timeout 120 torchrun --nproc-per-node="$world" bench/eager_overhead.py \
    --json "$OUT/results/eager_w${world}.json" >"$OUT/results/eager_w${world}.txt" 2>"$OUT/logs/eager_w${world}.err"
  note "$(tail -1 "$OUT/results/eager_w${world}.txt") [world $world]"
}

run_membership() {
  python3 bench/membership.py --json "$OUT/results/membership.json" >"$OUT/results/membership.txt" 2>&1
  sed 's/^/membership: /' "$OUT/results/membership.txt" | tee -a "$SUMMARY"
}

step() {  # step NAME TIMEOUT CMD...: run unless the deadline is near, then re-pack
  local name=$1 limit=$2; shift 2
  if (( SECONDS + 20 > ${DEADLINE:-420} )); then note "$name: SKIPPED (deadline)"; return; fi
  timeout "$limit" "$@" >"$OUT/results/$name.txt" 2>"$OUT/logs/$name.err"
  note "$name: exit $? at ${SECONDS}s"
  tar -czf "$OUT/partial.tgz" -C "$OUT" logs results summary.txt 2>/dev/null
}

gpu_tests() {  # gpu_tests WORLD NAME PYTEST-ARGS...: per-rank logs, summary lines
  local world=$1 name=$2; shift 2
  step "tests_${name}_w$world" 200 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node="$world" --no-python \
    bash -c "python3 -m pytest $* -q -s -rs -p no:cacheprovider >$OUT/logs/${name}_w${world}_r\$RANK.log 2>&1"
  for log in "$OUT"/logs/"${name}"_w"${world}"_r*.log; do note "  $(basename "$log"): $(tail -1 "$log")"; done
}

sweep() {  # sweep WORLD: tune, then every op with the tuned table (so `auto` is measured with it)
  local world=$1 table="$OUT/results/nvidia_h200_w$1.json" tuned=()
  step "tune_w$world" 120 torchrun --nproc-per-node="$world" -m symcomm.bench tune -n 20 -w 5 -G 10 -o "$table"
  [[ -f $table ]] && tuned=(env SYMCOMM_TUNING_FILE="$table")
  for op in ${BENCH_OPS:-all_reduce all_gather reduce_scatter}; do
    step "${op}_w$world" 60 "${tuned[@]}" torchrun --nproc-per-node="$world" -m symcomm.bench "$op" \
      -b 1K -e 256M -f 4 -n 20 -w 5 -G 10 --algo all --json "$OUT/results/${op}_w$world.json"
  done
}

if [[ $MODE == release ]]; then  # most important first: later steps are skipped at the deadline
  sweep 4
  gpu_tests 4 fp4 tests/gpu/test_fp4_gpu.py
  step fp4_gather_w4 90 torchrun --nproc-per-node=4 bench/fp4_gather.py "$OUT/results/fp4_w4"
  sweep 2
  step eager_w4 60 torchrun --nproc-per-node=4 bench/eager_overhead.py --json "$OUT/results/eager_w4.json"
  gpu_tests 2 stall "tests/gpu/test_custom_ar.py -k missing_peer"
fi

if [[ $MODE == all || $MODE == tests || $MODE == quick ]]; then
  for world in ${WORLDS:-2 4}; do
    if ((world <= NGPU)); then run_tests "$world"; else note "tests world=$world: NOT RUN ($NGPU GPUs)"; fi
  done
fi
if [[ $MODE == quick ]]; then
  run_membership
  for world in ${WORLDS:-4 2}; do ((world <= NGPU)) && run_eager "$world"; done
fi
if [[ $MODE == all || $MODE == bench ]]; then
  run_membership
  for world in ${WORLDS:-4 2}; do
    if ((world <= NGPU)); then run_bench "$world"; else note "bench world=$world: NOT RUN ($NGPU GPUs)"; fi
  done
fi

