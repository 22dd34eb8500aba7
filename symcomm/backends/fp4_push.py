"""``fused-push``, an all_gatherv_fp4 path: one launch of csrc/peer_gather.cu's gather_fp4_push.

Each rank quantizes its rows (the codec of ``fp4.quantize``, bit for bit) and writes payload,
block scales and the ``extra`` tensors straight into every peer's gathered outputs, then the
ranks meet at two bounded barriers. It needs CUDA, the peer runtime, bf16/fp16 rows, at most 8
tensors, 16-byte aligned rows of the extras, and every gathered output in a mapped symmetric
pool region (allocated inside use_symmetric_memory, or passed as ``out``).
"""
from __future__ import annotations

import ctypes

import torch

from .. import _native, fp4, validate
from ..base import Setup
from ..errors import ArgumentError
from ..operations.all_gatherv_fp4 import FUSED, OP, Fp4Call
from ..peer.capture import CAPTURE_CODES
from ..peer.setup import SharedContext
from .peer_gather import MAX_TENSORS
from .peer_path import PeerPath

_c = ctypes
FUSED_DTYPES = (torch.bfloat16, torch.float16)
CAPTURE_CODE = CAPTURE_CODES[FUSED]


def row_bytes(t: torch.Tensor) -> int:
    return t[0].nbytes if t.shape[0] else t.element_size() * int(torch.Size(t.shape[1:]).numel())


class FusedPushFp4Path(PeerPath):
    ops = frozenset({OP})
    equal_offsets = ("out",)  # peers write at this rank's output offsets; inputs are read locally

    def __init__(self, shared: SharedContext | None = None) -> None:
        super().__init__(FUSED, shared)

    def open(self, setup: Setup) -> str | None:
        if setup.device.type != "cuda":
            return f"the fused kernel runs on CUDA devices, and this communicator runs on {setup.device}"
        return super().open(setup)

    def why_not(self, call: Fp4Call) -> str | None:
        if self._context.device_index is None:  # a context over CPU memory: only tests build one
            return "the fused kernel runs on CUDA devices, and this communicator runs on cpu"
        if call.x.dtype not in FUSED_DTYPES:
            return f"x is {call.x.dtype}: the fused kernel quantizes bfloat16 and float16 rows"
        count = 2 + len(call.extra)
        if count > MAX_TENSORS:
            return (f"{count} tensors (payload, scales and {len(call.extra)} extra) exceed the {MAX_TENSORS} "
                    f"one launch writes")
        context = self._context
        for name, t in call.named_outputs():
            if context.region_of(t.data_ptr()) is None:
                problem = context.region_problem or ("allocate the outputs inside use_symmetric_memory, or pass "
                                                     "out= (an Fp4Gathered allocated there)")
                return (f"{name} is not in a mapped symmetric pool region (the fused kernel writes every peer's "
                        f"copy in place): {problem}")
        # Only what is the same on every rank decides (outputs sit at equal offsets, rows are
        # equal): a rank-local reason, such as a misaligned input, would send the ranks down
        # different paths to wait for each other. Misaligned inputs are copied in run() instead.
        if call.packed.data_ptr() % 16:
            return "out.packed does not start on a 16-byte boundary"
        for i, o in enumerate(call.gathered_extra):
            row = row_bytes(o)
            if row % 16 or o.data_ptr() % 16:
                return (f"out.extra[{i}]: rows of {row} bytes, or its address, are not whole 16-byte vectors "
                        f"(the kernel copies extras as 16-byte vectors)")
        return None

    def run(self, call: Fp4Call) -> None:
        total = sum(call.sizes)
        if not total:
            return  # every rank knows: no rank launches
        context = self._context
        session = context.session()
        stream, (x, *extra), _ = context.launch_inputs(session, (call.x, *call.extra))
        n, h = x.shape
        where = [context.output_slot(t.data_ptr(), t.nbytes, session, CAPTURE_CODE) for _, t in call.named_outputs()]
        k = len(extra)
        srcs = (_c.c_uint64 * k)(*(t.data_ptr() for t in extra))
        slots = (_c.c_int * k)(*(slot for slot, _ in where[2:]))
        offsets = (_c.c_uint64 * k)(*(offset for _, offset in where[2:]))
        rows = (_c.c_uint64 * k)(*(row_bytes(o) for o in call.gathered_extra))
        gs_ptr, gs_value = fp4.launch_scale(call.gs)
        args = _native.GathervFp4Args(x.data_ptr(), _native.DTYPE_CODES[x.dtype], n, h, sum(call.sizes[:context.rank]),
                                      total, gs_ptr, gs_value, where[0][0], where[0][1], where[1][0], where[1][1], k,
                                      srcs, slots, offsets, rows)
        code = context.lib.symcomm_ar_gatherv_fp4(context.ctx, ctypes.byref(args), stream)
        if code:
            context.check("fused FP4 dispatch launch", code)


def fused_rows_host(x: torch.Tensor, global_scale: float, row_offset: int, packed: torch.Tensor,
                    scales: torch.Tensor) -> None:
    """The fused kernel's encoding and addressing run on the CPU (symcomm_ar_gatherv_fp4_host):
    writes x's rows (one rank's) into the gathered host buffers ``packed`` [total, H/2] and
    ``scales`` [total, H/16] (linear) at ``row_offset``, exactly where the kernel writes them on
    every rank. It exists so that CI without a GPU checks the kernel's bytes against the codec."""
    n, h = fp4.check_rows(x)
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES:
        raise ArgumentError(f"x must be a bfloat16 or float16 CPU tensor, got {x.dtype} on {x.device}")
    total = packed.shape[0] if isinstance(packed, torch.Tensor) else -1
    cpu = torch.device("cpu")
    validate.given("packed", packed, (total, h // 2), torch.uint8, cpu)
    validate.given("scales", scales, (total, h // fp4.BLOCK), torch.float8_e4m3fn, cpu)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or not 0 <= row_offset <= total - n:
        raise ArgumentError(f"row_offset must be an int in [0, {total - n}], got {row_offset!r}")
    gs = fp4.check_global_scale(global_scale, cpu)
    gs = float(gs.item()) if isinstance(gs, torch.Tensor) else gs
    lib = fp4.host_lib()
    args = _native.GathervFp4Args(x=x.data_ptr(), dtype=_native.DTYPE_CODES[x.dtype], rows=n, cols=h,
                                  row_offset=row_offset, total_rows=total, gs_value=gs)
    _native.check(lib, "symcomm_ar_gatherv_fp4_host",
                  lib.symcomm_ar_gatherv_fp4_host(ctypes.byref(args), packed.data_ptr(), scales.data_ptr()))
