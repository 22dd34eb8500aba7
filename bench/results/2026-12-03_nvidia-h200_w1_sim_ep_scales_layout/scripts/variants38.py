"""Session 38: copies of the working tree whose ep_dispatch returns early at one point, to time
the decode dispatch phase by phase on simulated ranks (timing only: wrong bytes, never landed).
Every variant's return is `if (job.max_tokens > 0) return;`, which the compiler cannot fold, so
the code after it is still compiled.
  epoch   after the prologue (launch, epoch, peer mapping check)
  count   + the counting pass and the prefix over warps
  mid     + the counts row into every rank's table and the kMid barrier
  scan    + the table read, fingerprints, the scan, this rank's layout outputs
  number  + the numbering pass (send_rows) and the row cache
  rows    + the row phase, everything but the end barrier (and a dedup call's meeting and expansion)
Usage: python3 variants38.py DEST [NAME ...]; VOBJS=DIR takes DIR/NAME/*.o.gz into each copy's cache."""
import gzip
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RET = "  if (job.max_tokens > 0) return;  // timing variant\n"
AFTER = {
    "epoch": "  if (epoch == 0 || !mapped) return;\n",
    "count": "    counts[id] = sum;\n  }\n  __syncthreads();\n",
    "mid": "  if (!barrier(s, kMid, W, epoch)) return;\n",
    "scan": "      if (e == L - 1) job.expert_offsets[L] = end;\n    }\n  }\n  __syncthreads();\n",
    "number": "  if (writer && threadIdx.x == 0) own_signal(s)->ep_dispatched = 1;\n  __syncthreads();\n",
}
BEFORE = {"rows": "  if (!dedup) {\n    barrier(s, kEnd, W, epoch);\n"}
dest = Path(sys.argv[1])
for name in sys.argv[2:] or [*AFTER, *BEFORE]:
    tree = dest / name
    shutil.rmtree(tree, ignore_errors=True)
    for part in ("csrc", "symcomm", "tests"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("_native", "__pycache__"))
    for part in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, tree / part)
    (tree / "symcomm" / "_native").mkdir()
    shutil.copytree(ROOT / "build" / "nvcc-cache", tree / "build" / "nvcc-cache")
    unit = tree / "csrc" / "ep.cu"
    text = unit.read_text()
    anchor = AFTER.get(name) or BEFORE[name]
    at = text.index(anchor)  # the first occurrence: ep_dispatch comes before ep_combine
    at = at + len(anchor) if name in AFTER else at
    unit.write_text(text[:at] + RET + text[at:])
    if os.environ.get("VOBJS"):
        for gz in (Path(os.environ["VOBJS"]) / name).glob("*.o.gz"):
            (tree / "build" / "nvcc-cache" / gz.name[:-3]).write_bytes(gzip.decompress(gz.read_bytes()))
    print(name, "ready")
