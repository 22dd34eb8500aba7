"""No kernel copies its parameters to local memory (ptxas -v). A kernel that indexes an array
inside a by-value parameter (Sync, Peers, a job struct) with a run-time value gets the whole
struct in every thread's stack frame, filled on entry; on H200s that cost the peer kernels about
1 us a call at every size (docs/architecture.md, "Kernel parameters"). Frames that come with
spill stores are register spills (EP dispatch at large world sizes), not that copy."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted(p.name for p in (ROOT / "csrc").glob("*.cu"))
# Run once per communicator, when it opens: their 64-byte frames cost nothing a call sees.
ALLOWED = ("probe_read", "probe_write")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores")


def copied_parameters(ptxas_output: str) -> list[str]:
    """The kernels (mangled names) with a stack frame and no spill stores."""
    framed, kernel = [], None
    for line in ptxas_output.splitlines():
        if m := _PROPERTIES.search(line):
            kernel = m.group(1)
        elif (m := _FRAME.search(line)) and kernel is not None:
            if int(m.group(1)) and not int(m.group(2)) and not any(a in kernel for a in ALLOWED):
                framed.append(f"{kernel}: {m.group(1)} bytes")
            kernel = None
    return framed


def test_the_parser_finds_a_copy_and_passes_spills_and_the_probes():
    out = """ptxas info    : Function properties for _Z9flag_freeILi2EEvN7symcomm2ar4SyncE
    152 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _Z11ep_dispatchILi8EEvv
    176 bytes stack frame, 260 bytes spill stores, 252 bytes spill loads
ptxas info    : Function properties for _Z10probe_readN7symcomm2ar5PeersEiiPj
    64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _Z8one_shotv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    assert copied_parameters(out) == ["_Z9flag_freeILi2EEvN7symcomm2ar4SyncE: 152 bytes"]


@pytest.mark.parametrize("unit", UNITS)
def test_no_kernel_copies_its_parameters_to_local_memory(setup_py, unit, tmp_path):
    nvcc, why = setup_py.find_nvcc()
    if nvcc is None:
        pytest.skip(f"ptxas comes with nvcc: {why}")
    run = subprocess.run([nvcc, *setup_py.FLAGS, "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", "-c",
                          str(ROOT / "csrc" / unit), "-o", str(tmp_path / "unit.o")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Function properties for" in run.stdout + run.stderr, "ptxas -v printed no kernel"
    framed = copied_parameters(run.stdout + run.stderr)
    assert not framed, (f"{unit}: kernels with a stack frame and no spills, most likely a parameter array "
                        f"indexed at run time (use of_rank, csrc/peer.cuh):\n" + "\n".join(framed))
