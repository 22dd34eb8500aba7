"""Session 35: copies of the working tree with one change each in ep.cu's FP8 combine, to find
what its time over the bf16 combine is made of (simulated ranks; timing only, wrong bytes):
  noenc    no block amax, no scale, no encoding: the codes are bits of the values, scale 1
  noamax   the encoding kept, each lane's own amax (no shuffles across the block's 16 lanes)
  nocheck  fp8.cuh's encode8 never divides for a value near a rounding midpoint (rare wrong bytes)
  nobreak  the send's chunks past the row are encoded and not stored, instead of a break
  both     nocheck and nobreak
  rolled   the combine's loop over an item's look-ahead groups rolled (pairs picked by selects),
           so add_up and send are inlined twice instead of five times
  unrolled main's rolled loop unrolled again: a970326's ep.cu
Usage: python3 variants.py DEST [NAME ...]   (DEST/NAME trees, each with main's nvcc cache)"""
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHUFFLE = ("        for (int b = 8; b >= 1; b >>= 1) amax = max(amax, __shfl_xor_sync(kFull, amax, b));"
           "  // the block's 16 lanes\n")
ENCODE = ("        const float scale = ep::fp8_scale(amax);\n"
          "        const uint2 codes = ep::fp8_codes8(v, scale);\n")
CHECK = ("    divide |= needs_division(q[i]);\n", "")
BREAK = ("      if (u - lane >= job.units) break;  // past the row: the same in every lane\n", "")
ROLL = ("""#pragma unroll
    for (int k = 0; k < kLookAhead; ++k) {  // unrolled: a run-time k would put lists.pair in local memory
      const int64_t at_item = item + k * stride;
      // The same in every lane: one group per warp. A group that holds no row here has nothing to
      // send; the first item went before the loop.
      if ((k == 0 && item == first_item) || at_item >= items || __shfl_sync(kFull, lists.pair[k].x, 0) < 0) continue;
      float acc[kCombineChunks][V];
      add_up(at_item, lists.pair[k], acc);
""", """#pragma unroll 1
    for (int k = 0; k < kLookAhead; ++k) {
      const int64_t at_item = item + k * stride;
      int2 pair = lists.pair[0];
#pragma unroll
      for (int j = 1; j < kLookAhead; ++j) pair = k == j ? lists.pair[j] : pair;
      if ((k == 0 && item == first_item) || at_item >= items || __shfl_sync(kFull, pair.x, 0) < 0) continue;
      float acc[kCombineChunks][V];
      add_up(at_item, pair, acc);
""")
ROLLED_MAIN = """    // Rolled, the pair picked by selects (lists.pair[k] with a run-time k would be in local
    // memory): unrolled, add_up and send were inlined five times, and the FP8 combine's kernel
    // grew to 11,000 instructions and took 1.4x as long at 2048 tokens (bench/NOTES.md,
    // thirty-fifth session).
#pragma unroll 1
    for (int k = 0; k < kLookAhead; ++k) {
      const int64_t at_item = item + k * stride;
      int2 pair = lists.pair[0];
#pragma unroll
      for (int j = 1; j < kLookAhead; ++j) pair = k == j ? lists.pair[j] : pair;
      // The same in every lane: one group per warp. A group that holds no row here has nothing to
      // send; the first item went before the loop.
      if ((k == 0 && item == first_item) || at_item >= items || __shfl_sync(kFull, pair.x, 0) < 0) continue;
      float acc[kCombineChunks][V];
      add_up(at_item, pair, acc);
"""
CHANGES = {
    "noenc": [(SHUFFLE, ""), (ENCODE, "        const float scale = 1.0f;\n"
                                      "        const uint2 codes = make_uint2(__float_as_uint(v[0]) ^ __float_as_uint(v[1]),"
                                      " __float_as_uint(v[2]) ^ __float_as_uint(v[3]) ^ amax);\n")],
    "noamax": [(SHUFFLE, "")],
    "nocheck": [CHECK],
    "nobreak": [BREAK],
    "both": [CHECK, BREAK],
    "rolled": [ROLL],
    "unrolled": [(ROLLED_MAIN, ROLL[0])],
}
dest = Path(sys.argv[1])
for name in sys.argv[2:] or ["noenc", "noamax"]:
    edits = CHANGES[name]
    tree = dest / name
    shutil.rmtree(tree, ignore_errors=True)
    for part in ("csrc", "symcomm", "tests"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("_native", "__pycache__"))
    for part in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, tree / part)
    (tree / "symcomm" / "_native").mkdir()
    shutil.copytree(ROOT / "build" / "nvcc-cache", tree / "build" / "nvcc-cache")
    for old, new in edits:
        source = next(p for p in (tree / "csrc" / "ep.cu", tree / "csrc" / "fp8.cuh") if old in p.read_text())
        text = source.read_text()
        assert text.count(old) == 1, (name, old)
        source.write_text(text.replace(old, new))
    print(name, "ready")
