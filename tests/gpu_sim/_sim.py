"""Simulated ranks: W custom all-reduce contexts on ONE GPU, in one process.

Every context's buffer is a cudaMalloc of this process, so symcomm_ar_sim_link wires the peer
tables straight to the other contexts' pointers (no CUDA IPC) and caps every grid so all W
ranks' blocks are resident together: each block spins on its peers' block of the same index,
and a rank whose blocks cannot get an SM would leave the others spinning until the bounded
wait gives up. Each rank launches on its own stream, so the W kernels of one call run
concurrently. This exercises the kernels' barrier, sentinel and indexing logic; it says
nothing about NVLink timing (peers here are the same HBM), so never read timings from it.
"""
from __future__ import annotations

import ctypes
import os
from typing import NoReturn

import pytest
import torch

from symcomm import _native
from symcomm.backends.custom_ar import ALGO_CODES
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT
from symcomm.peer.context import PeerContext

ALGOS = (FLAGFREE, ONESHOT, TWOSHOT)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STAGING_BYTES = 2 << 20    # one-shot/two-shot capacity
FLAGFREE_BYTES = 256 << 10  # flag-free capacity (per rank, per receive buffer)
# 8 ranks x 8 blocks of 512 threads: at most 64 blocks, under an H100's 132 SMs even at one
# block per SM, so every rank's blocks are resident at once.
MAX_BLOCKS = 8
TIMEOUT_S = 5.0
# A late rank's head start for its peers: 50M cycles is about 25-30 ms at H100 clocks, long
# against a call (microseconds) and far inside TIMEOUT_S.
LATE_CYCLES = 50_000_000


def cannot_run(reason: str) -> NoReturn:
    """Skip with the reason, or fail under SYMCOMM_REQUIRE_GPU=1, so that a GPU run cannot pass
    by skipping."""
    if os.environ.get("SYMCOMM_REQUIRE_GPU") == "1":
        pytest.fail(f"SYMCOMM_REQUIRE_GPU=1 but: {reason}")
    pytest.skip(reason)


def capacity(algo: str) -> int:
    return FLAGFREE_BYTES if algo == FLAGFREE else STAGING_BYTES


