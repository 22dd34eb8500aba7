"""Session 30 probe: copies of the tree whose csrc/ep.cu dispatch leaves out one part, each built
in place, so that ep_ab.py can time the dispatch without that part on simulated ranks. Their
bytes are wrong by design.   python3 diag/w30/epvar.py DEST_PREFIX NAME...
  norows:   no row phase (layout, barriers and the dedup meeting only)
  noexpand: no expand_duplicates (the receiver's copies of deduplicated rows)
  noenc:    NVFP4 without its encoding (payload and scale are input bits)
  noscale:  NVFP4 without the scale-byte stores
  noremote: every row store goes to this rank's own buffers (no peer stores)
  nopass1, nopass2: without the layout's counting, or its numbering, pass (use with norows)
  old:      main's csrc/ep.cu (diag/w30/ep_old.cu); A+B applies both
"""
import os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor


def sub(s, old, new, count=1):
    assert s.count(old) == count, (old, s.count(old))
    return s.replace(old, new)


def patch(name, s):
    if "+" in name:  # several patches, in order
        for part in name.split("+"):
            s = patch(part, s)
        return s
    if name == "old":  # main's ep.cu before this session's change
        return open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_old.cu")).read()
    if name == "shfl":  # this session's first step: keys by shuffle, loads ahead, match_any kept
        return open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_shfl.cu")).read()
    if name == "norows":
        return sub(s, "for (int64_t item = first_item; item < items; item += int64_t(gridDim.x) * warps) {",
                   "for (int64_t item = first_item; item < 0; item += int64_t(gridDim.x) * warps) {")
    if name == "nopass1":
        return sub(s, "  if (warp < counting) count_entries<Id>(job, lo, hi, first_chunk, table + warp * E);\n", "")
    if name == "nopass2":
        return sub(s, "  if (warp < counting)\n    number_entries<Id>(job, lo, hi, first_chunk,", "  if (false)\n    number_entries<Id>(job, lo, hi, first_chunk,")
    if name == "noexpand":
        return sub(s, "  expand_duplicates<Q>(job, at(slots, job.recv, s.rank), at(slots, job.scales, s.rank), src_here, used_rows, table);\n", "")
    if name == "noenc":
        return sub(s, "      out.scale8 = ep::nvfp4_block(v, gs, &out.payload);",
                   "      out.payload = make_uint2(r.v[0].x, r.v[0].y); out.scale8 = uint8_t(r.v[0].z) & 0x7F; (void)v;")
    if name == "noscale":
        return sub(s, "        reinterpret_cast<uint8_t*>(scales_at)[si] = piece.scale8;\n",
                   "        if (si < 0) reinterpret_cast<uint8_t*>(scales_at)[0] = piece.scale8;\n")
    if name == "noremote":
        s = sub(s, "      char* const recv_at = peer_buffer(lane_buf[0], d);\n      char* const scales_at = peer_buffer(lane_buf[2], d);\n",
                "      char* const recv_at = peer_buffer(lane_buf[0], d < 0 ? d : s.rank);\n      char* const scales_at = peer_buffer(lane_buf[2], d < 0 ? d : s.rank);\n")
        return sub(s, "    char* const src_at = peer_buffer(lane_buf[1], dest);", "    char* const src_at = peer_buffer(lane_buf[1], dest < 0 ? dest : s.rank);")
    raise SystemExit(f"unknown variant {name}")


def build(name):
    dest = f"{sys.argv[1]}{name}"
    shutil.copytree(".", dest, ignore=shutil.ignore_patterns(".git", "*.egg-info", "_native", ".venv", ".nccl-tests", "ci[0-9]*", "diag", "bench"))
    os.makedirs(f"{dest}/symcomm/_native")
    p = f"{dest}/csrc/ep.cu"
    source = patch(name, open(p).read())
    open(p, "w").write(source)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest,
                       stdout=open(f"{dest}/variant_build.log", "w"), stderr=subprocess.STDOUT)
    return f"{name}: build rc {r.returncode}"


if __name__ == "__main__":
    with ThreadPoolExecutor(len(sys.argv) - 2) as pool:
        for line in pool.map(build, sys.argv[2:]):
            print(line, flush=True)
