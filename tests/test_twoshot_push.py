"""custom-twoshot-push's rules and launch arguments, over stand-in native state (no GPU)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from symcomm import base
from symcomm.backends import twoshot_push
from symcomm.base import TWOSHOT_PUSH, Call
from symcomm.peer import capture as peer_capture
from symcomm.peer import context as peer_context
from symcomm.peer import setup as peer_setup
from symcomm.pool import GRANULE_SHIFT
from test_custom_ar_logic import FakeState

GRANULE = (1 << 30) >> GRANULE_SHIFT
BASE = GRANULE << GRANULE_SHIFT  # a mapped pool region of 64 granules, slot 5
ORDINARY = 3 << 30


def _state(rank=0, world=2):
    state = FakeState(granules={g: BASE for g in range(GRANULE, GRANULE + 64)})
    state.region_slots, state.region_numbers = {BASE: 5}, {BASE: 0}
    state.rank, state.world_size, state.region_problem = rank, world, None
    return state


def _call(x, in_ptr, out_ptr, op="all_reduce", redop="sum"):
    return Call(op, [x], [x], [in_ptr], [out_ptr], None, redop, x.nbytes)


def test_it_serves_sums_into_a_pool_output_at_world_2_and_says_why_not_otherwise(monkeypatch):
    """The output must be in the pool (peers write it); the input may be anywhere. At world 2
    no size limit; at a larger world W-2 chunks pass through scratch, and until it has run on
    real ranks there it declines. Every refusal names its rule."""
    path = twoshot_push.TwoShotPushPath(peer_setup.SharedContext(_state()))
    big = torch.empty((3 * peer_context.DEFAULT_STAGING_BYTES) // 2 + 8, dtype=torch.bfloat16)
    out = BASE + 8192
    assert path.why_not(_call(big, ORDINARY, out)) is None  # three staging buffers' worth
    assert path.why_not(_call(big, out, out)) is None  # in place
    assert "not in a mapped symmetric pool region" in path.why_not(_call(big, out, ORDINARY))
    assert "16-byte boundary" in path.why_not(_call(big, ORDINARY, out + 8))
    assert "multiple of 16" in path.why_not(_call(torch.empty(1001, dtype=torch.bfloat16), ORDINARY, out))
    assert "only sum" in path.why_not(_call(big, ORDINARY, out, redop="max"))
    assert "all_reduce only" in path.why_not(_call(big, ORDINARY, out, op="all_gather"))
    assert "unsupported" in path.why_not(_call(torch.empty(64, dtype=torch.int32), ORDINARY, out))
    assert path.why_not(_call(torch.empty(0, dtype=torch.bfloat16), 0, 0)) is None  # empty: skipped
    four = twoshot_push.TwoShotPushPath(peer_setup.SharedContext(_state(world=4)))
    assert "world 2 only" in four.why_not(_call(big, ORDINARY, out))
    monkeypatch.setattr(twoshot_push, "REAL_WORLDS", (2, 4))
    fits = torch.empty(peer_context.DEFAULT_STAGING_BYTES, dtype=torch.bfloat16)  # two chunks of 1/4: scratch's size
    assert four.why_not(_call(fits, ORDINARY, out)) is None
    over = torch.empty(peer_context.DEFAULT_STAGING_BYTES + 8, dtype=torch.bfloat16)
    assert "scratch buffer" in four.why_not(_call(over, ORDINARY, out))


@pytest.mark.parametrize("rank", (0, 1))
def test_the_launch_gets_the_region_slot_the_output_offset_and_this_ranks_chunk(monkeypatch, rank):
    """The launch gets the output's region slot and offset and reads the input locally: `own` is
    this rank's chunk of it, or in place a copy of that chunk (a peer overwrites that chunk of
    the output). In a capture the call is recorded by the output's region and offset and takes
    no slot, since no peer reads this rank's input."""
    state = _state(rank)
    launched = []

    copied = []

    def push(ctx, dtype, in_ptr, own, slot, out_offset, out, nbytes, stream):
        launched.append((in_ptr, own, slot, out_offset, out, nbytes))
        copied.append(ctypes.string_at(own, (1008, 992)[rank]))  # while `own` is alive
        return 0
    state.lib, state.ctx, state.launch_stream = SimpleNamespace(symcomm_ar_twoshot_push=push), 1, lambda s: 0
    path = twoshot_push.TwoShotPushPath(peer_setup.SharedContext(state))
    x = torch.randn(1000).to(torch.bfloat16)  # 2000 bytes: chunks of 1008 and 992
    out = BASE + 8192
    path.run(_call(x, x.data_ptr(), out))
    assert launched[-1] == (x.data_ptr(), x.data_ptr() + rank * 1008, 5, 8192, out, 2000)
    path.run(_call(x, out, out))  # in place (the fake output address stands for x)
    in_ptr, own, *_ = launched[-1]
    assert in_ptr == out and own not in range(x.data_ptr(), x.data_ptr() + 2000) and own % 16 == 0
    mine = x.view(torch.uint8).numpy().tobytes()[rank * 1008:][:(1008, 992)[rank]]
    assert copied[-1] == mine and copied[0] == mine  # this rank's chunk, copied or read in place
    state.capture = session = peer_capture.CaptureSession()
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    path.run(_call(x, x.data_ptr(), out))
    assert session.calls == [(peer_capture.IN_REGION, twoshot_push.CAPTURE_CODE, 2000, 0, 8192)] and not session.slots


