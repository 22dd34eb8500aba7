"""What the two examples share: process-group setup, seeded weights, RMSNorm, result checks.

Kept small on purpose: each example reads top to bottom with only these helpers in between.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import symcomm
from symcomm.communicator import DEFAULT_SYMMETRIC_CAPACITY


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, rounded once to x's dtype at the end (the rounding all_reduce_rmsnorm documents)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def seeded(shape: tuple[int, ...], seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic random tensor. Drawn on the CPU so every rank and the single-process
    reference get the same bits whatever the device or the world size."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu", action="store_true",
                        help="run over gloo on the CPU (small shapes are sensible; no CUDA graphs)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of eager,graph,compile (default: all the device supports)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4, help="eager steps with fresh random inputs")


def modes_for(args: argparse.Namespace, device: torch.device) -> tuple[str, ...]:
    """The modes to run; CUDA graphs need a GPU, so they are refused (not dropped) on the CPU."""
    if args.modes is None:
        return ("eager",) if device.type == "cpu" else ("eager", "graph", "compile")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = set(modes) - {"eager", "graph", "compile"}
    if unknown:
        raise SystemExit(f"unknown mode(s): {', '.join(sorted(unknown))}")
    if "graph" in modes and device.type != "cuda":
        raise SystemExit("--modes graph needs CUDA: CUDA graphs do not exist on the CPU")
    return modes


def init_distributed(cpu: bool) -> torch.device:
    """Join the torchrun world. On GPUs the group gets gloo for host-side exchanges and NCCL for
    CUDA tensors; with ``cpu`` it is gloo alone, so the Communicator runs on the CPU. Where the
    local ranks outnumber the GPUs (a CPU-only machine: none) it runs as ``cpu`` does, saying so,
    rather than failing in torch.cuda.set_device."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if not cpu and gpus < local_world:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{gpus} CUDA device(s) for {local_world} local ranks: running on the CPU over gloo, "
                  "as --cpu does", flush=True)
        cpu = True
    if cpu:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    return device


def token_counts(comm: symcomm.Communicator, n: int) -> list[int]:
    """Every rank's token count for this step. A serving scheduler knows these already; here one
    small all_gather provides them (and syncs the host, which only eager steps may do)."""
    mine = torch.tensor([n], dtype=torch.int64, device=comm.device)
    return [int(v) for v in comm.all_gather(mine).tolist()]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def close_enough(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> Check:
    """Max absolute error against ``rel`` times the reference's largest magnitude: bf16 keeps 8
    bits of mantissa, so a few units of 2**-8 of the scale is rounding, anything larger is a bug."""
    if got.shape != want.shape:
        return Check(name, False, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if got.numel() == 0:
        return Check(name, True, "no rows")
    err = (got.float() - want.float()).abs().max().item()
    bound = rel * max(want.float().abs().max().item(), 1e-6)
    return Check(name, err <= bound, f"max err {err:.3g} (bound {bound:.3g})")


def bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> Check:
    if got.shape != want.shape or got.dtype != want.dtype:
        return Check(name, False, f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    same = torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    return Check(name, same, "bitwise equal" if same else "bits differ")


def checks_in_modes(layer: object, capacity: int, modes: tuple[str, ...], checkers: tuple, steps: int, seed: int,
                    buckets: list[int] | None, compile_buckets: list[int] | None) -> list[Check]:
    """The (eager, graph, compiled) ``checkers`` asked for by ``modes``, in that order, on one
    layer: eager over ``steps`` steps, CUDA graphs per batch-size bucket (default: 1, half and
    all of ``capacity``), the compiled step at the largest bucket."""
    eager, graphs, compiled = checkers
    buckets = buckets or sorted({1, max(1, capacity // 2), capacity})
    checks: list[Check] = []
    if "eager" in modes:
        checks += eager(layer, steps, seed)
    if "graph" in modes:
        checks += graphs(layer, buckets, replays=2 * len(buckets), seed=seed)
    if "compile" in modes:
        checks += compiled(layer, compile_buckets or buckets[-1:], seed)
    return checks


def run_example(title: str, checks_for, symmetric_capacity: int = DEFAULT_SYMMETRIC_CAPACITY) -> int:
    """One example's main: a Communicator over the initialised group (a symmetric pool of
    ``symmetric_capacity`` bytes), ``checks_for(comm)``, the report, and teardown whatever
    happens. Returns the exit status."""
    comm = symcomm.Communicator(symmetric_capacity=symmetric_capacity)
    try:
        passed = report(title, checks_for(comm), comm)
    finally:
        comm.close()
        dist.destroy_process_group()
    return 0 if passed else 1


def report(title: str, checks: list[Check], comm: symcomm.Communicator) -> bool:
    """Print failures on the rank that saw them and one summary line on rank 0; True if every
    rank passed. The vote runs on the CPU over the group so it works with gloo and NCCL alike."""
    failed = [c for c in checks if not c.ok]
    for c in failed:
        print(f"[rank {comm.rank}] FAIL {c.name}: {c.detail}", flush=True)
    flag = torch.tensor([len(failed)], dtype=torch.int64)
    dist.all_reduce(flag, group=comm.group)
    passed = int(flag.item()) == 0
    if comm.rank == 0:
        verdict = "PASS" if passed else f"FAIL ({int(flag.item())} failed checks over all ranks)"
        print(f"{title}: {verdict}: {len(checks)} checks per rank, world {comm.world_size}, {comm.device.type}",
              flush=True)
    return passed
