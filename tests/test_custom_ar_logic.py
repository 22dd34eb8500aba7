"""Custom all-reduce without a GPU: the library's entry points, why each kernel declines a call,
setup's votes, capture bookkeeping, and the dispatch rows that name the kernels."""
from __future__ import annotations

import pytest
import torch

import symcomm
from symcomm import _native, dispatch
from symcomm.backends import custom_ar
from symcomm.peer import capture as peer_capture
from symcomm.peer import context as peer_context
from symcomm.peer import setup as peer_setup
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT, Call
from symcomm.pool import GRANULE_SHIFT
from types import SimpleNamespace

from symcomm import base


class FakeState:
    """What the kernel paths read of the shared peer context, with no CUDA behind it."""

    def __init__(self, granules=None, can_register=True, graph_slots=8):
        self.world_size = 2
        self.flagfree_bytes = peer_context.default_flagfree_bytes(2)
        self.staging_bytes = peer_context.DEFAULT_STAGING_BYTES
        self.granules = granules
        self.can_register = can_register
        self.graph_slots = graph_slots
        self.next_slot = 1
        self.region_slots = {}
        self.region_numbers = {}
        self.capture = None
        self.free_slots = []
        self.graph_slots_of = {}
        self.alarm = None

    next_free_slot = peer_context.PeerContext.next_free_slot
    region_of = peer_context.PeerContext.region_of
    session = peer_context.PeerContext.session
    input_of = peer_context.PeerContext.input_of
    output_slot = peer_context.PeerContext.output_slot
    _record = peer_context.PeerContext._record
    launch_inputs = peer_context.PeerContext.launch_inputs

    def guard(self, session):
        session.token = 1
        self.graph_slots_of.setdefault(1, [])
        return 1


def _call(numel=1024, dtype=torch.bfloat16, op="all_reduce", redop="sum", in_ptr=1 << 30, out_ptr=2 << 30):
    x = torch.empty(numel, dtype=dtype)
    return Call(op, [x], [x], [in_ptr], [out_ptr], None, redop, x.nbytes)


@pytest.mark.needs_native
def test_library_exports_every_entry_point():
    lib = peer_setup.load_library()
    for name in (n for n in _native.SIGNATURES if n.startswith("symcomm_ar_")):
        assert getattr(lib, name) is not None
    assert lib.symcomm_cuda_error_string(1) == b"invalid argument"


@pytest.mark.parametrize("algo", custom_ar.ALGO_CODES)
def test_accepts_sums_of_supported_dtypes_in_whole_vectors(algo):
    backend = custom_ar.AllReduceKernelPath(algo, peer_setup.SharedContext(FakeState()))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert backend.why_not(_call(dtype=dtype)) is None
    assert backend.why_not(_call(numel=0)) is None


@pytest.mark.parametrize("algo", custom_ar.ALGO_CODES)
@pytest.mark.parametrize("call,reason", [
    (_call(op="all_to_allv"), " only"),
    (_call(redop="max"), "only sum"),
    (_call(dtype=torch.int32), "dtype torch.int32 is unsupported"),
    (_call(numel=1001), "not a multiple of 16"),
    (_call(in_ptr=(1 << 30) + 8), "16-byte aligned"),
    (_call(out_ptr=(2 << 30) + 4), "16-byte aligned"),
])
def test_declines_with_a_reason(algo, call, reason):
    assert reason in custom_ar.AllReduceKernelPath(algo, peer_setup.SharedContext(FakeState())).why_not(call)


def test_capacity_differs_by_kernel():
    state = FakeState()
    over_flagfree = _call(numel=peer_context.default_flagfree_bytes(2) // 2 + 8)
    assert "capacity" in custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state)).why_not(over_flagfree)
    assert custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(state)).why_not(over_flagfree) is None
    over_staging = _call(numel=peer_context.DEFAULT_STAGING_BYTES // 2 + 8)
    for algo in (ONESHOT, TWOSHOT):
        assert "capacity" in custom_ar.AllReduceKernelPath(algo, peer_setup.SharedContext(state)).why_not(over_staging)


def test_one_shot_reads_pool_inputs_past_the_staging_capacity_in_place_or_not():
    """An input in a mapped pool region is read where it lies, so the staging buffer does not
    bound a one-shot, in place or not (run() sums an in-place one into a fresh tensor): whether
    a call is in place is this rank's own fact and must not decide the path. A non-pool input
    is staged, and two-shot reduces through its scratch buffer of the staging size: both keep
    the limit and say so."""
    granule = (1 << 30) >> GRANULE_SHIFT
    state = FakeState(granules={g: granule << GRANULE_SHIFT for g in range(granule, granule + 64)})
    state.region_slots = {granule << GRANULE_SHIFT: 3}
    numel = peer_context.DEFAULT_STAGING_BYTES // 2 + 8
    oneshot = custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(state))
    twoshot = custom_ar.AllReduceKernelPath(TWOSHOT, peer_setup.SharedContext(state))
    assert oneshot.why_not(_call(numel=numel)) is None
    assert oneshot.why_not(_call(numel=numel, out_ptr=1 << 30)) is None  # in place
    not_pool = oneshot.why_not(_call(numel=numel, in_ptr=3 << 30))
    assert "capacity" in not_pool and "input in the symmetric pool is read in place" in not_pool
    assert "capacity" in twoshot.why_not(_call(numel=numel))
    assert "symmetric pool" not in twoshot.why_not(_call(numel=numel))
    # run() reads that input in place: no staging, the region's slot.
    assert state.input_of(1 << 30, numel * 2, 0, peers_read=True)[:3] == (0, 3, 0)


