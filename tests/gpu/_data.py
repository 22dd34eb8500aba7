"""Deterministic random inputs that every rank can regenerate for every other rank."""
from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rank_input(shape: tuple[int, ...] | int, dtype: torch.dtype, rank: int, seed: int,
               device: torch.device | str = "cuda") -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype.is_floating_point:
        # Non-zero, mixed-sign values away from 0 so a missing contribution always shows.
        t = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) + 0.5
        sign = torch.randint(0, 2, t.shape, generator=gen, device=device) * 2 - 1
        return (t * sign).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen, device=device, dtype=dtype)


def all_inputs(shape, dtype, world: int, seed: int) -> list[torch.Tensor]:
    return [rank_input(shape, dtype, r, seed) for r in range(world)]


def assert_reduced(out: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    """Compare a sum with the float64 reference, within rounding that scales with world size.

    Bound: |out - ref| <= world * eps(dtype) * sum_r |x_r| per element. A lost or doubled
    contribution is about sum_r |x_r| / world, far outside the bound for world <= 8.
    """
    stacked = torch.stack([t.double() for t in inputs])
    ref = stacked.sum(0)
    bound = len(inputs) * torch.finfo(out.dtype).eps * stacked.abs().sum(0)
    err = (out.double() - ref).abs()
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    bad = (err > bound).sum().item()
    assert bad == 0, f"{what}: {bad}/{out.numel()} elements off (max err {err.max().item():.3g})"


def assert_symmetric_served(choice) -> None:
    """Symmetric inputs reached the symmetric paths: one of them runs, or the dispatch table
    ranked plain NCCL above them at this size (a measured decision, which differs per GPU model),
    never a refusal such as "not symmetric memory"."""
    if choice.algo in ("nccl", "torch"):
        reason = choice.rejected.get("nccl-symm", "")
        assert reason.startswith("ranked below"), choice
