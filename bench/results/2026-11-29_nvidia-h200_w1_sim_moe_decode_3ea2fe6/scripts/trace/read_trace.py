"""Runs diag/moe_profile.py's decode step with the traced build and prints where the time goes
in the last dispatch + combine (rank 0, block 0). Run with PYTHONPATH=diag/trace/build."""
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_profile  # noqa: E402
from symcomm import _native  # noqa: E402
import symcomm  # noqa: E402
print("symcomm from", symcomm.__file__)

NAMES = {0: "layout entry", 1: "layout after next_epoch", 2: "layout slots+zeroed", 3: "layout counted",
         4: "layout start barrier", 5: "layout table written", 6: "layout end barrier", 7: "layout counts read",
         8: "layout segments", 9: "layout done",
         10: "push entry", 11: "push after next_epoch", 12: "push rows written", 13: "push end barrier",
         20: "combine entry", 21: "combine after next_epoch+slots", 22: "combine start barrier (or skip)",
         23: "combine rows written", 24: "combine end barrier", 25: "combine grid barrier", 26: "combine summed"}

for tokens in [int(a) for a in sys.argv[1:]] or [1, 8]:
    moe_profile.run(tokens, None, None, 32)
    torch.cuda.synchronize()
    lib = _native.load().lib
    buf = (ctypes.c_ulonglong * 128)()
    assert lib.symcomm_debug_ep_trace(buf) == 0
    stamps = {i: (buf[2 * i], buf[2 * i + 1]) for i in NAMES}
    t0 = stamps[0][0]
    print(f"tokens {tokens}: rank 0 block 0, last call; globaltimer ns from layout entry, clock64 since the kernel's entry")
    for i, name in NAMES.items():
        entry = stamps[i - i % 10][1]
        print(f"  {i:2d} {name:32s} {stamps[i][0] - t0:8d} ns   {stamps[i][1] - entry:8d} clk")