GATHERS = ("all_gather", "all_gatherv")


def _collective(op, chunk_numel=1024, world=2, dtype=torch.bfloat16, redop="sum", in_ptr=1 << 30, out_ptr=2 << 30):
    """An all_gather(v) (x one chunk, out world chunks) or reduce_scatter(v) (the reverse) call;
    the v-variants with every rank's size equal."""
    chunk, whole = torch.empty(chunk_numel, dtype=dtype), torch.empty(world * chunk_numel, dtype=dtype)
    x, out = (chunk, whole) if op in GATHERS else (whole, chunk)
    sizes = [chunk_numel] * world if op.endswith("v") else None
    return Call(op, [x], [out], [in_ptr], [out_ptr], sizes, None if op in GATHERS else redop, whole.nbytes)


def _uneven(op, sizes, row=8, dtype=torch.bfloat16, rank=0, redop="sum"):
    """An all_gatherv or reduce_scatterv with rows of ``row`` elements, ``sizes`` rows per rank."""
    whole = torch.empty(sum(sizes), row, dtype=dtype)
    part = whole[:sizes[rank]]
    x, out = (part, whole) if op == "all_gatherv" else (whole, part)
    return Call(op, [x], [out], [1 << 30], [2 << 30], list(sizes), None if op == "all_gatherv" else redop,
                whole.nbytes)


def _flagfree():
    return custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(FakeState()))


FLAGFREE_SLOT = peer_context.default_flagfree_bytes(2)


@pytest.mark.parametrize("op", custom_ar.FLAGFREE_OPS)
@pytest.mark.parametrize("world", [2, 4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_flagfree_serves_gather_and_scatter_up_to_its_receive_slot(op, world, dtype):
    """Capacity is per rank's chunk (one receive slot per peer), so the whole message may reach
    world x the slot: at world 2 with the default 4 MiB slot that is 8 MiB. Outside
    FLAGFREE_COLLECTIVE_WORLDS every call is declined for the world alone."""
    state = FakeState()
    state.world_size = world
    path = custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state))
    size = torch.empty((), dtype=dtype).element_size()
    if world not in custom_ar.FLAGFREE_COLLECTIVE_WORLDS:
        assert "world 2 only" in path.why_not(_collective(op, 8, world, dtype))
        return
    assert path.why_not(_collective(op, 8, world, dtype)) is None  # one vector per rank
    assert path.why_not(_collective(op, 0, world, dtype)) is None  # empty: the C side enqueues nothing
    full = _collective(op, FLAGFREE_SLOT // size, world, dtype)
    assert full.nbytes == world * FLAGFREE_SLOT and path.why_not(full) is None
    over = path.why_not(_collective(op, FLAGFREE_SLOT // size + 16 // size, world, dtype))
    assert "exceeds custom-flagfree's receive slot" in over


@pytest.mark.parametrize("op", custom_ar.FLAGFREE_OPS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float64, torch.float8_e4m3fn],
                         ids=str)
def test_flagfree_collectives_refuse_dtypes_whose_data_can_be_the_sentinel(op, dtype):
    """0xFFFFFFFF is int32's -1, four uint8 255s, the low word of ordinary float64 values: a
    receiver would wait for it forever, or a writer's swap would change a real value."""
    assert "sentinel" in _flagfree().why_not(_collective(op, 64, 2, dtype))


@pytest.mark.parametrize("op", custom_ar.FLAGFREE_OPS)
@pytest.mark.parametrize("chunk_numel", [1, 7, 500, 1001])
def test_flagfree_collectives_refuse_chunks_of_part_vectors(op, chunk_numel):
    """A chunk that is not whole 16-byte vectors is refused, not padded: rank r's chunk starts
    at r x chunk in the gathered tensor, which would not be vector-aligned either."""
    assert "not whole 16-byte vectors" in _flagfree().why_not(_collective(op, chunk_numel))


@pytest.mark.parametrize("op", ["reduce_scatter", "reduce_scatterv"])
@pytest.mark.parametrize("redop", ["max", "min", "prod", "avg"])
def test_flagfree_scatters_only_sum(op, redop):
    """The kernel sums: any other reduction is declined (a found bug: reduce_scatterv with op=max
    was once accepted and summed)."""
    assert "only sum" in _flagfree().why_not(_collective(op, redop=redop))
    if op == "reduce_scatterv":
        assert "only sum" in _flagfree().why_not(_uneven(op, [3, 5], redop=redop))


@pytest.mark.parametrize("op", ["all_gatherv", "reduce_scatterv"])
def test_flagfree_v_variants_check_every_ranks_chunk(op):
    """Uneven sizes: each rank's chunk must be whole vectors and fit one receive slot, and the
    reason names the rank, so that every rank (which sees the same sizes) declines alike."""
    path = _flagfree()
    assert path.why_not(_uneven(op, [3, 5])) is None  # rows of 16 bytes
    assert path.why_not(_uneven(op, [0, 5])) is None  # a rank with no rows still takes part
    assert "rank 1's chunk of 24 bytes is not whole 16-byte vectors" in path.why_not(_uneven(op, [2, 3], row=4))
    slot_rows = FLAGFREE_SLOT // 16
    assert path.why_not(_uneven(op, [1, slot_rows])) is None
    assert "rank 1's chunk" in path.why_not(_uneven(op, [1, slot_rows + 1])) and "receive slot" in path.why_not(
        _uneven(op, [1, slot_rows + 1]))


def test_flagfree_gatherv_moves_one_tensor_per_call():
    x = torch.empty(64, dtype=torch.bfloat16)
    two = Call("all_gatherv", [x, x], [torch.empty(128, dtype=torch.bfloat16)] * 2, [1 << 30] * 2, [2 << 30] * 2,
               [64, 64], None, 512)
    assert "one tensor per call" in _flagfree().why_not(two)


def test_flagfree_serves_no_other_op_and_other_kernels_no_gather():
    x = torch.empty(64, dtype=torch.bfloat16)
    a2a = Call("all_to_allv", [x], [x], [1 << 30], [2 << 30], [32, 32], None, 128)
    assert "serves all_reduce, all_gather(v) and reduce_scatter(v) only" in _flagfree().why_not(a2a)
    for algo in (ONESHOT, TWOSHOT):
        path = custom_ar.AllReduceKernelPath(algo, peer_setup.SharedContext(FakeState()))
        assert "all_reduce only" in path.why_not(_collective("all_gather"))
    assert "all_reduce only" in custom_ar.AllReduceKernelPath(
        TWOSHOT, peer_setup.SharedContext(FakeState())).why_not(_collective("reduce_scatter"))


class _RecordingLibrary:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args)) or 0


