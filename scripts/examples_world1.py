"""Every example at world 1 on one GPU: eager, CUDA graphs per bucket (replays bitwise equal to
eager; for the training steps whole steps, forward, backward and update) and
torch.compile(fullgraph=True), each against its single-process reference.

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
import fsdp_train_step  # noqa: E402
import tp_block  # noqa: E402
import tp_train_step  # noqa: E402
import train_utils  # noqa: E402
from layer_utils import init_distributed  # noqa: E402


def many_graphs(comm: symcomm.Communicator) -> list[tuple[str, bool, str]]:
    """16 whole training steps captured as graphs (4 FSDP "stages" x 4 micro-batches, as a
    pipeline schedule captures them) in one pool: the symmetric pool is untouched by them, the
    communicator's own memory does not grow with them, torch's reserved memory grows by about
    one step's temporaries, replays run, and destroying the graphs gives the memory back."""
    cfg = fsdp_train_step.TrainConfig(hidden=1024, ffn=4096)
    comm_stream = train_utils.communication_stream(comm)  # one for all four stages
    stages = [fsdp_train_step.FSDPMLP(comm, cfg, fsdp_train_step.FullMLP(
        fsdp_train_step.TrainConfig(hidden=1024, ffn=4096, seed=s), comm.device), comm_stream=comm_stream)
        for s in range(4)]
    micro = [tuple(torch.randn(64, cfg.hidden, device=comm.device) for _ in range(2)) for _ in range(4)]
    train_utils.warm_up([(model, micro[0]) for model in stages], cfg.lr)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pool_used = comm.symmetric_pool.bytes_in_use  # after the warm-up, whose eager backward used the pool
    before, memory_before = torch.cuda.memory_reserved(), comm.capabilities()["memory"]["total_bytes"]
    pool = torch.cuda.graph_pool_handle()
    graphs, losses = [], []
    one = None
    for model in stages:
        for batch in micro:
            g = torch.cuda.CUDAGraph()
            with comm.graph_capture(), torch.cuda.graph(g, pool=pool):
                losses.append(train_utils.train_step(model, batch, cfg.lr, static_grads=True))
            graphs.append(g)
            if one is None:
                one = torch.cuda.memory_reserved() - before
    grown = torch.cuda.memory_reserved() - before
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(v)) for v in losses)
    checks = [
        (f"{len(graphs)} graphs of whole training steps captured in one pool and replayed", len(graphs) == 16 and finite,
         f"{len(graphs)} graphs, losses finite: {finite}"),
        ("the captures allocated nothing in the symmetric pool", comm.symmetric_pool.bytes_in_use == pool_used,
         f"{pool_used} -> {comm.symmetric_pool.bytes_in_use} bytes"),
        ("the communicator's memory did not grow with the graphs",
         comm.capabilities()["memory"]["total_bytes"] == memory_before, ""),
        ("16 graphs in one pool reserve at most 3x what the first one did", grown <= 3 * max(one, 2 << 20),
         f"first graph {one >> 20} MiB, all 16 {grown >> 20} MiB"),
    ]
    del graphs, losses
    for model in stages:
        for p in model.params:
            p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    back = torch.cuda.memory_reserved() - before
    checks.append(("destroying the graphs gives their memory back", back <= 0, f"{back >> 20} MiB left"))
    return checks


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
            ("tp_train_step", lambda: tp_train_step.run_checks(
                comm, tp_train_step.TrainConfig(hidden=1024, ffn=4096), ("eager", "graph", "compile"), steps=3,
                tokens=64)),
            ("fsdp_train_step", lambda: fsdp_train_step.run_checks(
                comm, fsdp_train_step.TrainConfig(hidden=1024, ffn=4096), ("eager", "graph", "compile"), steps=3,
                tokens=64)),
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
        for name, good, detail in many_graphs(comm):
            print(f"{'ok  ' if good else 'FAIL'} many graphs: {name}: {detail}", flush=True)
            failed, total = failed + (not good), total + 1
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
