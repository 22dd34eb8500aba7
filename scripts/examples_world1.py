"""The examples at world 1 on one GPU: eager, CUDA graphs per bucket (replays bitwise equal to
eager) and torch.compile(fullgraph=True), each against its single-process reference.

    torchrun --nproc-per-node=1 scripts/examples_world1.py [--list]

At world 1 the collectives are copies, so this proves the layers' GPU code (grouped GEMMs,
FP4 codec kernels, graph capture with comm.graph_capture(), the compiled custom ops), not the
communication; multi-GPU runs use the examples' own torchrun commands. Prints every check with
--list (failures always), `examples_world1: N checks passed` last, and exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import symcomm  # noqa: E402

import dp_moe_step  # noqa: E402
import ep_moe_step  # noqa: E402
import tp_block  # noqa: E402
from layer_utils import init_distributed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--list", action="store_true", help="print every check, not only failures")
    args = parser.parse_args()
    init_distributed(cpu=False)
    if dist.get_world_size() != 1:
        raise SystemExit("run with --nproc-per-node=1 (the examples themselves take any world size)")
    comm = symcomm.Communicator()
    print("paths:", comm.algorithms(), flush=True)
    failed = total = 0
    try:
        for name, run in (
            ("dp_moe_step", lambda: dp_moe_step.run_checks(
                comm, dp_moe_step.MoEConfig(hidden=2048, experts=16, top_k=2, ffn=1024), 64,
                ("eager", "graph", "compile"), steps=3)),
            ("ep_moe_step", lambda: ep_moe_step.run_checks(
                comm, dp_moe_step.MoEConfig(hidden=2048, experts=16, top_k=4, ffn=1024), 64,
                ("eager", "graph", "compile"), steps=3, quant="nvfp4")),
            ("tp_block", lambda: tp_block.run_checks(
                comm, tp_block.TPConfig(hidden=2048, heads=16, head_dim=128, ffn=4096), 64,
                ("eager", "graph", "compile"), steps=3)),
        ):
            start = time.perf_counter()
            checks = run()
            torch.cuda.synchronize()
            for c in checks:
                if args.list or not c.ok:
                    print(f"{'ok  ' if c.ok else 'FAIL'} {name}: {c.name}: {c.detail}", flush=True)
            bad = sum(not c.ok for c in checks)
            modes = sorted({c.name.split()[0] for c in checks})
            print(f"{name}: {len(checks) - bad}/{len(checks)} checks passed ({', '.join(modes)}) "
                  f"in {time.perf_counter() - start:.1f} s", flush=True)
            failed, total = failed + bad, total + len(checks)
    finally:
        comm.close()
        dist.destroy_process_group()
    if failed:
        print(f"examples_world1: {failed} of {total} checks FAILED", flush=True)
        return 1
    print(f"examples_world1: {total} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