@pytest.mark.parametrize("rank", [0, 1])
def test_a_misaligned_input_is_copied_not_declined(rank):
    """An input's alignment is this rank's own business and must not decide the path (peers
    would wait in another one): run() hands the kernel an aligned copy, and `own` points at
    this rank's chunk of that copy (rank 1's starts past rank 0's 63 vectors)."""
    state = _state(rank=rank)
    launched = []
    state.lib = SimpleNamespace(symcomm_ar_twoshot_push=lambda *a: launched.append(a[2:4]) or 0)
    state.ctx, state.launch_stream = 1, lambda s: 0
    path = twoshot_push.TwoShotPushPath(peer_setup.SharedContext(state))
    raw = torch.randn(1008).to(torch.bfloat16)
    x = raw[1:1001]
    assert x.data_ptr() % 16 and path.why_not(_call(x, x.data_ptr(), BASE)) is None
    path.run(_call(x, x.data_ptr(), BASE))
    in_ptr, own = launched[-1]
    assert in_ptr % 16 == 0 and in_ptr != x.data_ptr()
    assert own == in_ptr + rank * path.chunk_bytes(x.nbytes) and path.chunk_bytes(x.nbytes) == 63 * 16


def _norm_inner_offsets(rank: int, world: int) -> None:
    from _gpu_like import Pool, communicator
    from symcomm import dispatch
    from symcomm.operations.all_reduce_rmsnorm import all_reduce_view
    pool = Pool()
    comm = communicator(pool)
    try:
        tuned = dispatch.read_tuning(dispatch.PACKAGED_DIR / "nvidia_h200_w2.json")
        comm.table = dispatch.DispatchTable(tuned.rules, source="packaged nvidia_h200_w2.json")
        x = pool.tensor(0, ((16 << 20) // 2048, 1024), torch.bfloat16)  # the norm's input, in the pool
        view = all_reduce_view(x)
        inner = comm.router.choose_inner(view, "auto")
        assert inner.name == TWOSHOT_PUSH, inner.name
        assert "x" in inner.compared_offsets(view)
    finally:
        comm.close()


def test_a_composite_operation_still_compares_its_input_when_the_push_serves_the_check():
    """all_reduce_rmsnorm's unfused path checks its inner all-reduce on a view of x (output x)
    before it allocates the real output; with x in the pool at 16 MiB that view goes to
    custom-twoshot-push. The real output, allocated outside the pool, goes to custom-oneshot,
    which reads x at this rank's offset on every peer: so the push must compare x as well, or
    check mode compares nothing for that call."""
    from _spawn import run_world
    run_world(_norm_inner_offsets, 2, timeout_s=120)
