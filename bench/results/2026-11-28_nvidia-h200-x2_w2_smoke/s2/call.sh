#!/usr/bin/env bash
# Call S2 (2026-11-28 session 4), nvidia-h200-x2: the late dependent signal (release_dependents)
# against the shipped library (diag/v/g64_eea13f3.so, same kernels without it), A/B in one call;
# the simulated-rank overlap, flag-free and safety tests and the world-2 custom kernel tests on it.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS-T0)) s"
S=$OUT/s; mkdir -p "$S" /tmp/v; xz -dc diag/v/g64_eea13f3.so.xz > /tmp/v/A.so
s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" >"$S/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s" | tee -a "$S/steps.txt"; }
F=(-n 20 -w 5 -G 10 -R 3)
for v in A B A B; do
  L=(); [[ $v == A ]] && L=(SYMCOMM_NATIVE_LIBRARY=/tmp/v/A.so)
  s "ar_$v$SECONDS" 40 env "${L[@]}" symcomm-bench all_reduce -g 2 -b 1K -e 16M -f 4 "${F[@]}" --algo custom-flagfree,custom-oneshot,custom-twoshot
  s "ag_$v$SECONDS" 40 env "${L[@]}" symcomm-bench all_gather -g 2 -b 1K -e 4M -f 4 "${F[@]}" --algo custom-flagfree,custom-push
  s "rs_$v$SECONDS" 40 env "${L[@]}" symcomm-bench reduce_scatter -g 2 -b 1K -e 4M -f 4 "${F[@]}" --algo custom-flagfree,custom-oneshot
done
s sim 200 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_sim/test_sim_overlap.py \
  tests/gpu_sim/test_sim_flagfree_collectives.py tests/gpu_sim/test_sim_safety.py tests/gpu_sim/test_sim_ranks.py
tail -3 "$S/sim.log"
s gpu_w2 150 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -m pytest tests/gpu/test_custom_ar.py tests/gpu/test_flagfree_collectives.py -q -x -p no:cacheprovider >$S/gpu_w2_r\$RANK.log 2>&1"
tail -n 2 "$S"/gpu_w2_r*.log
python3 - "$S" <<'PY'
import glob, re, sys, collections
t = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*_[AB][0-9]*.log")):
    op, v = re.match(r".*/(\w\w)_([AB])", f).groups()
    algo = None
    for line in open(f):
        m = re.match(r"# Using algo: (\S+)", line)
        if m: algo = m.group(1)
        m = re.match(r"\s+(\d+)\s+\d+\s+\S+\s+\S+\s+-?\d+\s+([\d.]+)", line)
        if m and algo: t[(op, algo, int(m.group(1)))].append((v, float(m.group(2))))
for k in sorted(t):
    a = [x for v, x in t[k] if v == "A"]; b = [x for v, x in t[k] if v == "B"]
    if a and b: print(f"{k[0]} {k[1]:16s} {k[2]:>9d}  A {' '.join(f'{x:7.2f}' for x in a)}  B {' '.join(f'{x:7.2f}' for x in b)}  B/A {min(b)/min(a):.3f}")
PY
echo "total: $((SECONDS-T0)) s"
tar -czf "$OUT/s2.tgz" -C "$OUT" s build.log && rm -rf "$S"
