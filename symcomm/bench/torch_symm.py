"""PyTorch's own symmetric memory (``torch.distributed._symmetric_memory``) as the bench times
it beside symcomm's paths: whether it can run, a buffer of it, and the comparison columns.

all_reduce has two columns, on a ``symm_mem.empty`` buffer rendezvoused over the default group
and made once per size, when a column first asks for it; ``load()`` writes the input into it,
as the GEMM before the all-reduce would have:

- ``symm_mem-oneshot``: ``torch.ops.symm_mem.one_shot_all_reduce_out``: every rank reads every
  peer's buffer and writes the sum into an output of its own, out of place by nature. It is
  ``one_shot_all_reduce``'s kernel with the output passed in, so that the check poisons that
  output first and a call that wrote nothing counts wrong (a fresh output could reuse the block
  of an earlier call's correct result);
- ``symm_mem-twoshot``: ``torch.ops.symm_mem.two_shot_all_reduce_``: a reduce-scatter and an
  all-gather through the peers' buffers, the sum left in the buffer, in place by nature.

Neither reads x or writes into it, so the table's two modes (whether the output aliases x) do
not apply to them: each mode times the same call, and both are checked against the all_reduce
spec's float64 reference. What torch refuses is refused here first, from what every rank
knows alike and before any communication (all_reduce_refusal): another reduction than sum (the
only one torch's kernels have), a dtype other than bfloat16 or float (what they dispatch on),
a message whose bytes are not a multiple of 4 (their alignment check: bfloat16 needs an even
count). Nothing else: an input that is a rendezvoused buffer has no size limit and needs no
workspace (torch's workspace, which cannot grow during graph capture, stages inputs that are
not symmetric), and the in-place two-shot takes any count that passes the alignment check and
any world size.

all_gather and reduce_scatter have ``symm_mem-lowcontention`` (torch's
``_low_contention_all_gather`` / ``_low_contention_reduce_scatter``; the multimem variants need
NVLink multicast, which is off on this project's machines), N/A everywhere for now
(low_contention_refusal says why).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from . import check
from .spec import Case, Cases, Refusal, Setup

ONE_SHOT = "symm_mem-oneshot"
TWO_SHOT = "symm_mem-twoshot"
LOW_CONTENTION = "symm_mem-lowcontention"
ALL_REDUCE_COLUMNS = (ONE_SHOT, TWO_SHOT)
# The torch.ops.symm_mem ops each column calls: a torch without one makes its column N/A.
OPS = {ONE_SHOT: ("one_shot_all_reduce_out",), TWO_SHOT: ("two_shot_all_reduce_",),
       LOW_CONTENTION: ("_low_contention_all_gather", "_low_contention_reduce_scatter")}
# torch's one- and two-shot kernels dispatch on these two alone (AT_DISPATCH_FLOAT_AND_BFLOAT16
# in its CUDASymmetricMemoryOps.cu) ...
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# ... and check that the input's bytes are a multiple of max(4, element size): 4 for both.
SIZE_MULTIPLE = 4

ALL_REDUCE_NOTES = [
    f"{ONE_SHOT}, {TWO_SHOT}: PyTorch's symmetric memory (torch.ops.symm_mem.one_shot_all_reduce_out, "
    "two_shot_all_reduce_) on a symm_mem.empty buffer that load() fills as the GEMM before would; "
    "they never read x, so out-of-place and in-place time the same call: one-shot's sum goes to an "
    "output of its own (out of place by nature), two-shot's stays in the buffer (in place by nature); "
    "N/A where torch would refuse (sum only, bfloat16 or float, bytes a multiple of 4)"]
LOW_CONTENTION_NOTES = [
    f"{LOW_CONTENTION}: PyTorch's low-contention symmetric-memory collective, N/A for now (the reason "
    "under its block)"]


def unavailable(device: torch.device,
                ops: Sequence[str] = ("one_shot_all_reduce", "two_shot_all_reduce_")) -> str | None:
    """None if torch.distributed._symmetric_memory's ``ops`` can run here, else why not."""
    if device.type != "cuda":
        return "torch's symmetric memory needs CUDA"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")  # registers torch.ops.symm_mem
        for op in ops:
            getattr(torch.ops.symm_mem, op)
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"this torch lacks it ({type(exc).__name__}: {exc})"
    return None