FLAGFREE_ENTRY = {"all_gather": "symcomm_ar_flagfree_all_gatherv", "all_gatherv": "symcomm_ar_flagfree_all_gatherv",
                  "reduce_scatter": "symcomm_ar_flagfree_reduce_scatterv",
                  "reduce_scatterv": "symcomm_ar_flagfree_reduce_scatterv"}


def _recorded_launch(call, world=2):
    state = FakeState()
    state.world_size = world
    state.lib, state.ctx = _RecordingLibrary(), 7
    state.launch_stream = lambda session: 99
    custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state)).run(call)
    [(name, args)] = state.lib.calls
    return name, args


@pytest.mark.parametrize("op", custom_ar.FLAGFREE_OPS)
def test_flagfree_collectives_launch_every_ranks_chunk(op):
    """The entry point takes each rank's chunk in bytes, not the call's nbytes (the whole message)."""
    call = _collective(op, 1024, world=4)
    name, args = _recorded_launch(call, world=4)
    assert name == FLAGFREE_ENTRY[op]
    assert args[:4] == (7, _native.DTYPE_CODES[torch.bfloat16], 1 << 30, 2 << 30) and args[5] == 99
    assert list(args[4]) == [2048] * 4


@pytest.mark.parametrize("op", ["all_gatherv", "reduce_scatterv"])
def test_flagfree_v_variants_launch_their_sizes(op):
    name, args = _recorded_launch(_uneven(op, [3, 0, 5, 1], row=8), world=4)
    assert name == FLAGFREE_ENTRY[op] and list(args[4]) == [48, 0, 80, 16]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("op", custom_ar.FLAGFREE_OPS)
def test_builtin_table_names_the_flagfree_collectives_only_where_measured(world, op):
    """World 2: first to 1 MiB in all (measured on 2x H200), never above. Worlds 4 and 8: nowhere."""
    table = dispatch.DispatchTable(dispatch.BUILTIN[min(world, 4)], "builtin")
    for nbytes in (0, 1 << 10, 64 << 10, 1 << 20, (1 << 20) + 16, 16 << 20):
        order = table.preference(op, nbytes)
        if world == 2 and nbytes <= 1 << 20:
            assert order[0] == FLAGFREE, (op, nbytes, order)
        else:
            assert FLAGFREE not in order, (op, nbytes, order)


def test_equal_sizes_need_whole_vector_chunks_not_rows():
    """custom-oneshot's reduce_scatter and custom-push's gather address each rank's part by
    byte offset: with equal sizes a 1-D tensor (rows of one element) is served when one rank's
    chunk is whole 16-byte vectors; with unequal sizes every row must be."""
    from symcomm.backends.peer_path import offset_unit
    oneshot = custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(FakeState()))
    assert oneshot.why_not(_collective("reduce_scatter", chunk_numel=8)) is None  # 16-byte chunks of 2-byte rows
    assert "one rank's chunk of 8 bytes" in oneshot.why_not(_collective("reduce_scatter", chunk_numel=4))
    x = torch.empty(8, dtype=torch.bfloat16)
    uneven = Call("reduce_scatterv", [x], [x[:3]], [1 << 30], [2 << 30], [3, 5], "sum", x.nbytes)
    assert "a row of 2 bytes" in oneshot.why_not(uneven)
    even = Call("all_gatherv", [x[:4]], [x], [1 << 30], [2 << 30], [4, 4], None, x.nbytes)
    assert offset_unit(even, x, 2) == 8 and offset_unit(uneven, x, 2) == 2
    assert offset_unit(_collective("all_gather", chunk_numel=0), torch.empty(0), 2) == 0


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_flagfree_collectives_copy_a_misaligned_view_instead_of_declining(op):
    """Alignment is rank-local: a misaligned input or output must not send this rank to another
    path than its peers. The kernel gets aligned copies; the result lands in the real output."""
    state = FakeState()
    state.lib, state.ctx = _RecordingLibrary(), 7
    state.launch_stream = lambda session: 99
    path = custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state))
    chunk, whole = torch.zeros(1024 + 1, dtype=torch.bfloat16)[1:], torch.zeros(2048 + 1, dtype=torch.bfloat16)[1:]
    x, out = (chunk, whole) if op == "all_gather" else (whole, chunk[:512])
    call = Call(op, [x], [out], [x.data_ptr()], [out.data_ptr()], None, None if op == "all_gather" else "sum",
                2048 * 2)
    assert x.data_ptr() % 16 and out.data_ptr() % 16 and path.why_not(call) is None
    path.run(call)
    [(name, args)] = state.lib.calls
    assert name == FLAGFREE_ENTRY[op] and args[2] % 16 == 0 and args[3] % 16 == 0
    assert args[2] != x.data_ptr() and args[3] != out.data_ptr()


