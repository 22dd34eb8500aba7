"""bench/comm_memory.py's arithmetic: a step's cost is the drop in free device memory less what
torch's caching allocator reserved in that step (the measurement itself needs a GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

MiB = 1 << 20
_spec = importlib.util.spec_from_file_location(
    "comm_memory", Path(__file__).resolve().parents[1] / "bench" / "comm_memory.py")
comm_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(comm_memory)


def _sample(label, free_mib, reserved_mib, t):
    return {"label": label, "free": free_mib * MiB, "total": 80_000 * MiB,
            "torch_reserved": reserved_mib * MiB, "t": t}


def test_steps_charge_nccl_only_what_torch_did_not_reserve():
    samples = [_sample("start", 1000, 100, 0.0),
               _sample("init", 700, 100, 0.5),        # NCCL took 300 MiB
               _sample("capture", 500, 250, 0.75),    # 200 MiB gone, 150 of them torch's graph pool
               _sample("destroy", 900, 250, 1.0)]     # NCCL gave 400 back
    rows = comm_memory.steps(samples)
    assert [r["label"] for r in rows] == ["init", "capture", "destroy"]
    assert [r["outside_torch_bytes"] // MiB for r in rows] == [300, 50, -400]
    assert [r["total_outside_torch_bytes"] // MiB for r in rows] == [300, 350, -50]
    assert [r["torch_cache_bytes"] // MiB for r in rows] == [0, 150, 0]
    assert [r["seconds"] for r in rows] == [0.5, 0.25, 0.25]


def test_every_case_the_docstring_names_exists():
    names = set(comm_memory.cases())
    for name in ("idle", "nccl", "nccl_ctas1", "nccl_ctas32", "split_share1", "split_share0", "window",
                 "window_ctas4", "window_on_split", "torch_pg", "graph_usage_one", "symcomm",
                 "symcomm_no_custom", "symcomm_nccl_only", "timing_ctas2", "timing_default"):
        assert name in names, name