class SimWorld:
    """W linked contexts and one stream per simulated rank; close() destroys the contexts."""

    def __init__(self, world: int, timeout_s: float = TIMEOUT_S, max_blocks: int = MAX_BLOCKS,
                 graph_slots: int = 1, staging_bytes: int = STAGING_BYTES, flagfree_bytes: int = FLAGFREE_BYTES,
                 lib: ctypes.CDLL | None = None):
        """``lib``: another build of the native library, bound with _native.bind (a benchmark's
        variant); the installed one by default."""
        self.lib = _native.load().lib if lib is None else lib
        self.world = world
        self.timeout_s = timeout_s
        self.graph_slots = graph_slots
        self.staging_bytes, self.flagfree_bytes = staging_bytes, flagfree_bytes
        self.device = torch.cuda.current_device()
        self.ctxs = (ctypes.c_void_p * world)()
        self._states: dict[int, PeerContext] = {}
        try:
            for r in range(world):
                ctx = ctypes.c_void_p()
                code = self.lib.symcomm_ar_create(r, world, self.device, staging_bytes, flagfree_bytes, graph_slots,
                                                  timeout_s, ctypes.byref(ctx))
                _native.check(self.lib, "symcomm_ar_create", code)
                self.ctxs[r] = ctx.value
            _native.check(self.lib, "symcomm_ar_sim_link", self.lib.symcomm_ar_sim_link(self.ctxs, world, max_blocks))
        except BaseException:
            self.close(sync=False)
            raise
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        # Load torch's spin kernel now: with lazy module loading, its first launch blocks the
        # host until the device is idle, and a rank spinning in a barrier for the late rank is
        # never idle (seen on H100: the launch returned only when the barrier's timeout expired).
        torch.cuda._sleep(1)
        torch.cuda.synchronize()

    def launch(self, algo: str, dtype: torch.dtype, inputs, outputs, ranks=None, late=None,
               late_cycles: int = LATE_CYCLES) -> None:
        """Enqueues one all-reduce on every rank in `ranks` (default all) before waiting for any.

        Each rank's stream first waits for the current stream (where the inputs were made);
        the current stream then waits for every rank, so a synchronize covers the call.
        `late`: a rank whose stream first runs a spin kernel of late_cycles GPU cycles, so its
        all-reduce starts tens of milliseconds after its peers' (they wait in their barriers,
        or for its flag-free data)."""
        nbytes = inputs[0].numel() * inputs[0].element_size()

        def run(r: int, stream: torch.cuda.Stream) -> None:
            code = self.lib.symcomm_ar_run(self.ctxs[r], ALGO_CODES[algo], _native.DTYPE_CODES[dtype],
                                           inputs[r].data_ptr(), 0, 0, outputs[r].data_ptr(), nbytes, 1,
                                           stream.cuda_stream)
            _native.check(self.lib, f"symcomm_ar_run(rank {r})", code)

        self.each_rank(run, ranks, late, late_cycles)

    def each_rank(self, enqueue, ranks=None, late=None, late_cycles: int = LATE_CYCLES) -> None:
        """``enqueue(rank, stream)`` for every rank in `ranks` (default all) before waiting for
        any, each on its own stream: after the current stream, and before what follows on it.
        `late`: a rank whose stream first spins for late_cycles GPU cycles."""
        ranks = range(self.world) if ranks is None else ranks
        here = torch.cuda.current_stream()
        for r in ranks:
            stream = self.streams[r]
            stream.wait_stream(here)
            if r == late:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(late_cycles)
            enqueue(r, stream)
        for r in ranks:
            here.wait_stream(self.streams[r])

    def link_slot(self, slot: int, tensors, ranks=None) -> None:
        """Graph slot ``slot`` of each rank in ``ranks`` (all by default) reads tensors[q] as
        rank q's buffer: what registration does for real ranks over CUDA IPC. ``tensors`` may
        be addresses."""
        ptrs = (ctypes.c_uint64 * self.world)(*(t if isinstance(t, int) else t.data_ptr() for t in tensors))
        for r in range(self.world) if ranks is None else ranks:
            _native.check(self.lib, "symcomm_ar_set_slot_ptrs", self.lib.symcomm_ar_set_slot_ptrs(self.ctxs[r], slot, ptrs))

    def alarm(self, rank: int) -> int:
        """Rank ``rank``'s alarm word (symcomm.h's SYMCOMM_AR_ABORT_* layout), 0 while healthy."""
        word = ctypes.POINTER(ctypes.c_uint64)()
        _native.check(self.lib, "symcomm_ar_alarm", self.lib.symcomm_ar_alarm(self.ctxs[rank], ctypes.byref(word)))
        return word.contents.value

    def state(self, rank: int) -> PeerContext:
        """Rank ``rank``'s context wrapped the way a Communicator holds it, so tests drive the
        production launch path (stream ordering, capture slots, alarm). One wrapper per rank,
        as in a Communicator: slot numbers are its bookkeeping. It does not own the context:
        close() still destroys it, unless a test retired it through the wrapper."""
        if rank not in self._states:
            state = PeerContext(self.lib, self.ctxs[rank], rank, self.world, torch.device("cuda", self.device),
                                    self.staging_bytes, self.flagfree_bytes, self.graph_slots, None, self.timeout_s)
            state.watch()
            self._states[rank] = state
        return self._states[rank]

    def seed_epochs(self, epoch: int) -> None:
        """Puts every block of every rank at barrier epoch `epoch` (symcomm_ar_debug_seed_epochs):
        the next one-shot/two-shot call uses epoch + 1. Waits for the device first, since no
        kernel may be in flight while the epochs change."""
        torch.cuda.synchronize()
        for r in range(self.world):
            _native.check(self.lib, f"symcomm_ar_debug_seed_epochs(rank {r})",
                          self.lib.symcomm_ar_debug_seed_epochs(self.ctxs[r], epoch))

    def meetings(self, rank: int) -> int:
        """How many meetings of every block rank `rank` has completed (symcomm_ar_debug_meetings):
        one per combine, and one more per dispatch that sent each token once per peer."""
        torch.cuda.synchronize()
        count = ctypes.c_uint64()
        _native.check(self.lib, f"symcomm_ar_debug_meetings(rank {rank})",
                      self.lib.symcomm_ar_debug_meetings(self.ctxs[rank], ctypes.byref(count)))
        return count.value

    def close(self, sync: bool = True) -> None:
        if sync:
            torch.cuda.synchronize()  # peers read each other's buffers until every rank is done
        for r in range(self.world):
            if self.ctxs[r]:
                self.lib.symcomm_ar_destroy(self.ctxs[r])
                self.ctxs[r] = None

    def __enter__(self) -> SimWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def make_inputs(world: int, nbytes: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Random non-zero inputs holding the awkward bit patterns.

    On every rank: the first 32-bit word is 0xFFFFFFFF (the flag-free receive sentinel: the
    writer must swap it, or readers wait forever), then -0.0 (a sum of -0.0 only stays -0.0 if
    the first term seeds it). Per rank, at random places: more sentinel words, 0xFFFF halves
    (one half of a word: not a sentinel), NaN, -0.0."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    per_word = 4 // torch.empty((), dtype=dtype).element_size()
    k = max(1, n // 512)  # about 1% of each rank specials: most sums stay finite and bit-checkable
    out = []
    for _ in range(world):
        x = torch.randn(n, generator=gen, device="cpu", dtype=torch.float32) * 4
        x[x == 0] = 1.0
        x = x.to(dtype)
        bits = _bits(x)
        words = x.view(torch.int32)  # every size here is a multiple of 16 bytes
        words[torch.randint(0, n // per_word, (k,), generator=gen)] = -1  # 0xFFFFFFFF
        if per_word == 2:
            bits[torch.randint(0, n, (k,), generator=gen)] = -1  # 0xFFFF halves
        x[torch.randint(0, n, (k,), generator=gen)] = float("nan")
        x[torch.randint(0, n, (k,), generator=gen)] = -0.0
        words[0] = -1
        x[per_word] = -0.0
        out.append(x.cuda())
    return out


def reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What the kernels compute (csrc/custom_ar.cu, reduce_at and flag_free): fp32 lanes, the
    first rank's value seeds the sum, then ranks 1..W-1 added in order, rounded once to dtype."""
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    return acc.to(inputs[0].dtype)


def check_outputs(outputs: list[torch.Tensor], inputs: list[torch.Tensor], what: str) -> None:
    """Every rank's bits equal rank 0's (NaN payloads included), and rank 0 equals the
    reference bit for bit, except that a NaN only has to be a NaN: the kernels' conversion
    intrinsics and torch's cast may pick different NaN payloads, and IEEE leaves them open."""
    first = _bits(outputs[0])
    for r, out in enumerate(outputs[1:], 1):
        differ = (_bits(out) != first).nonzero()
        assert differ.numel() == 0, f"{what}: rank {r} differs from rank 0 at {differ[:8].flatten().tolist()}"
    ref = reference(inputs)
    nan_ref, nan_out = torch.isnan(ref), torch.isnan(outputs[0])
    bad = (nan_ref != nan_out) | (~nan_ref & (_bits(ref) != first))
    idx = bad.nonzero().flatten()
    if idx.numel():
        i = idx[:4].tolist()
        raise AssertionError(f"{what}: {idx.numel()} elements differ from the rank-order fp32 sum, first at {i}: "
                             f"got {outputs[0][i].tolist()} want {ref[i].tolist()}")
