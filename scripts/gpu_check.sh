#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests at 2 and 4 ranks, benchmarks.
#
#   bash scripts/gpu_check.sh [all|tests|bench|quick|release|norm|memory|single|build|verify|compare] [OUT]
#   tests = GPU tests per world; bench = per world, tune then, for each op, NCCL alone in its
#   process (`symcomm-bench baseline`) and `--algo all` with the freshly tuned table (so auto is
#   measured with it) compared with that baseline, and eager costs; all = both;
#   quick = tests, then membership and eager costs, no sweeps; release = the published
#   numbers in one bounded call: the sweeps, FP4 tests and bench, eager, the stall tests,
#   most important first (DEADLINE seconds, default 420 there, unbounded elsewhere);
#   norm = all_reduce_rmsnorm's numbers per world (issues 12, 13, 27): tune, the norm op with
#   --algo all and that table, bench/gemm_overlap.py (overlap on/off), bench/flashinfer_norm.py
#   (symcomm's op against FlashInfer's fused kernel);
#   memory = issue 30's first step per world: bench/comm_memory.py (symcomm with and without graph
#   communicators, cold and after torch's NCCL group; symmetric-CTA timing) and bench/graph_mixing.py;
#   single = what one GPU can show: the README's two commands exactly as written (tests,
#   benchmark) and scripts/world1_check.py (every op, symmetric memory, graphs, FP4 at world 1);
#   build = scripts/time_build.sh: the former single nvcc call against setup.py's build, cold
#   and warm, twice, interleaved (BUILD_ROUNDS).
#   compare = symcomm auto against NVIDIA's nccl-tests (-R 0 and -R 2) and PyTorch's symmetric
#   memory, per op and size at one world (WORLD, default every GPU): needs .nccl-tests/ from
#   scripts/build_nccl_tests.sh, carried; scripts/compare.py writes the tables (DEADLINE, default 520).
#   Every step has its own timeout and re-packs $OUT/partial.tgz, so what finished comes back
#   even if the call is cut off.
#   Narrower runs: TESTS (pytest paths, default tests/gpu), BENCH_OPS (default all_reduce
#   all_gather reduce_scatter), BENCH_MAX (largest size, default 256M), WORLDS (default "2 4"),
#   TEST_TIMEOUT (seconds per world's test run, default 420), ROUNDS (-R of tune and the sweeps,
#   default 3).
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

# python3 -m pip: the image's plain `pip` belongs to another Python, whose scripts cannot import torch.
# SKIP_BUILD=1: already built by the caller (two runs side by side must not both run pip in one tree).
if [[ -z ${SKIP_BUILD:-} ]] && ! python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/logs/build.log" 2>&1; then
  note "BUILD FAILED (see logs/build.log)"; tail -20 "$OUT/logs/build.log"; exit 1
fi
note "build: ok ($(ls symcomm/_native/))"

run_membership() {
  python3 bench/membership.py --json "$OUT/results/membership.json" >"$OUT/results/membership.txt" 2>&1
  sed 's/^/membership: /' "$OUT/results/membership.txt" | tee -a "$SUMMARY"
}

within_deadline() {  # within_deadline LIMIT: the LIMIT a step may take, cut to what is left before
  # DEADLINE less 10 s for the packing; fails (prints nothing) when under 30 s are left.
  local left=$(( ${DEADLINE:-1000000} - SECONDS - 10 ))
  ((left < 20)) && return 1
  echo $(( $1 < left ? $1 : left ))
}

step() {  # step NAME TIMEOUT CMD...: run unless the deadline is near, then re-pack
  local name=$1 limit
  limit=$(within_deadline "$2") || { note "$name: SKIPPED (deadline)"; return; }
  shift 2
  timeout "$limit" "$@" >"$OUT/results/$name.txt" 2>"$OUT/logs/$name.err"
  note "$name: exit $? at ${SECONDS}s"
  tar -czf "$OUT/partial.tgz" -C "$OUT" logs results summary.txt 2>/dev/null
}