@pytest.mark.parametrize("op", ["reduce_scatter", "reduce_scatterv"])
def test_oneshot_scatter_takes_a_misaligned_ordinary_view_instead_of_declining(op):
    """One-shot's reduce-scatter stages an ordinary input by a copy (any alignment) and writes a
    misaligned output through an aligned buffer, so this rank's addresses never send it to
    another path than its peers. A pool input's alignment is the same on every rank (one
    offset everywhere): that one may still decline."""
    state = FakeState()
    state.lib, state.ctx = _RecordingLibrary(), 7
    state.launch_stream = lambda session: 99
    state.rank = 1
    path = custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(state))
    x = torch.zeros(2048 + 1, dtype=torch.bfloat16)[1:]
    out = torch.zeros(1024 + 1, dtype=torch.bfloat16)[1:]
    call = Call(op, [x], [out], [x.data_ptr()], [out.data_ptr()], None if op == "reduce_scatter" else [1024, 1024],
                "sum", x.nbytes)
    assert x.data_ptr() % 16 and out.data_ptr() % 16 and path.why_not(call) is None
    path.run(call)
    [(name, args)] = state.lib.calls
    assert name == "symcomm_ar_reduce_scatterv"
    assert args[2] == x.data_ptr() and args[9] == 1, "the ordinary input is staged by a copy"
    assert args[7] % 16 == 0 and args[7] != out.data_ptr(), "the kernel writes an aligned buffer"


def test_flagfree_collectives_decline_above_world_2():
    """custom_ar.FLAGFREE_COLLECTIVE_WORLDS: the flag-free gather and scatter have passed on real
    ranks at world 2 only, so elsewhere both decline, saying why."""
    state = FakeState()
    state.world_size = 4
    path = custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state))
    for op in custom_ar.FLAGFREE_OPS:
        reason = path.why_not(_collective(op, 1024, world=4))
        assert "world 2 only" in reason and "4 ranks" in reason, reason
    assert path.why_not(_call(1024)) is None  # the all-reduce itself is unaffected


@pytest.mark.parametrize("world,ok", [(1, False), (2, True), (3, False), (4, True), (6, True), (8, True), (16, False)])
def test_world_sizes(world, ok):
    assert (peer_setup.world_size_problem(world) is None) == ok


SIZES = [peer_context.DEFAULT_STAGING_BYTES, peer_context.default_flagfree_bytes(2), peer_context.DEFAULT_GRAPH_SLOTS]


class Exchange:
    """Stands in for the all-gather over the torch group: this rank's row plus scripted peers."""

    def __init__(self, peers):
        self.peers = peers  # one list of rows per exchange round, for the other ranks
        self.sent = []

    def __call__(self, values):
        self.sent.append(list(values))
        return [list(values), *self.peers[len(self.sent) - 1]]


