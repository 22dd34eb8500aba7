"""bench/layer_step.py's EP ``local`` variant does the real step's expert work: with the same
tokens on every rank (as the benchmark's inputs are), the ranks' local outputs summed equal the
real EP step's MoE output, so each rank ran exactly the entries it would have received."""
from __future__ import annotations

from _spawn import run_world


def _local_sums_to_the_step(rank: int, world: int) -> None:
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    sys.path.insert(0, str(root / "examples"))
    import layer_step  # noqa: E402

    import symcomm
    from dp_moe_step import MoEConfig, MoEWeights, experts_of

    cfg = MoEConfig(hidden=64, experts=4 * world, top_k=3, ffn=32)
    comm = symcomm.Communicator()
    try:
        weights = MoEWeights(cfg, experts_of(rank, world, cfg.experts), comm.device)
        # buffers for 8 tokens a rank, a step of 5: both variants' work bounded by that bucket
        step = layer_step.ep.EPMoELayer(comm, cfg, 8, None, weights=weights)
        local = layer_step.EPLocal(comm, cfg, 8, None, weights=weights)
        hidden = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(5)).to(cfg.dtype)
        real = torch.tensor([True, True, False, True, True])  # a padding row routed nowhere
        want = step.moe(hidden, real, bucket=5).float()
        got = local.moe(hidden, real, bucket=5).float()
        assert got.isfinite().all()
        dist.all_reduce(got)
        err = (got - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), err
        assert got[2].abs().max().item() == 0.0  # the padding row's entries are held nowhere
    finally:
        comm.close()


def test_ep_local_runs_the_steps_entries():
    run_world(_local_sums_to_the_step, 2)
