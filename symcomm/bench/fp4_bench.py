"""``symcomm-bench all_gatherv_fp4``: three columns per size, over the same uneven token rows.

- ``unquantized``: ``comm.all_gatherv`` of the rows in their own dtype, the gather to beat;
- ``fp4``: ``comm.all_gatherv_fp4``: NVFP4-quantize into the output slice, gather payload and
  scales in one NCCL group;
- ``fp4+dequant``: the same, then decode every gathered row.

The size column counts the unquantized bytes (as all_gatherv would), so in the summary
"fp4 vs unquantized" above 1.00x is where quantizing pays for itself, the crossover the design
asks the CLI to show. The check is bit-exact: every rank regenerates every rank's rows,
quantizes them locally with the same global scale, and compares payload bytes, scale bytes
and decoded elements.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from . import check
from .sizes import FP4_ROW, Layout

if TYPE_CHECKING:
    from .runner import Case, Runner

VARIANTS = ("unquantized", "fp4", "fp4+dequant")
_BLOCK = 16  # NVFP4 elements per scale


def buffer_specs(max_elems: int) -> dict[str, tuple[int, torch.dtype]]:
    """Gathered payload and scales for the largest size (the decoded rows reuse recv)."""
    rows = max_elems // FP4_ROW
    return {"packed": (max(rows * FP4_ROW // 2, 1), torch.uint8),
            "scales": (max(rows * FP4_ROW // _BLOCK, 1), torch.float8_e4m3fn)}


def notes(runner: "Runner") -> list[str]:
    itemsize = runner.dtype.itemsize
    ratio = itemsize * _BLOCK / (_BLOCK // 2 + 1)  # per block: 16 values vs 8 payload + 1 scale bytes
    return [f"FP4: columns {', '.join(VARIANTS)}; the gather inside each takes --algo "
            f"{runner.gather_algo}; sizes and bandwidths count unquantized bytes (fp4 moves "
            f"{ratio:.2f}x fewer); in place is N/A for fp4, which always writes its own output slice",
            "FP4 check: payload bytes + scale bytes + decoded elements that differ from a local "
            "quantization of every rank's rows with the shared global scale"]


def cases(runner: "Runner", lay: Layout, gen: Callable[[int], torch.Tensor]) -> Callable[[str, bool], "Case | None"]:
    from symcomm import fp4
    from symcomm.fp4_gather import Fp4Gathered

    from .runner import Case

    comm, bufs, h = runner.comm, runner.bufs, lay.row
    rows = [p // h for p in lay.parts]
    total = sum(rows)
    every = torch.cat([gen(p) for p in range(runner.world)]).view(total, h)
    mine = every[sum(rows[:runner.rank]):sum(rows[:runner.rank + 1])].reshape(-1)
    # The same on every rank without a collective: each one sees every rank's rows.
    gs = fp4.global_scale_for(every)
    exp_packed, exp_scales = fp4.quantize(every, gs)
    exp_scale_bytes = exp_scales.view(torch.uint8)
    exp_values = fp4.dequantize(exp_packed, exp_scales, gs, runner.dtype)
    x = bufs.send[:lay.parts[runner.rank]].view(-1, h)
    packed = bufs.extra["packed"][:total * h // 2].view(total, h // 2)
    scales = bufs.extra["scales"][:total * h // _BLOCK].view(total, h // _BLOCK)
    values = bufs.recv[:total * h].view(total, h)
    unquantized = runner._cases(lay, gen)

    def case(variant: str, inplace: bool) -> Case | None:
        if variant == "unquantized":
            return unquantized(runner.gather_algo, inplace)
        if inplace:
            return None
        dequantize = variant == "fp4+dequant"
        out = Fp4Gathered(packed, scales, (), values if dequantize else None, gs)

        def load() -> None:
            x.reshape(-1).copy_(mine)
            # Every byte differs from the right one, so whatever the gather leaves unwritten counts.
            torch.bitwise_not(exp_packed, out=packed)
            torch.bitwise_not(exp_scale_bytes, out=scales.view(torch.uint8))
            if dequantize:
                check.poison_fill(values)

        def count() -> int:
            wrong = int((packed != exp_packed).sum()) + int((scales.view(torch.uint8) != exp_scale_bytes).sum())
            if dequantize:
                wrong += int((values != exp_values).sum())
            return wrong

        def corrupt() -> None:
            if packed.numel():
                packed.view(-1)[:1].bitwise_not_()

        return Case(call=lambda: comm.all_gatherv_fp4(x, rows, gs, dequantize=dequantize,
                                                      algo=runner.gather_algo, out=out),
                    load=load, count=count if runner.cfg.check else None, corrupt=corrupt)
    return case