gpu_tests() {  # gpu_tests WORLD NAME TIMEOUT PYTEST-ARGS...: per-rank logs, their summary lines
  local world=$1 name=$2 limit=$3; shift 3
  if ((world > NGPU)); then note "tests_${name}_w$world: NOT RUN ($NGPU GPUs)"; return; fi
  step "tests_${name}_w$world" "$limit" env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node="$world" --no-python \
    bash -c "python3 -m pytest $* -q -s -rs -p no:cacheprovider >$OUT/logs/${name}_w${world}_r\$RANK.log 2>&1"
  for log in "$OUT"/logs/"${name}"_w"${world}"_r*.log; do note "  $(basename "$log"): $(tail -1 "$log")"; done
}

eager() {  # eager WORLD: host cost of a 1 KiB all_reduce against raw ctypes NCCL and torch.distributed
  step "eager_w$1" 120 torchrun --nproc-per-node="$1" bench/eager_overhead.py --json "$OUT/results/eager_w$1.json"
  note "  $(tail -1 "$OUT/results/eager_w$1.txt")"
}

# Interleaved rounds per size, median reported: single samples of one kernel varied by up to
# 35% between cells of one sweep (bench/NOTES.md, session 3).
ROUNDS=${ROUNDS:-3}
GPU_SLUG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z_')
sweep() {  # sweep WORLD: tune, then per op NCCL alone (baseline) and every path with the tuned table
  local world=$1 table="$OUT/results/${GPU_SLUG}_w$1.json" tuned=()
  local flags=(-b 1K -e "${BENCH_MAX:-256M}" -f 4 -n 20 -w 5 -G 10 -R "$ROUNDS")
  if ((world > NGPU)); then note "sweep_w$world: NOT RUN ($NGPU GPUs)"; return; fi
  step "tune_w$world" 240 torchrun --nproc-per-node="$world" -m symcomm.bench tune -n 20 -w 5 -G 10 -R "$ROUNDS" -o "$table"
  [[ -f $table ]] && tuned=(env SYMCOMM_TUNING_FILE="$table")
  for op in ${BENCH_OPS:-all_reduce all_gather reduce_scatter}; do
    # NCCL at its best, in processes of its own, for the sweep's 'nccl clean' columns; a failed
    # baseline leaves the sweep without them rather than failing it.
    local clean="$OUT/results/baseline_${op}_w$world.json" against=()
    step "baseline_${op}_w$world" 150 symcomm-bench baseline "$op" -g "$world" "${flags[@]}" --json "$clean"
    [[ -f $clean ]] && against=(--baseline "$clean")
    step "${op}_w$world" 150 "${tuned[@]}" torchrun --nproc-per-node="$world" -m symcomm.bench "$op" \
      "${flags[@]}" --algo all --json "$OUT/results/${op}_w$world.json" "${against[@]}"
  done
}

flashinfer_site() {  # installs bench/flashinfer_pack.sh's archive (.fi/, carried) in a new folder and prints it; fails without .fi/
  # The image has no network: FlashInfer comes only from the carried archive.
  [[ -f .fi/flashinfer.tar.xz ]] || return 1
  local site; site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$site" .fi/*.whl >/dev/null 2>&1
  tar xJf .fi/flashinfer.tar.xz -C "$site" && echo "$site"
}

nccl_tests_libdir() {  # the image's libnccl: the nvidia-nccl-cu13 wheel in torch's venv, which torch and symcomm load
  # nvidia.nccl is a namespace package (no __init__.py, no __file__): its __path__ says where it is.
  python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))'
}

