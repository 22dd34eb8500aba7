"""``symcomm-bench all_gatherv_fp4``: three columns per size, over the same uneven token rows.

- ``unquantized``: ``comm.all_gatherv`` of the rows in their own dtype, the gather to beat;
- ``fp4``: ``comm.all_gatherv_fp4``: NVFP4-quantize into the output slice, gather payload and
  scales in one NCCL group;
- ``fp4+dequant``: the same, then decode every gathered row.

The size column counts the unquantized bytes (as all_gatherv would), so rows line up with
all_gatherv's and in the summary "fp4 vs unquantized" above 1.00x is where quantizing pays for
itself, the crossover the design asks the CLI to show. The check is bit-exact: every rank
regenerates every rank's rows, quantizes them locally with the same global scale, and compares
payload bytes, scale bytes and decoded elements.
"""
from __future__ import annotations

import torch

import symcomm
from symcomm import fp4

from . import check
from .collectives import Gather, all_gatherv_call
from .config import DATATYPES, BenchError
from .sizes import Layout, Rows
from .spec import Case, Cases, Inputs, Setup

# The quantized columns, and whether each decodes the gathered rows; "unquantized" runs the
# plain all_gatherv (Gather's own cases).
_DEQUANTIZE = {"fp4": False, "fp4+dequant": True}
VARIANTS = ("unquantized", *_DEQUANTIZE)
# Token rows, in elements: a multiple of NVFP4's 16-element block, small enough that 1 KiB of
# bf16 is one row.
ROW = 512
_BLOCK = 16  # NVFP4 elements per scale
_QUANTIZABLE = ("bfloat16", "float16", "float32")


class Fp4Gather(Gather):
    """A Gather whose plain cases are the unquantized baseline column. Sizes, counts and the
    bus factor are the unquantized gather's, so fp4's busbw is what a gather of the original
    rows would need to match."""

    variants = VARIANTS

    def validate(self, datatype: str) -> None:
        if not hasattr(symcomm.Communicator, self.name):
            raise BenchError(f"{self.name}: this symcomm has no Communicator.{self.name} (the FP4 "
                             f"gather is not in this build)")
        if DATATYPES[datatype][1] not in _QUANTIZABLE:
            raise BenchError(f"{self.name} quantizes bfloat16, half or float rows, not {datatype}")

    def buffers(self, max_out_elems: int) -> dict[str, tuple[int, torch.dtype]]:
        """Gathered payload and scales for the largest size (the decoded rows reuse recv)."""
        rows = max_out_elems // ROW
        return {"packed": (max(rows * ROW // 2, 1), torch.uint8),
                "scales": (max(rows * ROW // _BLOCK, 1), torch.float8_e4m3fn)}

    def notes(self, world: int, itemsize: int, path: str) -> list[str]:
        ratio = itemsize * _BLOCK / (_BLOCK // 2 + 1)  # per block: 16 values vs 8 payload + 1 scale bytes
        return [*super().notes(world, itemsize, path),
                f"FP4: columns {', '.join(VARIANTS)}; the gather inside each takes --algo "
                f"{path}; sizes and bandwidths count unquantized bytes (fp4 moves "
                f"{ratio:.2f}x fewer); in place is N/A for fp4, which always writes its own output slice",
                "FP4 check: payload bytes + scale bytes + decoded elements that differ from a local "
                "quantization of every rank's rows with the shared global scale"]

    def cases(self, setup: Setup, lay: Layout, gen: Inputs) -> Cases:
        comm, bufs, h = setup.comm, setup.bufs, lay.row
        rows = lay.rows
        total = sum(rows)
        every = torch.cat([gen(p) for p in range(setup.world)]).view(total, h)
        mine = every[sum(rows[:setup.rank]):sum(rows[:setup.rank + 1])].reshape(-1)
        # The same on every rank without a collective: each one sees every rank's rows.
        gs = fp4.global_scale_for(every)
        exp_packed, exp_scales = fp4.quantize(every, gs)
        exp_scale_bytes = exp_scales.view(torch.uint8)
        exp_values = fp4.dequantize(exp_packed, exp_scales, gs, setup.dtype)
        x = bufs.send[:lay.parts[setup.rank]].view(-1, h)
        packed = bufs.extra["packed"][:total * h // 2].view(total, h // 2)
        scales = bufs.extra["scales"][:total * h // _BLOCK].view(total, h // _BLOCK)
        values = bufs.recv[:total * h].view(total, h)
        unquantized = super().cases(setup, lay, gen)

        def case(variant: str, inplace: bool) -> Case | None:
            if variant not in _DEQUANTIZE:
                return unquantized(setup.path, inplace)
            if inplace:
                return None
            dequantize = _DEQUANTIZE[variant]
            out = symcomm.Fp4Gathered(packed, scales, (), values if dequantize else None, gs)

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
                                                          algo=setup.path, out=out),
                        load=load, count=count if setup.check else None, corrupt=corrupt)
        return case


ALL_GATHERV_FP4 = Fp4Gather("all_gatherv_fp4", Rows(elements=ROW), all_gatherv_call)
