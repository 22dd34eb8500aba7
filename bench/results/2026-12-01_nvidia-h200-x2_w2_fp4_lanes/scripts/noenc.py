"""Session 28 probe: a copy of the tree whose flag-free NVFP4 gather skips the encoding (each
lane sends bits of its input that can never read as the sentinel), built in place, so that
fp4ab.py run there measures the same kernel without the encoding's latency. Its bytes are wrong
by design. python3 diag/w28/noenc.py DEST"""
import os, shutil, subprocess, sys
dest = sys.argv[1]
shutil.copytree(".", dest, ignore=shutil.ignore_patterns(".git", "*.egg-info", "_native"))
os.makedirs(f"{dest}/symcomm/_native")
p = f"{dest}/csrc/peer_gather.cu"
s = open(p).read()
old = s[s.index("    float v[8];\n    uint32_t amax = 0;"):s.index("    if (valid) {\n      put_bytes(me.payload + t * 4")]
assert "pack8" in old and old.count("shfl") == 1
new = """    const uint4 raw = *reinterpret_cast<const uint4*>(v16);
    const uint8_t scale = valid ? uint8_t(raw.y & 0x7Fu) : 0;  // top bit clear, as a real scale's
    const uint32_t code = valid ? raw.x & 0x07070707u : 0u;      // never 0x88888888
"""
s = s.replace(old, new)
open(p, "w").write(s)
subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest, check=True,
               stdout=open(f"{dest}/noenc_build.log", "w"), stderr=subprocess.STDOUT)
print("noenc built")