class _UnusedLibrary:
    """Stands in for csrc/'s library where the vote must decide before any of it is called, so
    these tests run where the library was not built."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} called before the vote allowed it")


@pytest.fixture
def no_library_needed(monkeypatch):
    monkeypatch.setattr(peer_setup, "load_library", _UnusedLibrary)


def test_setup_disabled_by_environment_still_votes(monkeypatch):
    monkeypatch.setenv("SYMCOMM_DISABLE_CUSTOM_AR", "1")
    ex = Exchange([[[0, peer_setup.host_identity(), *SIZES, 1]]])
    state, reason = peer_setup.open_context(0, 2, torch.device("cuda", 0), ex, 30.0, None)
    assert state is None and "SYMCOMM_DISABLE_CUSTOM_AR" in reason
    assert ex.sent[0][0] == 1  # the peers learn this rank is out, so they don't wait for it


def test_setup_falls_back_when_a_peer_votes_no_or_ranks_span_hosts(no_library_needed):
    here = peer_setup.host_identity()
    state, reason = peer_setup.open_context(0, 2, torch.device("cuda", 0), Exchange([[[1, here, *SIZES, 1]]]), 30.0, None)
    assert state is None and "another rank" in reason
    state, reason = peer_setup.open_context(0, 2, torch.device("cuda", 0), Exchange([[[0, here + 1, *SIZES, 1]]]), 30.0, None)
    assert state is None and "span hosts" in reason


def test_ranks_with_different_buffer_sizes_turn_the_kernels_off_everywhere(no_library_needed):
    """A peer built with another custom_ar_capacity: addresses computed from the local sizes
    would land outside its buffers, so every rank falls back, naming the sizes."""
    here = peer_setup.host_identity()
    other = [peer_context.DEFAULT_STAGING_BYTES // 2, *SIZES[1:]]
    ex = Exchange([[[0, here, *other, 1]]])
    state, reason = peer_setup.open_context(0, 2, torch.device("cuda", 0), ex, 30.0, None)
    assert state is None and "disagree on the buffer sizes" in reason and f"rank 1: {other}" in reason
    assert ex.sent[0][2:5] == SIZES and ex.sent[0][5] in (0, 1)


def test_unsupported_world_size_votes_no():
    ex = Exchange([[[1, 0, *SIZES, 1]] * 2])
    state, reason = peer_setup.open_context(0, 3, torch.device("cuda", 0), ex, 30.0, None)
    assert state is None and "world size 3" in reason and ex.sent[0][0] == 1


def test_host_identity_is_stable_and_probe_tokens_distinct():
    assert peer_setup.host_identity() == peer_setup.host_identity()
    tokens = {peer_setup.probe_token(r) for r in range(8)}
    assert len(tokens) == 8 and 0 not in tokens


def test_capture_records_each_input_once_and_stages_what_cannot_be_registered():
    granule = 77
    state = FakeState(granules={granule: granule << GRANULE_SHIFT}, graph_slots=3)
    session = peer_capture.CaptureSession()
    assert state._record(session, 1 << 30) == 1
    assert state._record(session, 1 << 30) == 1  # same buffer, same slot
    assert state._record(session, 3 << 30) == 2
    assert state._record(session, granule << GRANULE_SHIFT) == 0  # symmetric pool: cuMem
    assert state._record(session, 5 << 30) == 0  # slots exhausted: stage instead
    assert session.out_of_slots and list(session.slots) == [1 << 30, 3 << 30]
    no_ipc = FakeState(can_register=False)
    assert no_ipc._record(peer_capture.CaptureSession(), 1 << 30) == 0


def test_capture_registration_refuses_mismatched_counts_before_touching_cuda():
    session = peer_capture.CaptureSession()
    session.slots, session.calls = {1 << 30: 1}, [(0, 2, 2048, -1, -1)]
    problem = peer_setup.register_captured(FakeState(), session, False, Exchange([[[0, 2, 2]]]))
    assert "different numbers" in problem and "rank 0: 1 buffers in 1 calls" in problem
    assert "rank 1: 2 buffers in 2 calls" in problem
    problem = peer_setup.register_captured(FakeState(), session, False, Exchange([[[1, 1, 1]]]))
    assert "capture failed on rank(s) 1" in problem


def test_capture_registration_compares_the_pattern_not_just_the_count():
    """Rank 0 captured buffers A, A, B; rank 1 C, D, D: two buffers each, but call 1 would pair
    A with D. The pattern of first-use indices differs, and every rank says where."""
    session = peer_capture.CaptureSession()
    calls = [(0, 2, 2048, -1, -1), (0, 2, 2048, -1, -1), (1, 2, 2048, -1, -1)]
    session.slots, session.calls = {1 << 30: 1, 2 << 30: 2}, calls
    peer = [0, 2, 2048, -1, -1, 1, 2, 2048, -1, -1, 1, 2, 2048, -1, -1]
    ex = Exchange([[[0, 2, 3]], [peer]])
    problem = peer_setup.register_captured(FakeState(), session, False, ex)
    assert "at captured call 1: the input buffer differs (rank 0: 0, rank 1: 1)" in problem
    assert ex.sent[1] == [v for c in calls for v in c]


@pytest.mark.parametrize("field,theirs", [
    (1, 1),                 # another kernel (one-shot against two-shot)
    (2, 4096),              # another size
    (3, 8),                 # another pool region
    (4, 6 << 20),           # the same region at a rank-dependent offset: (rank + 1) x 2 MiB before it
])
def test_captured_calls_are_compared_by_kernel_size_region_and_offset(field, theirs):
    """The same buffer pattern is not enough: a pool input at another offset on one rank would
    be read at the wrong place at every replay. Every rank gets the same PeerMismatchError
    text naming the field."""
    mine = (peer_capture.IN_REGION, 2, 2048, 7, 4 << 20)
    session = peer_capture.CaptureSession()
    session.calls = [mine]
    other = list(mine)
    other[field] = theirs
    problem = peer_setup.register_captured(FakeState(), session, False, Exchange([[[0, 0, 1]], [other]]))
    assert f"the {peer_capture.CALL_FIELDS[field]} differs (rank 0: {mine[field]}, rank 1: {theirs})" in problem


def test_run_records_the_pattern_of_captured_calls(monkeypatch):
    """What run() appends per captured call: the recorded buffer's index, or how it read its
    input instead (staged, symmetric region, flag-free's direct read). An in-place one-shot
    records what its out-of-place twin records."""
    granule, unmapped = 9, 11
    state = FakeState(granules={granule: granule << GRANULE_SHIFT, unmapped: unmapped << GRANULE_SHIFT})
    state.region_slots = {granule << GRANULE_SHIFT: 7}  # a local slot number...
    state.region_numbers = {granule << GRANULE_SHIFT: 0}  # ...and the order every rank agrees on
    launched = []

    def run(ctx, algo, dtype, ptr, slot, offset, out, nbytes, stage, stream):
        launched.append((algo, stage, slot, offset))
        return 0

    def in_place(ctx, dtype, slot, offset, scratch, inout, nbytes, stream):
        launched.append((ONESHOT, 0, slot, offset))
        return 0
    state.lib, state.ctx = SimpleNamespace(symcomm_ar_run=run, symcomm_ar_oneshot_in_place=in_place), 1
    state.launch_stream = lambda session: 0
    state.capture = session = peer_capture.CaptureSession()
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    one, two = custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(state)), custom_ar.AllReduceKernelPath(TWOSHOT, peer_setup.SharedContext(state))
    flag = custom_ar.AllReduceKernelPath(FLAGFREE, peer_setup.SharedContext(state))
    two.run(_call(in_ptr=1 << 30))                                   # recorded, buffer 0
    one.run(_call(in_ptr=3 << 30))                                   # recorded, buffer 1
    two.run(_call(in_ptr=1 << 30))                                   # buffer 0 again
    one.run(_call(in_ptr=4 << 30, out_ptr=4 << 30))                  # in-place one-shot: buffer 2
    one.run(_call(in_ptr=unmapped << GRANULE_SHIFT))                 # pool memory, unmapped: staged
    two.run(_call(in_ptr=(granule << GRANULE_SHIFT) + 4096))         # in a mapped pool region
    flag.run(_call(in_ptr=5 << 30))                                  # flag-free reads it directly
    nbytes = _call().nbytes
    assert session.calls == [(0, 2, nbytes, -1, -1), (1, 1, nbytes, -1, -1), (0, 2, nbytes, -1, -1),
                             (2, 1, nbytes, -1, -1), (peer_capture.STAGED, 1, nbytes, -1, -1),
                             (peer_capture.IN_REGION, 2, nbytes, 0, 4096), (peer_capture.DIRECT, 0, nbytes, -1, -1)]
    assert [l[1:] for l in launched] == [(0, 1, 0), (0, 2, 0), (0, 1, 0), (0, 3, 0), (1, 0, 0), (0, 7, 4096),
                                         (1, 0, 0)]
    state.capture = None  # outside graph_capture(): nothing is recorded
    two.run(_call(in_ptr=6 << 30))
    assert len(session.calls) == 7 and launched[-1][1:] == (1, 0, 0)


def test_in_place_one_shot_of_a_pool_input_sums_through_scratch_at_every_size(monkeypatch):
    """An in-place one-shot of a pool input, past the staging buffer or within it, reads the
    input through the region's slot (no staging), as peers calling out of place do, and hands
    the kernel a scratch tensor plus the input to copy back to; a capture records it exactly as
    the same call out of place, so ranks that differ only in calling in place compare equal.
    Staging it would send this rank to the peers' staging buffers while they read the pool. An
    ordinary tensor in place is the same inside graph_capture(): its out-of-place twin gets a
    slot, so it gets the same slot and sums through scratch. Outside a capture both are staged."""
    granule = (1 << 30) >> GRANULE_SHIFT
    base_ptr = granule << GRANULE_SHIFT
    state = FakeState(granules={g: base_ptr for g in range(granule, granule + 64)})
    state.region_slots, state.region_numbers = {base_ptr: 5}, {base_ptr: 0}
    through, plain = [], []

    def in_place(ctx, dtype, slot, offset, scratch, inout, nbytes, stream):
        through.append((slot, offset, inout, nbytes, scratch != inout))
        return 0

    def run(ctx, algo, dtype, ptr, slot, offset, out, nbytes, stage, stream):
        plain.append((ptr == out, stage, slot, offset))
        return 0
    state.lib = SimpleNamespace(symcomm_ar_oneshot_in_place=in_place, symcomm_ar_run=run)
    state.ctx, state.launch_stream = 1, lambda session: 0
    state.capture = session = peer_capture.CaptureSession()
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    one = custom_ar.AllReduceKernelPath(ONESHOT, peer_setup.SharedContext(state))
    numel, ptr, ordinary = peer_context.DEFAULT_STAGING_BYTES // 2 + 8, base_ptr + 4096, 3 << 30
    one.run(_call(numel=numel, in_ptr=ptr, out_ptr=ptr))       # in place, past the buffer
    one.run(_call(numel=numel, in_ptr=ptr, out_ptr=2 << 30))   # the same out of place
    one.run(_call(numel=1024, in_ptr=ptr, out_ptr=ptr))        # in place within it
    one.run(_call(numel=1024, in_ptr=ptr, out_ptr=2 << 30))    # the same out of place
    one.run(_call(numel=1024, in_ptr=ordinary, out_ptr=ordinary))  # an ordinary tensor in place
    one.run(_call(numel=1024, in_ptr=ordinary, out_ptr=2 << 30))    # the same out of place
    assert through == [(5, 4096, ptr, numel * 2, True), (5, 4096, ptr, 2048, True), (1, 0, ordinary, 2048, True)]
    assert plain == [(False, 0, 5, 4096), (False, 0, 5, 4096), (False, 0, 1, 0)]
    assert session.calls[0] == session.calls[1] == (peer_capture.IN_REGION, 1, numel * 2, 0, 4096)
    assert session.calls[2] == session.calls[3] == (peer_capture.IN_REGION, 1, 2048, 0, 4096)
    assert session.calls[4] == session.calls[5] == (0, 1, 2048, -1, -1)  # the first captured buffer
    state.capture = None  # eagerly an ordinary tensor is staged, in place or not
    one.run(_call(numel=1024, in_ptr=ordinary, out_ptr=ordinary))
    assert len(through) == 3 and plain[-1] == (True, 1, 0, 0)


@pytest.mark.parametrize("world", (2, 4))
def test_builtin_table_puts_the_kernels_first_up_to_their_capacity(world):
    table = dispatch.builtin_table(world)
    for nbytes in (1 << 10, 64 << 10, 1 << 20, 4 << 20):
        assert table.preference("all_reduce", nbytes)[0].startswith("custom-"), nbytes
    assert table.preference("all_reduce", 64 << 20)[0] == "nccl"
    for nbytes in (1 << 10, 1 << 20, 16 << 20):
        prefs = table.preference("all_reduce", nbytes)
        # a kernel that declines still leaves both NCCL paths to fall back on
        assert {"nccl", "nccl-symm"} <= set(prefs)
        # all_gather: only the flag-free kernel, and only where it was measured (world 2, to 1 MiB)
        gather_first = table.preference("all_gather", nbytes)[0]
        assert gather_first == ("custom-flagfree" if world == 2 and nbytes <= 1 << 20 else "nccl-symm"), (nbytes, gather_first)


def test_check_mode_compares_alignment_and_signatures_share_one_length():
    """A view misaligned on one rank only would send that rank to NCCL and its peers to a
    kernel; check mode's signature carries the misalignment so ranks compare it, and names it
    as the cause of the path disagreement. Where every rank took the same path (two-shot-push
    copies a misaligned input), the alignment alone is no mismatch. Every operation's
    signature has one length, so ranks in different operations compare op codes."""
    from symcomm import check_mode as checks
    misaligned, names = checks.signature(_call(in_ptr=(1 << 30) + 8), 0, 2, None)
    other, _ = checks.signature(_call(), 1, 2, None, op="all_gatherv_fp4", scalars=[("global_scale", 7)])
    assert len(misaligned) == len(names) == len(other)
    assert misaligned[names.index(checks.MISALIGNMENT)] == 8
    paths = ["nccl", "custom-oneshot"]
    problem = checks.first_mismatch([misaligned, checks.signature(_call(), 1, 2, None)[0]], names, paths)
    assert problem is not None and "misalignment" in problem and "rank 0: 8, rank 1: 0" in problem
    same_path = [checks.signature(_call(in_ptr=(1 << 30) + 8), 1, 2, None)[0], checks.signature(_call(), 1, 2, None)[0]]
    assert checks.first_mismatch(same_path, names, paths) is None


@pytest.mark.parametrize("algo", custom_ar.ALGO_CODES)
def test_check_mode_compares_only_the_kernels_inputs_offsets(algo):
    """The all-reduce kernels write every output locally, so check mode compares where the input
    sits and not the output: rank 0 summing in place into its pool tensor and rank 1 writing an
    ordinary tensor sign alike. A path that compares outputs too (the base rule) tells them apart,
    and an input at another offset still does."""
    from symcomm import check_mode as checks
    pool_base = 1 << 30

    def locate(ptr):
        return [0, ptr - pool_base] if pool_base <= ptr < 2 * pool_base else [-1, -1]
    path = custom_ar.AllReduceKernelPath(algo, peer_setup.SharedContext(FakeState()))
    x = pool_base + 4096
    in_place, out_of_place = _call(in_ptr=x, out_ptr=x), _call(in_ptr=x, out_ptr=3 << 30)
    moved = _call(in_ptr=x + 4096, out_ptr=3 << 30)

    def sign(call, compared):
        return checks.signature(call, 1, 2, locate, compared=compared)[0]
    assert path.compared_offsets(in_place) == ("x",)
    assert sign(in_place, path.compared_offsets(in_place)) == sign(out_of_place, path.compared_offsets(out_of_place))
    assert sign(in_place, ("x", "out")) != sign(out_of_place, ("x", "out"))
    assert sign(moved, path.compared_offsets(moved)) != sign(out_of_place, path.compared_offsets(out_of_place))


def test_a_rank_that_turned_the_kernels_off_still_votes(no_library_needed):
    """custom_ar_capacity=0 on one rank only: that rank still joins the vote (saying no), so
    peers with kernels on fall back instead of waiting for it in the exchange."""
    ex = Exchange([[[0, peer_setup.host_identity(), *SIZES, 1]]])
    state, reason = peer_setup.open_context(0, 2, torch.device("cuda", 0), ex, 30.0, None,
                                         off="turned off (custom_ar_capacity=0)")
    assert state is None and "custom_ar_capacity=0" in reason and ex.sent[0][0] == 1
    peer = Exchange([[[1, peer_setup.host_identity(), *SIZES]]])
    state, reason = peer_setup.open_context(1, 2, torch.device("cuda", 0), peer, 30.0, None)
    assert state is None and "another rank" in reason


class FakeLib:
    """The native entry points PeerContext's bookkeeping calls, recorded, no CUDA."""

    def __init__(self, released=()):
        self.calls = []
        self.released = list(released)

    def symcomm_ar_order_streams(self, ctx, before, after):
        self.calls.append(("order", before, after))
        return 0

    def symcomm_ar_take_released(self, ctx, tokens, capacity, count):
        n = min(capacity, len(self.released))
        for i in range(n):
            tokens[i] = self.released.pop(0)
        count._obj.value = n
        return 0

    def symcomm_ar_release_slot(self, ctx, slot):
        self.calls.append(("release", slot))
        return 0

    def symcomm_ar_destroy(self, ctx):
        self.calls.append(("destroy",))
        return 0

    def symcomm_ar_retire(self, ctx):
        self.calls.append(("retire",))
        return 0

    def symcomm_ep_debug_dedup_from(self, ctx, entries):
        self.calls.append(("dedup_from", entries))
        return 0


def _state(lib, graph_slots=8):
    return peer_context.PeerContext(lib, 1, 0, 2, torch.device("cuda", 0), 1 << 20, 1 << 16, graph_slots, None, 3.0)


def test_the_dedup_threshold_hook_passes_minus_one_for_the_builtin_and_refuses_negatives():
    lib = FakeLib()
    state = _state(lib)
    state.set_ep_dedup_from(0)
    state.set_ep_dedup_from(None)
    state.set_ep_dedup_from(4096)
    assert lib.calls == [("dedup_from", 0), ("dedup_from", -1), ("dedup_from", 4096)]
    with pytest.raises(ValueError, match="entries must be None or >= 0"):
        state.set_ep_dedup_from(-1)
    assert len(lib.calls) == 3  # refused before the library saw it


def test_launches_follow_the_previous_stream_once_per_switch(monkeypatch):
    monkeypatch.setattr(base, "_stream_capturing", lambda: False)
    lib = FakeLib()
    state = _state(lib)
    state.follow(100, None)
    assert lib.calls == [] and state.stream == 100  # the first launch has nothing to wait for
    state.follow(200, None)
    assert lib.calls == [("order", 100, 200)] and state.stream == 200


def test_a_capture_keeps_its_own_stream_and_refuses_a_second(monkeypatch):
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    lib = FakeLib()
    state = _state(lib)
    state.stream = 100
    session = peer_capture.CaptureSession()
    state.follow(300, session)
    state.follow(300, session)
    assert session.stream == 300 and state.stream == 100 and lib.calls == []
    with pytest.raises(symcomm.ArgumentError, match="second stream"):
        state.follow(400, session)
    state.follow(500, None)  # captured outside graph_capture(): nothing to order, nothing kept
    assert state.stream == 100 and lib.calls == []


def test_slots_of_destroyed_graphs_are_released_and_reused():
    lib = FakeLib(released=[7])
    state = _state(lib, graph_slots=4)
    state.graph_slots_of = {7: [1, 2], 8: [3]}
    state.next_slot = 4
    assert state.next_free_slot() == 0  # all three in use, none reported yet
    state.collect_released()
    assert ("release", 1) in lib.calls and ("release", 2) in lib.calls and state.graph_slots_of == {8: [3]}
    assert {state.next_free_slot(), state.next_free_slot()} == {1, 2}
    assert state.next_free_slot() == 0


def test_closing_with_graphs_alive_retires_instead_of_freeing():
    lib = FakeLib()
    state = _state(lib)
    state.graph_slots_of = {3: [1]}
    with pytest.warns(ResourceWarning, match="1 CUDA graph"):
        state.destroy()
    assert lib.calls[-1] == ("retire",) and state.ctx == 0
    lib = FakeLib(released=[3])
    state = _state(lib)
    state.graph_slots_of = {3: [1]}
    state.destroy()
    assert lib.calls[-1] == ("destroy",)


@pytest.mark.parametrize("code,words", [
    ((1 << 32) | (0 << 16) | 3, ("waited 3 s for rank 3", "start barrier", "broken")),
    ((1 << 32) | (3 << 16) | 1, ("for rank 1", "wait for its data")),
    ((2 << 32) | 1, ("never registered", "rank 1")),
])
def test_abort_codes_name_the_peer_and_the_way_out(code, words):
    text = _state(FakeLib()).describe_abort(code)
    for word in words:
        assert word in text, text
    assert "close() it" in text


@pytest.mark.parametrize("conf,mappable", [("", 1), ("expandable_segments:True", 0),
                                           ("backend:cudaMallocAsync", 0), ("max_split_size_mb:64", 1)])
def test_the_first_vote_carries_whether_captured_inputs_can_be_mapped(monkeypatch, no_library_needed, conf, mappable):
    """Whether a captured input is mapped or staged follows this rank's allocator setting, and
    the ranks compare how each captured call reads its input: so it is part of the first vote
    (and open_context makes every rank stage if any must)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    here = peer_setup.host_identity()
    ex = Exchange([[[1, here, *SIZES, 1]]])  # a peer votes no: the vote is all this test needs
    peer_setup.open_context(0, 2, torch.device("cuda", 0), ex, 30.0, None)
    assert ex.sent[0][5] == mappable


def test_launch_inputs_takes_the_stream_then_copies_only_what_is_misaligned():
    """The stream first (the copy must follow symcomm's previous launch); aligned inputs come
    back as they are with the call's addresses, a misaligned one as an aligned copy of equal
    values with the copy's address."""
    order = []
    state = FakeState()
    state.launch_stream = lambda session: order.append("stream") or 5
    raw = torch.arange(20, dtype=torch.float32)
    fine, off = raw[:8], raw[1:9]  # off is 4 bytes past a 16-byte boundary
    assert fine.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 4
    stream, kept, ptrs = state.launch_inputs(None, [fine], [fine.data_ptr()])
    assert (stream, kept[0] is fine, list(ptrs)) == (5, True, [fine.data_ptr()])
    stream, kept, ptrs = state.launch_inputs(None, [fine, off])
    assert order == ["stream", "stream"] and stream == 5 and kept[0] is fine
    assert kept[1].data_ptr() % 16 == 0 and kept[1].data_ptr() != off.data_ptr() and torch.equal(kept[1], off)
    assert list(ptrs) == [fine.data_ptr(), kept[1].data_ptr()]
