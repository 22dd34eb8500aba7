"""Settings for every test process, and for the ranks and scripts the tests start (they inherit
the environment).

TORCHINDUCTOR_VEC_ISA_OK=0: torch.compile of CPU code otherwise probes the CPU's vector
instruction sets by compiling a test program per set, once per process: 46 s a process on the
GPU image (torch 2.11, measured 2026-11-25, bench/NOTES.md), 1.4 s on the CPU machine. Every rank
of every compiled test paid it, and it was most of the README test command's time there. The
tests check symcomm's operations under torch.compile, not Inductor's vectorisation; a value
the caller set is kept.
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
