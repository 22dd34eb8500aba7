#!/usr/bin/env bash
# Call X1 (2026-11-28 session 5), nvidia-h200-x2, tree = branch link-robustness:
# (1) the branch's GPU checks: tests/gpu/test_bench_link.py, an --algo all sweep with the link copy,
#     bench/flashinfer_norm.py; (2) the PDL limit: flag-free kernels with the early dependent
#     signal forced on (diag/v/pdl_on.so) against the built library (off, NCCL 2.28.9 loaded),
#     A/B/A/B, -R 3; (3) flag-free grid 8/16/32 (diag/v/ff*.so), one pass.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS-T0)) s"
S=$OUT/x1; mkdir -p "$S" /tmp/v
for v in pdl_on ff8 ff16 ff32; do xz -dc diag/v/$v.so.xz > /tmp/v/$v.so; done
s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" >"$S/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s (at $((SECONDS-T0)))" | tee -a "$S/steps.txt"; }
s link_test 120 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -m pytest tests/gpu/test_bench_link.py -q -p no:cacheprovider >$S/link_test_r\$RANK.log 2>&1"
tail -n 2 "$S"/link_test_r*.log
s ag_link 90 symcomm-bench all_gather -g 2 -b 1M -e 256M -f 4 -n 10 -w 3 -G 10 --algo all --json "$S/ag_link.json"
grep -E "link|wire" "$S/ag_link.log" | tail -12
python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl >"$S/fi_install.log" 2>&1
tar xJf .fi/flashinfer.tar.xz -C /tmp/site
s fi 100 env PYTHONPATH=/tmp/site:$PWD FLASHINFER_DISABLE_JIT=1 torchrun --nproc-per-node=2 bench/flashinfer_norm.py \
  --hidden 7168 --rounds 3 --tokens 1,8,64,512,2048 --json "$S/fi.json"
grep -v "Deprecation\|handles, workspace\|return lambda\|^tokens .* done" "$S/fi.log" | tail -16
F=(-n 20 -w 5 -G 10 -R 3 --algo custom-flagfree)
for v in A B A B; do
  L=(); [[ $v == A ]] && L=(SYMCOMM_NATIVE_LIBRARY=/tmp/v/pdl_on.so)
  for op in all_reduce all_gather reduce_scatter; do
    s "pdl_${op}_$v$SECONDS" 40 env "${L[@]}" symcomm-bench $op -g 2 -b 1K -e 1M -f 4 "${F[@]}"
  done
done
for v in ff8 ff16 ff32; do for op in all_reduce all_gather; do
  s "grid_${op}_$v" 40 env SYMCOMM_NATIVE_LIBRARY=/tmp/v/$v.so symcomm-bench $op -g 2 -b 1K -e 1M -f 4 "${F[@]}"
done; done
python3 - "$S" <<'PY'
import glob, re, sys, collections
t = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/pdl_*.log") + glob.glob(sys.argv[1] + "/grid_*.log")):
    kind, op, v = re.match(r".*/(pdl|grid)_(all_reduce|all_gather|reduce_scatter)_(A|B|ff\d+)", f).groups()
    for line in open(f):
        m = re.match(r"\s+(\d+)\s+\d+\s+\S+\s+\S+\s+-?\d+\s+([\d.]+)", line)
        if m: t[(kind, op, int(m.group(1)))].append((v, float(m.group(2))))
for k in sorted(t):
    by = collections.defaultdict(list)
    for v, x in t[k]: by[v].append(x)
    print(f"{k[0]} {k[1]:15s} {k[2]:>8d}  " + "  ".join(f"{v} {' '.join(f'{x:6.2f}' for x in xs)}" for v, xs in sorted(by.items())))
PY
echo "total: $((SECONDS-T0)) s"
tar -czf "$OUT/x1.tgz" -C "$OUT" x1 build.log && rm -rf "$S"