# verify: is this machine's symcomm correct at world W (default: every GPU)? PART=1 runs tests/gpu
# and every example, PART=2 every symcomm-bench op with --algo all, bench/layer_step.py and
# bench/train_step.py: each part fits one 10-minute device call; PART=all runs both; ONLY (globs)
# narrows either to the steps it names (docs/measuring.md: two world-2 halves side by side on a
# four-GPU host). Steps go to
# $OUT/<date>_<gpu>-x<N>_w<W>_verify/ (logs/ and outcomes_part<N>.tsv), packed as verify.tgz;
# COMMIT names the commit in its header (the device's copy may lack the repository's history);
# scripts/verify_report.py prints the one-screen PASS/FAIL table and writes its README.md.
if [[ $MODE == verify ]]; then
  W=${WORLD:-$NGPU}
  GPU_KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|b200|a100|l40s?' | head -1 | tr 'A-Z' 'a-z')
  # Named by the host's GPU count (the device kind), which CUDA_VISIBLE_DEVICES may narrow: two
  # world-2 parts can run side by side on the two pairs of a four-GPU host.
  HOST_GPUS=$(nvidia-smi -L | wc -l)
  VNAME="$(date -u +%F)_nvidia-${GPU_KIND:-gpu}-x${HOST_GPUS}_w${W}_verify"
  VDIR="$OUT/$VNAME"; mkdir -p "$VDIR/logs"
  PART=${PART:-all}
  {
    echo "# $(grep -E '^date' "$OUT/logs/env.txt") $(grep -E 'torch ' "$OUT/logs/env.txt"), $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), world $W (GPUs ${CUDA_VISIBLE_DEVICES:-all} of $HOST_GPUS), part $PART${ONLY:+ (only: $ONLY)}, commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  } >>"$VDIR/outcomes_part$PART.tsv"
  wanted() {  # ONLY="glob ...": run just the steps whose names match (the header records ONLY)
    [[ -z ${ONLY:-} ]] && return 0
    local pattern patterns; read -ra patterns <<<"$ONLY"  # split without expanding against files
    for pattern in "${patterns[@]}"; do [[ $1 == $pattern ]] && return 0; done  # unquoted: a glob
    return 1
  }
  vrecord() {  # vrecord NAME OUTCOME DETAIL SECONDS COMMAND
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$VDIR/outcomes_part$PART.tsv"
    echo "$1: $2 ($3, $4 s)"
  }
  vtests() {  # tests/gpu at world W: a failure, error or skip on any rank fails it
    wanted tests_gpu || return 0
    local start=$SECONDS cmd="SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=$W --no-python bash -c 'python3 -m pytest tests/gpu -q -rs -p no:cacheprovider'"
    timeout "${TEST_TIMEOUT:-270}" env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node="$W" --no-python bash -c \
      "python3 -X faulthandler -m pytest tests/gpu -q -rs -p no:cacheprovider >$VDIR/logs/tests_gpu_r\$RANK.log 2>&1"
    local rc=$? outcome=PASS detail=""
    for log in "$VDIR"/logs/tests_gpu_r*.log; do
      local last; last=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1 | tr -d '=' | xargs)
      detail+="$(basename "$log" .log): ${last:-no summary}; "
      if [[ -z $last || $last =~ (failed|error|skipped) ]] || grep -q "Fatal Python error" "$log"; then outcome=FAIL; fi
    done
    ((rc == 0)) || { outcome=FAIL; detail+="exit $rc"; }
    vrecord tests_gpu "$outcome" "$detail" $((SECONDS - start)) "$cmd"
  }
  # Benchmark columns that must run where symcomm's peer kernels serve the world (2, 4, 6, 8 ranks;
  # at world 1 they refuse): a refused one prints N/A with exit 0 and #wrong 0, which would
  # otherwise read as a pass. Other refusals (a path that serves another op, a size past a
  # kernel's slot) are listed in the step's detail.
  declare -A MUST_SERVE=()
  [[ $W =~ ^[2468]$ ]] && MUST_SERVE[bench_moe]="peer-push peer-push+nvfp4 peer-push+fp8 peer-push:dispatch peer-push+nvfp4:dispatch"
  vrun() {  # vrun NAME LIMIT CMD...: passes on exit 0 and, where the output has nccl-tests' check lines, #wrong 0
    local name=$1 limit
    wanted "$name" || return 0
    if ! limit=$(within_deadline "$2"); then  # in the outcomes too: a skipped step must not read as a pass
      vrecord "$name" "NOT RUN" "deadline: under 30 s left" 0 "${*:3}"
      return 0
    fi
    shift 2
    local start=$SECONDS log="$VDIR/logs/$name.log"
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$? outcome=PASS detail
    local wrong; wrong=$(grep -oE 'Out of bounds values : [0-9]+' "$log" | awk '{s += $NF; n++} END {if (n) print s " wrong in " n " tables"}')
    local refused; refused=$(grep -oE '^# [^ ]+ refused some calls' "$log" | awk '{print $2}' | sort -u | paste -sd' ' -)
    detail="exit $rc${wrong:+, $wrong}${refused:+, refused some calls: $refused}"
    local column missing=""
    for column in ${MUST_SERVE[$name]:-}; do
      [[ " $refused " == *" $column "* ]] && missing+=" $column"
    done
    if ((rc != 0)) || [[ -n $wrong && ${wrong%% *} != 0 ]]; then
      outcome=FAIL; detail+=": $(grep -E 'Error|FAILED|error:' "$log" | grep -v '^\s*File' | tail -1 | cut -c1-160)"
    elif [[ -n $missing ]]; then
      outcome=FAIL; detail+=" (must serve:$missing)"
    fi
    ((rc == 124)) && detail+=" (timed out after $limit s)"
    vrecord "$name" "$outcome" "$detail" $((SECONDS - start)) "$*"
  }
  SWEEP=(-n 5 -w 2 -G 10 --algo all)
  if [[ $PART == 1 || $PART == all ]]; then
    vtests
    for ex in quickstart tp_block dp_moe_step ep_moe_step tp_train_step fsdp_train_step; do
      vrun "example_$ex" 100 torchrun --nproc-per-node="$W" "examples/$ex.py"
    done
  fi
  if [[ $PART == 2 || $PART == all ]]; then
    for op in all_reduce all_gather reduce_scatter all_gatherv reduce_scatterv all_gatherv_fp4; do
      vrun "bench_$op" 120 symcomm-bench "$op" -g "$W" -b 1K -e 64M -f 8 "${SWEEP[@]}"
    done
    vrun bench_all_reduce_rmsnorm 240 symcomm-bench all_reduce_rmsnorm -g "$W" -b 16K -e 64M -f 4 "${SWEEP[@]}"
    # The norm's yardstick beside it: FlashInfer's fused kernel, where .fi/ is carried.
    if FI_SITE=$(flashinfer_site); then
      vrun flashinfer_norm 150 env PYTHONPATH="$FI_SITE:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1 \
        torchrun --nproc-per-node="$W" bench/flashinfer_norm.py --json "$VDIR/flashinfer_norm.json"
    else
      note "flashinfer_norm: not run (no .fi/: bench/flashinfer_pack.sh, then carry .fi)"
    fi
    vrun bench_moe 150 symcomm-bench moe -g "$W" --tokens 1,8,64,512,2048 "${SWEEP[@]}"
    vrun bench_moe_eager 120 symcomm-bench moe -g "$W" --tokens 1,512 -n 5 -w 2 -G 0 --algo all
    # The MoE yardstick in the same call: nccl-tests' all-to-all of the bytes one rank
    # dispatches at 512 and 2048 tokens (hidden 7168, top-8, bf16), plain buffers and symmetric
    # windows, where .nccl-tests/ is carried (scripts/build_nccl_tests.sh). Like FlashInfer's, a
    # yardstick rather than a check of symcomm: its absence goes to the summary, not the outcomes
    # (the report counts a NOT RUN step as a failed verification).
    chmod +x .nccl-tests/bin/* 2>/dev/null  # in case the copy lost the mode bits
    if [[ -x .nccl-tests/bin/alltoall_perf ]]; then
      for reg in 0 2; do
        vrun "nccl_tests_alltoall_R$reg" 60 env LD_LIBRARY_PATH="$(nccl_tests_libdir)" .nccl-tests/bin/alltoall_perf \
          -g "$W" -b 58720256 -e 234881024 -f 4 -n 20 -w 5 -G 20 -d bfloat16 -R "$reg"
      done
    else
      note "nccl_tests_alltoall: not run (no .nccl-tests/bin/alltoall_perf: scripts/build_nccl_tests.sh, then carry .nccl-tests)"
    fi
    for layer in dp_moe tp_block ep_moe; do  # one step per layer: a slow or failing one names itself
      vrun "layer_step_$layer" 240 torchrun --nproc-per-node="$W" bench/layer_step.py --layers "$layer" \
        --tokens 1,8,64,2048 --iters 10 --rounds 2 --json "$VDIR/layer_step_$layer.json"
    done
    vrun train_step 150 torchrun --nproc-per-node="$W" bench/train_step.py --iters 10 --rounds 2 \
      --json "$VDIR/train_step.json"
  fi
  python3 scripts/verify_report.py "$VDIR" | tee -a "$SUMMARY"
  tar -czf "$OUT/verify.tgz" -C "$OUT" "$VNAME" && rm -rf "${VDIR:?}"
fi
# compare: symcomm auto against NVIDIA's nccl-tests, the external yardstick, in the same call at
# world W (default every GPU), per op (BENCH_OPS) and size (1K to BENCH_MAX by 4): nccl-tests
# with plain buffers (-R 0) and with symmetric windows (-R 2), one process driving every GPU
# (-g W, MPI=0), then symcomm-bench --algo all with the same sizes, iterations and datatype, whose
# symm_mem* paths (PyTorch's symmetric memory), where it has them, are yardsticks too. Raw
# outputs stay in results/compare_w<W>/ beside compare.md and compare.json (scripts/compare.py:
# exit 1 on any #wrong). The binaries come from scripts/build_nccl_tests.sh on the CPU machine
# (carry .nccl-tests); where this image refuses them they are rebuilt here from the sources
# carried beside them, against the image's own NCCL.
if [[ $MODE == compare ]]; then
  DEADLINE=${DEADLINE:-520}
  W=${WORLD:-$NGPU}
  CMP=compare_w$W
  mkdir -p "$OUT/results/$CMP" "$OUT/logs/$CMP"
  NCCL_LIB=$(nccl_tests_libdir) || note "compare: no nvidia.nccl in $(command -v python3): nccl-tests cannot find libnccl"
  NT=(env LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  { echo "libnccl for nccl-tests: $NCCL_LIB"; ls -l "$NCCL_LIB"; cat .nccl-tests/BUILD_INFO; } >"$OUT/logs/$CMP/nccl_tests_env.txt" 2>&1
  chmod +x .nccl-tests/bin/* 2>/dev/null  # in case the copy lost the mode bits
  # -h parses the options and exits before any CUDA call: it fails only if the loader does.
  if [[ -x .nccl-tests/bin/all_reduce_perf ]] \
    && ! timeout 30 "${NT[@]}" .nccl-tests/bin/all_reduce_perf -h >/dev/null 2>"$OUT/logs/$CMP/load_check.err"; then
    note "compare: the carried nccl-tests do not load here ($(head -1 "$OUT/logs/$CMP/load_check.err")); rebuilding"
    step "$CMP/rebuild_nccl_tests" 240 env NCCL_INSTALLED=1 NCCL_TESTS_SRC=.nccl-tests/src bash scripts/build_nccl_tests.sh
  fi
  [[ -x .nccl-tests/bin/all_reduce_perf ]] || note "compare: no .nccl-tests/bin (run scripts/build_nccl_tests.sh on the CPU machine and carry .nccl-tests)"
  # bfloat16 on both sides: symcomm-bench's default on GPUs, where nccl-tests' is float.
  flags=(-b 1K -e "${BENCH_MAX:-256M}" -f 4 -n 20 -w 5 -G 20 -d bfloat16)
  # One thread drives every GPU (-g W); NCCL_TESTS_THREADS=1 gives each GPU its own thread
  # (-t W -g 1), closer to the one-process-per-GPU runs of measuring.md's reference numbers.
  ranks=(-g "$W"); [[ ${NCCL_TESTS_THREADS:-} == 1 ]] && ranks=(-t "$W" -g 1)
  for op in ${BENCH_OPS:-all_reduce all_gather reduce_scatter}; do
    bin=.nccl-tests/bin/${op}_perf
    for reg in 0 2; do
      if [[ -x $bin ]]; then step "$CMP/${op}_nccl_tests_R$reg" 90 "${NT[@]}" "$bin" "${ranks[@]}" "${flags[@]}" -R "$reg"
      else note "$CMP/${op}_nccl_tests_R$reg: NOT RUN (no $bin)"; fi
    done
    # symcomm-bench's -R is its rounds (the median of interleaved runs), not nccl-tests' registration.
    step "$CMP/${op}_symcomm" 200 symcomm-bench "$op" -g "$W" "${flags[@]}" -R "$ROUNDS" --algo all \
      --json "$OUT/results/$CMP/${op}_symcomm.json"
  done
  # Outside step: it takes a second, and the deadline must not skip the one table the call is for.
  timeout 60 python3 scripts/compare.py "$OUT/results/$CMP" --md "$OUT/results/$CMP/compare.md" \
    --json "$OUT/results/$CMP/compare.json" >"$OUT/logs/$CMP/compare.txt" 2>&1
  note "compare: exit $? (1: a #wrong above 0; 2: missing or incomparable input)"
  tee -a "$SUMMARY" <"$OUT/logs/$CMP/compare.txt"
fi
if [[ $MODE == release ]]; then  # most important first: later steps are skipped at the deadline
  DEADLINE=${DEADLINE:-420}
  sweep 4
  gpu_tests 4 fp4 200 tests/gpu/test_fp4_gpu.py
  step fp4_gather_w4 90 torchrun --nproc-per-node=4 bench/fp4_gather.py "$OUT/results/fp4_w4"
  sweep 2
  eager 4
  gpu_tests 2 stall 200 "tests/gpu/test_custom_ar.py -k missing_peer"
fi
if [[ $MODE == norm ]]; then
  for world in ${WORLDS:-2 4}; do
    if ((world > NGPU)); then note "norm_w$world: NOT RUN ($NGPU GPUs)"; continue; fi
    table="$OUT/results/${GPU_SLUG}_w$world.json"
    step "tune_w$world" 300 torchrun --nproc-per-node="$world" -m symcomm.bench tune -d bfloat16 \
      -b 1K -e "${BENCH_MAX:-64M}" -n 20 -w 5 -G 10 -R "$ROUNDS" -o "$table"
    tuned=(); [[ -f $table ]] && tuned=(env SYMCOMM_TUNING_FILE="$table")
    step "norm_w$world" 150 "${tuned[@]}" torchrun --nproc-per-node="$world" -m symcomm.bench \
      all_reduce_rmsnorm -b 16K -e 64M -f 4 -n 20 -w 5 -G 10 -R "$ROUNDS" --algo all \
      --json "$OUT/results/norm_w$world.json"
    step "gemm_overlap_w$world" 120 "${tuned[@]}" torchrun --nproc-per-node="$world" \
      bench/gemm_overlap.py --json "$OUT/results/gemm_overlap_w$world.json"
    # symcomm's op against FlashInfer's fused kernel per token count (says so and
    # stops where flashinfer-python is not installed: bench/flashinfer_pack.sh packs it as .fi/).
    fi_env=(); site=$(flashinfer_site) && fi_env=(env PYTHONPATH="$site:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1)
    step "flashinfer_norm_w$world" 150 "${fi_env[@]}" "${tuned[@]}" torchrun --nproc-per-node="$world" \
      bench/flashinfer_norm.py --json "$OUT/results/flashinfer_norm_w$world.json"
  done
fi
if [[ $MODE == single ]]; then
  # The README's test command, exactly as written (its `pip install` half needs a network).
  step readme_tests "${TEST_TIMEOUT:-480}" python -m pytest tests
  note "  $(tail -1 "$OUT/results/readme_tests.txt")"
  step world1 180 torchrun --nproc-per-node=1 scripts/world1_check.py
  note "  $(tail -1 "$OUT/results/world1.txt")"
  step about 60 python3 -m symcomm
  sed 's/^/  /' "$OUT/results/about.txt" | tee -a "$SUMMARY"
  step quickstart_w1 120 torchrun --nproc-per-node=1 examples/quickstart.py
  note "  $(grep '^rank 0' "$OUT/results/quickstart_w1.txt")"
  # The README's main command, as written (-g 2 on one GPU), then on the GPU itself.
  step readme_bench 180 symcomm-bench all_reduce -g 2 -b 1K -e 1M
  step readme_bench_g1 180 symcomm-bench all_reduce -g 1 -b 1K -e 1M --algo all
  step baseline_g1 120 symcomm-bench baseline all_reduce -g 1 -b 1K -e 1M -G 5 --json "$OUT/results/baseline_g1.json"
  step readme_bench_g1_clean 120 symcomm-bench all_reduce -g 1 -b 1K -e 1M -G 5 --algo all --baseline "$OUT/results/baseline_g1.json"
  note "  $(grep -m1 -i 'device' "$OUT/results/readme_bench.txt")"
  step graph_mixing_w1 120 torchrun --nproc-per-node=1 bench/graph_mixing.py --json "$OUT/results/graph_mixing_w1.json"
  sed 's/^/  /' "$OUT/results/graph_mixing_w1.txt" | tee -a "$SUMMARY"
fi
if [[ $MODE == memory ]]; then  # issue 30's first step: memory per rank and graph mixing, per world
  for world in ${WORLDS:-2 4}; do
    if ((world > NGPU)); then note "memory_w$world: NOT RUN ($NGPU GPUs)"; continue; fi
    step "memory_w$world" 240 python3 bench/comm_memory.py --nproc "$world" \
      --cases symcomm,symcomm_graph_comms,pg_then_symcomm,pg_then_symcomm_graph_comms,timing_ctas8,timing_ctas16,timing_default \
      --json "$OUT/results/memory_w$world.json"
    grep -E "capabilities\(\)\['memory'\]" "$OUT/results/memory_w$world.txt" | sed 's/^ */  /' | tee -a "$SUMMARY"
    step "graph_mixing_w$world" 120 torchrun --nproc-per-node="$world" bench/graph_mixing.py \
      --json "$OUT/results/graph_mixing_w$world.json"
    sed 's/^/  /' "$OUT/results/graph_mixing_w$world.txt" | tee -a "$SUMMARY"
    # The decision itself: symcomm's own NCCL rows in graphs, without and with graph communicators.
    for gc in off on; do
      step "graph_comms_${gc}_w$world" 150 torchrun --nproc-per-node="$world" -m symcomm.bench all_reduce \
        -b 1K -e 4M -f 4 -n 20 -w 5 -G 10 -R "${ROUNDS:-3}" --algo all \
        $([[ $gc == on ]] && echo --graph-communicators) --json "$OUT/results/graph_comms_${gc}_w$world.json"
    done
  done
fi
if [[ $MODE == build ]]; then
  step build_times 560 bash scripts/time_build.sh "${BUILD_ROUNDS:-2}"
  sed 's/^/  /' "$OUT/results/build_times.txt" | tee -a "$SUMMARY"
fi
if [[ $MODE == all || $MODE == tests || $MODE == quick ]]; then
  for world in ${WORLDS:-2 4}; do gpu_tests "$world" gpu "${TEST_TIMEOUT:-420}" "${TESTS:-tests/gpu}"; done
fi
if [[ $MODE == quick || $MODE == all || $MODE == bench ]]; then
  run_membership
fi
if [[ $MODE == quick ]]; then
  for world in ${WORLDS:-4 2}; do ((world <= NGPU)) && eager "$world"; done
fi
if [[ $MODE == all || $MODE == bench ]]; then
  for world in ${WORLDS:-4 2}; do sweep "$world"; ((world <= NGPU)) && eager "$world"; done
fi