@dataclass(frozen=True)
class SymmBuffer:
    """A symm_mem.empty tensor rendezvoused over ``group`` (the default group's name)."""
    tensor: torch.Tensor
    group: str


def rendezvous_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> SymmBuffer:
    """A new symm_mem.empty buffer, rendezvoused over the default group. Collective: every
    rank makes the same buffers in the same order."""
    from torch.distributed import _symmetric_memory as symm_mem
    group = dist.group.WORLD.group_name
    tensor = symm_mem.empty(*shape, dtype=dtype, device=device)
    symm_mem.rendezvous(tensor, group)
    return SymmBuffer(tensor, group)


def one_shot_all_reduce(buf: SymmBuffer, out: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``buf`` into ``out`` (this rank's, any memory)."""
    return torch.ops.symm_mem.one_shot_all_reduce_out(buf.tensor, "sum", buf.group, out)


def two_shot_all_reduce_(buf: SymmBuffer) -> torch.Tensor:
    """The sum of every rank's ``buf``, in place."""
    return torch.ops.symm_mem.two_shot_all_reduce_(buf.tensor, "sum", buf.group)


def all_reduce_refusal(column: str, dtype: torch.dtype, nbytes: int, redop: str,
                       device: torch.device) -> str | None:
    """Why torch would refuse ``column``'s call on a message of ``nbytes``, or None if it takes
    it. Every input is one every rank shares, so every rank decides alike."""
    missing = unavailable(device, OPS[column])
    if missing is not None:
        return missing
    if redop != "sum":
        return f"torch's symmetric-memory all-reduce only sums (-o {redop})"
    if dtype not in KERNEL_DTYPES:
        return f"torch's one- and two-shot kernels take bfloat16 or float, not {str(dtype).removeprefix('torch.')}"
    if nbytes % SIZE_MULTIPLE:
        return (f"torch's kernels take messages of whole {SIZE_MULTIPLE}-byte words ({nbytes} B is not; "
                f"bfloat16 needs an even count)")
    return None


def low_contention_refusal(device: torch.device, graphs: bool) -> str:
    """Why ``symm_mem-lowcontention`` is N/A: on every machine for now."""
    missing = unavailable(device, OPS[LOW_CONTENTION])
    if missing is not None:
        return missing
    if graphs:
        return ("torch's low-contention collectives do not capture into a CUDA graph: they run on a side "
                "stream of their own and stage inputs that are not symmetric through a workspace; captured at "
                "world 2 (torch 2.11, 2x H200) the capture failed and the run hung (bench/layer_step.py)")
    return ("not timed eagerly either: each call returns a tensor it allocates itself, so #wrong could not "
            "prove the call wrote its result (no output to poison first), and the ops have never run on this "
            "project's GPUs")


def all_reduce_cases(setup: Setup, nbytes: int, count: int, mine: torch.Tensor, out: torch.Tensor,
                     exp: check.Expected | None) -> Cases:
    """The all-reduce columns at one size: ``mine`` is this rank's input, ``out`` the table's
    out-of-place output (one-shot's output in both modes), ``exp`` the spec's reference."""
    made: list[SymmBuffer] = []

    def buffer() -> SymmBuffer:
        # Made when a column first asks at this size (tune never asks): the rendezvous is
        # collective, and every rank asks for the columns in the same order and refuses alike.
        if not made:
            made.append(rendezvous_empty((count,), setup.dtype, setup.device))
        return made[0]

    def case(column: str, inplace: bool) -> Case | Refusal:
        why = all_reduce_refusal(column, setup.dtype, nbytes, setup.redop, setup.device)
        if why is not None:
            return Refusal(why)
        buf = buffer()
        if column == ONE_SHOT:
            result = out

            def call() -> object:
                return one_shot_all_reduce(buf, out)
        else:
            result = buf.tensor

            def call() -> object:
                return two_shot_all_reduce_(buf)

        def load() -> None:
            check.poison_fill(out)
            buf.tensor.copy_(mine)  # as the GEMM before the all-reduce would have written it

        return Case(call=call, load=load,
                    count=None if exp is None else (lambda: check.count_wrong(result, exp)),
                    corrupt=lambda: check.corrupt(result))
    return case


def low_contention_cases(setup: Setup) -> Cases:
    """The all_gather / reduce_scatter column: refused at every size, for the same reason."""
    why = Refusal(low_contention_refusal(setup.device, setup.graphs))
    return lambda column, inplace: why
