"""Session 28 probe: copies of the tree whose flag-free NVFP4 gather leaves out one part, each
built in place, so that fp4ab.py run in each measures the kernel without that part. Their bytes
are wrong by design.   python3 diag/w28/variants.py DEST_PREFIX NAME...
  noenc: no encoding (each lane sends masked input bits, which never read as the sentinel)
  nounpack: receivers poll each vector but write nothing out
  noown: senders do not write their own chunk into their outputs
"""
import os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

ENC_START, ENC_END = "    float v[8];\n    uint32_t amax = 0;", "    if (valid) {\n      put_bytes(me.payload + t * 4"


def patch(name, s):
    if name == "noenc":
        old = s[s.index(ENC_START):s.index(ENC_END)]
        assert "pack8" in old and old.count("shfl") == 1
        return s.replace(old, """    const uint4 raw = *reinterpret_cast<const uint4*>(v16);
    const uint8_t scale = valid ? uint8_t(raw.y & 0x7Fu) : 0;  // top bit clear, as a real scale's
    const uint32_t code = valid ? raw.x & 0x07070707u : 0u;      // never 0x88888888
""")
    if name == "nounpack":
        old = "        unpack_fp4_wire(v[r], int64_t(i), job.blocks[r], job.first_block[r], job.payload, job.scales);"
        assert s.count(old) == 1
        return s.replace(old, "        if (v[r].x == 0x12345678u && v[r].y == 0x9abcdef0u) job.payload[0] = 1;  // keeps the poll")
    if name == "noown":
        old = "      put_bytes(me.payload + t * 4, make_uint4(code, 0u, 0u, 0u), 4);\n      if (t % 2 == 0) me.scales[t / 2] = scale;\n"
        assert s.count(old) == 1
        return s.replace(old, "      if (code == 0x12345678u && scale == 0x7Fu) me.scales[0] = 1;  // keeps the encoding\n")
    raise SystemExit(f"unknown variant {name}")


def build(name):
    dest = f"{sys.argv[1]}{name}"
    shutil.copytree(".", dest, ignore=shutil.ignore_patterns(".git", "*.egg-info", "_native", ".venv", ".nccl-tests", "nccl-tests", "ci[0-9]*"))
    os.makedirs(f"{dest}/symcomm/_native")
    p = f"{dest}/csrc/peer_gather.cu"
    source = patch(name, open(p).read())
    open(p, "w").write(source)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest,
                       stdout=open(f"{dest}/variant_build.log", "w"), stderr=subprocess.STDOUT)
    return f"{name}: build rc {r.returncode}"


with ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    for line in pool.map(build, sys.argv[2:]):
        print(line, flush=True)
