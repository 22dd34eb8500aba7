"""torch.distributed over the user's group: the CPU (gloo) path, and the last resort on GPU.

gloo lacks some collectives and dtypes that NCCL has, so the v-variants and reduce-scatters
are composed from all_gather / all_reduce. That costs bandwidth, which is fine for the path
whose job is to make the same API work on a laptop and in CI.

Waits: CPU tensors travel on a gloo group of symcomm's own (peers.Peers.collectives), never on
the user's group, so a collective abandoned after the communicator's timeout (peers.Peers.wait
raises CommTimeoutError) cannot keep dist.destroy_process_group() waiting. On CUDA tensors (an
NCCL group) the work is stream-ordered on the user's group, as torch.distributed enqueues it;
the group's own timeout (its watchdog) bounds it, not symcomm's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import check_mode
from ..base import TORCH, Call, Path, Setup, runner_table
from ..errors import PeerMismatchError
from ..operations.all_to_allv import counts_problem, signature_view
from ..peers import GroupCollectives, HostCollectives, Peers, ints_text, text_ints

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
# fp8 arithmetic is not implemented for CPU tensors in torch.
_UNREDUCIBLE = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
# What gloo reduces: int16 and the unsigned types past uint8 raise "Invalid scalar type" inside
# the collective (torch 2.13, two ranks, sum/max/prod), which peers then see as a lost rank.
_GLOO_REDUCIBLE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                             torch.int32, torch.int64})
# NCCL, behind torch.distributed for CUDA tensors, has no 16-bit integer type.
_NCCL_UNREDUCIBLE = frozenset({torch.int16, torch.uint16})
# The first value of a refusal's row in _agree's comparison (then its reason as text): a
# signature starts with the op's name as text, whose first value is never negative.
_REFUSED = -1


class TorchPath(Path):
    name = TORCH

    def __init__(self) -> None:
        self._collectives: HostCollectives | GroupCollectives | None = None
        self._peers: Peers | None = None
        self._rank = 0
        self._world = 1
        self._agrees = False
        self._row = 0  # _agree's row length: check mode's signature, then all_to_allv's counts

    def open(self, setup: Setup) -> str | None:
        self._peers = setup.peers
        self._collectives = setup.peers.collectives(setup.device)
        self._rank, self._world = setup.peers.rank, setup.peers.world_size
        self._agrees = setup.device.type == "cpu" and self._world > 1  # see _agree
        self._row = check_mode.signature_length(self._world) + 2 * self._world
        return None

    def close(self) -> None:
        self._collectives = None  # see Peers.close: no group may outlive the user's teardown
        self._peers = None

    abort = close

    def why_not(self, call: Call) -> str | None:
        if call.redop is None:
            return None
        if call.dtype in _UNREDUCIBLE:
            return f"torch.distributed cannot reduce {call.dtype}"
        on_cpu = call.inputs[0].device.type == "cpu"
        if on_cpu and call.dtype not in _GLOO_REDUCIBLE:
            return f"gloo cannot reduce {call.dtype}"
        if not on_cpu and call.dtype in _NCCL_UNREDUCIBLE:
            return f"NCCL cannot reduce {call.dtype}"
        return None

    def run(self, call: Call) -> None:
        self._agree(call)
        self._RUNNERS[call.op](self, call)

    def skip(self, call: Call) -> None:
        self._agree(call)  # so a rank whose call alone is empty raises with its peers

    def refuse(self, reason: str) -> None:
        if self._agrees:  # a row of the same length as a call's: the reason as text
            self._exchange(torch.tensor([_REFUSED, *text_ints(reason, self._row - 1)], dtype=torch.int64))

    def _wait(self, work, t: torch.Tensor, what: str) -> None:
        if t.device.type == "cpu":
            self._peers.wait(work, f"torch.distributed {what}")
        else:
            work.wait()  # stream-ordered: the NCCL group's own timeout bounds it

    def _reduce_in_place(self, t: torch.Tensor, redop: str) -> None:
        # gloo has no AVG. Each rank scales by 1/world, then they sum, as NCCL's avg does for
        # floats (callers only allow avg on floating dtypes): summing first overflowed where the
        # average fits (two float16 ranks holding 60000 gave inf).
        if redop == "avg":
            t.mul_(1.0 / self._world)
        self._wait(self._collectives.all_reduce(t, _REDUCE_OPS["sum" if redop == "avg" else redop]), t,
                   "all_reduce")

    def _all_reduce(self, call: Call) -> None:
        x, out = call.inputs[0], call.outputs[0]
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        self._reduce_in_place(out, call.redop)

    def _all_gather(self, call: Call) -> None:
        x, out = call.inputs[0], call.outputs[0]
        chunks = list(_bytes(out).chunk(self._world))
        self._wait(self._collectives.all_gather(chunks, _bytes(x).clone()), x, "all_gather")

    def _agree(self, call: Call) -> None:
        """Ranks that disagree about a call on CPU tensors all raise PeerMismatchError. gloo,
        given buffers of different lengths or dtypes, terminates the process of the rank that
        notices and can hand the others rows that are not theirs. So every rank first gathers
        check mode's signature of its call and, for all_to_allv, its counts: one small
        collective a call, on the path whose job is to be right on a laptop and in CI. It goes
        over gloo, not check mode's store exchange, because gloo sees a dead peer's closed
        socket at once. CUDA tensors skip it (comparing would wait for the device); check mode
        covers them. A rank that refused the same call posts its reason instead (refuse), so
        the others raise rather than pair this call with its next one."""
        if not self._agrees:
            return
        w, counts = self._world, getattr(call, "recv_sizes", None)
        if counts is not None:
            counts = call.sizes + counts
        values, names = check_mode.signature(call if counts is None else signature_view(call), 0, w, None)
        told = self._exchange(torch.tensor([*values, *(counts or [0] * 2 * w)], dtype=torch.int64))
        refusals = {r: ints_text(t[1:]) for r, t in enumerate(told) if t[0] == _REFUSED}
        if refusals:
            raise PeerMismatchError(f"{call.op}: rank(s) {', '.join(map(str, refusals))} refused the call before "
                                    f"communicating (" + "; ".join(f"rank {r}: {why}" for r, why in refusals.items())
                                    + "). Every rank must make the same call")
        problem = check_mode.first_mismatch([t[:len(names)] for t in told], names, (self.name,))
        if problem is None and counts is not None:
            problem = counts_problem([t[len(names):] for t in told])
        if problem is not None:
            raise PeerMismatchError(f"{call.op}: {problem}. Every rank must make the same call")

    def _exchange(self, mine: torch.Tensor) -> list[list[int]]:
        """Every rank's row of _agree's comparison (each of length self._row)."""
        rows = [torch.empty_like(mine) for _ in range(self._world)]
        self._wait(self._collectives.all_gather(rows, mine), mine, "all_gather of the call's signature")
        return [r.tolist() for r in rows]

    def _all_gatherv(self, call: Call) -> None:
        longest = max(call.sizes)
        for x, out in zip(call.inputs, call.outputs):
            row = _bytes(out).numel() // max(out.shape[0], 1)
            padded = torch.zeros(longest * row, dtype=torch.uint8, device=x.device)
            padded[: x.numel() * x.element_size()] = _bytes(x)
            gathered = [torch.empty_like(padded) for _ in range(self._world)]
            self._wait(self._collectives.all_gather(gathered, padded), x, "all_gather")
            flat, offset = _bytes(out), 0
            for rows, part in zip(call.sizes, gathered):
                flat[offset: offset + rows * row] = part[: rows * row]
                offset += rows * row

    def _reduce_scatter(self, call: Call) -> None:
        rows = call.outputs[0].shape[0]
        self._reduce_rows(call, self._rank * rows, rows)

    def _reduce_scatterv(self, call: Call) -> None:
        self._reduce_rows(call, sum(call.sizes[: self._rank]), call.sizes[self._rank])

    def _reduce_rows(self, call: Call, first: int, rows: int) -> None:
        x, out = call.inputs[0], call.outputs[0]
        reduced = x.clone()
        self._reduce_in_place(reduced, call.redop)
        out.copy_(reduced[first: first + rows])

    def _all_to_allv(self, call: Call) -> None:
        for x, out in zip(call.inputs, call.outputs):
            row = _row_bytes(x)
            self._wait(self._collectives.all_to_all_single(_bytes(out), _bytes(x), [n * row for n in call.recv_sizes],
                                                           [n * row for n in call.sizes]),
                       x, "all_to_all_single")

    _RUNNERS = runner_table(locals())


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0), whatever the row count."""
    return t.element_size() * (t[0].numel() if t.shape[0] else torch.Size(t.shape[1:]).numel())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view, so byte-moving ops carry any dtype (fp8, packed fp4) through gloo."""
    return t.reshape(-1).view(torch.uint8)
