"""SASS of the standalone norm's decode kernels (bf16 rows of up to 4 x 256 vectors, with a
residual; bf16, FP8 and NVFP4 output): an opcode histogram side by side, and the three
functions' SASS. Needs cuobjdump (the GPU image has it). Usage: sass_hist.py LIB OUT_DIR"""
import collections
import re
import subprocess
import sys

lib, out = sys.argv[1], sys.argv[2]
sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True, check=True).stdout
parts = re.split(r"\n\s+Function : ", sass)
want = {f"_ZN12_GLOBAL__N_114rmsnorm_kernelI13__nv_bfloat16Li4ELi{q}ELb1EEEvPKT_S4_S4_PS2_N7symcomm4norm6OutputEifii": q
        for q in (0, 1, 2)}
found = {}
for p in parts[1:]:
    name = p.split("\n", 1)[0].strip()
    for key, q in want.items():
        if name.endswith(key.split("rmsnorm_kernel")[1]) and "rmsnorm_kernel" in name:
            found[q] = p
hists = {}
for q, body in sorted(found.items()):
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?", body)
    hists[q] = collections.Counter(ops)
    with open(f"{out}/sass_quant{q}.txt", "w") as f:
        f.write(body)
names = {0: "bf16", 1: "fp8", 2: "nvfp4"}
print("opcode", *(names[q] for q in sorted(hists)))
for op in sorted(set().union(*hists.values()), key=lambda o: -max(h[o] for h in hists.values())):
    print(op, *(hists[q][op] for q in sorted(hists)))
print("total", *(sum(hists[q].values()) for q in sorted(hists)))
