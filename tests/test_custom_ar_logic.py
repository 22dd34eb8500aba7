"""Custom all-reduce without a GPU: the library's entry points, why each kernel declines a call,
setup's votes, capture bookkeeping, and the dispatch rows that name the kernels."""
from __future__ import annotations

import pytest
import torch

from symcomm import dispatch
from symcomm.backends import custom
from symcomm.backends.base import Call
from symcomm.pool import GRANULE_SHIFT


class FakeState:
    """What CustomBackend reads of CustomAllReduce, with no CUDA behind it."""

    def __init__(self, granules=None, can_register=True, graph_slots=8):
        self.flagfree_bytes = custom.DEFAULT_FLAGFREE_BYTES
        self.staging_bytes = custom.DEFAULT_STAGING_BYTES
        self.granules = granules
        self.can_register = can_register
        self.graph_slots = graph_slots
        self.next_slot = 1
        self.region_slots = {}
        self.capture = None

    next_free_slot = custom.CustomAllReduce.next_free_slot


def _call(numel=1024, dtype=torch.bfloat16, op="all_reduce", redop="sum", in_ptr=1 << 30, out_ptr=2 << 30):
    x = torch.empty(numel, dtype=dtype)
    return Call(op, [x], [x], [in_ptr], [out_ptr], None, redop, x.nbytes)


def test_library_exports_every_entry_point():
    lib = custom.load_library()  # CI builds csrc/ with nvcc, so this must load
    for name in custom._SIGNATURES:
        assert getattr(lib, name) is not None
    assert lib.symcomm_cuda_error_string(1) == b"invalid argument"


@pytest.mark.parametrize("algo", custom.ALGO_CODES)
def test_accepts_sums_of_supported_dtypes_in_whole_vectors(algo):
    backend = custom.CustomBackend(algo, FakeState())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert backend.why_not(_call(dtype=dtype)) is None
    assert backend.why_not(_call(numel=0)) is None


@pytest.mark.parametrize("algo", custom.ALGO_CODES)
@pytest.mark.parametrize("call,reason", [
    (_call(op="all_gather"), "all_reduce only"),
    (_call(redop="max"), "only sum"),
    (_call(dtype=torch.int32), "dtype torch.int32 is unsupported"),
    (_call(numel=1001), "not a multiple of 16"),
    (_call(in_ptr=(1 << 30) + 8), "16-byte aligned"),
    (_call(out_ptr=(2 << 30) + 4), "16-byte aligned"),
])
def test_declines_with_a_reason(algo, call, reason):
    assert reason in custom.CustomBackend(algo, FakeState()).why_not(call)


def test_capacity_differs_by_kernel():
    state = FakeState()
    over_flagfree = _call(numel=custom.DEFAULT_FLAGFREE_BYTES // 2 + 8)
    assert "capacity" in custom.CustomBackend(custom.FLAGFREE, state).why_not(over_flagfree)
    assert custom.CustomBackend(custom.ONESHOT, state).why_not(over_flagfree) is None
    over_staging = _call(numel=custom.DEFAULT_STAGING_BYTES // 2 + 8)
    for algo in (custom.ONESHOT, custom.TWOSHOT):
        assert "capacity" in custom.CustomBackend(algo, state).why_not(over_staging)


@pytest.mark.parametrize("world,ok", [(1, False), (2, True), (3, False), (4, True), (6, True), (8, True), (16, False)])
def test_world_sizes(world, ok):
    assert (custom.world_size_problem(world) is None) == ok


class Exchange:
    """Stands in for the all-gather over the torch group: this rank's row plus scripted peers."""

    def __init__(self, peers):
        self.peers = peers  # one list of rows per exchange round, for the other ranks
        self.sent = []

    def __call__(self, values):
        self.sent.append(list(values))
        return [list(values), *self.peers[len(self.sent) - 1]]


def test_setup_disabled_by_environment_still_votes(monkeypatch):
    monkeypatch.setenv("SYMCOMM_DISABLE_CUSTOM_AR", "1")
    ex = Exchange([[[0, custom.host_identity(), 5]]])
    state, reason = custom.setup(0, 2, torch.device("cuda", 0), ex, 30.0, None)
    assert state is None and "SYMCOMM_DISABLE_CUSTOM_AR" in reason
    assert ex.sent[0][0] == 1  # the peers learn this rank is out, so they don't wait for it


def test_setup_falls_back_when_a_peer_votes_no_or_ranks_span_hosts():
    here = custom.host_identity()
    state, reason = custom.setup(0, 2, torch.device("cuda", 0), Exchange([[[1, here, 5]]]), 30.0, None)
    assert state is None and "another rank" in reason
    state, reason = custom.setup(0, 2, torch.device("cuda", 0), Exchange([[[0, here + 1, 5]]]), 30.0, None)
    assert state is None and "span hosts" in reason


def test_unsupported_world_size_votes_no():
    ex = Exchange([[[1, 0, 5]] * 2])
    state, reason = custom.setup(0, 3, torch.device("cuda", 0), ex, 30.0, None)
    assert state is None and "world size 3" in reason and ex.sent[0][0] == 1


def test_host_identity_is_stable_and_probe_tokens_distinct():
    assert custom.host_identity() == custom.host_identity()
    tokens = {custom.probe_token(r) for r in range(8)}
    assert len(tokens) == 8 and 0 not in tokens


def test_capture_records_each_input_once_and_stages_what_cannot_be_registered():
    granule = 77
    state = FakeState(granules={granule: granule << GRANULE_SHIFT}, graph_slots=3)
    session = custom.CaptureSession()
    one, two = custom.CustomBackend(custom.ONESHOT, state), custom.CustomBackend(custom.TWOSHOT, state)
    assert one._record(session, _call(in_ptr=1 << 30)) == 1
    assert two._record(session, _call(in_ptr=1 << 30)) == 1  # same buffer, same slot
    assert one._record(session, _call(in_ptr=1 << 30, out_ptr=1 << 30)) == 0  # in-place one-shot stages
    assert two._record(session, _call(in_ptr=3 << 30, out_ptr=3 << 30)) == 2  # two-shot may read in place
    assert one._record(session, _call(in_ptr=granule << GRANULE_SHIFT)) == 0  # symmetric pool: cuMem
    assert one._record(session, _call(in_ptr=5 << 30)) == 0  # slots exhausted: stage instead
    assert session.out_of_slots and list(session.slots) == [1 << 30, 3 << 30]
    no_ipc = FakeState(can_register=False)
    assert custom.CustomBackend(custom.ONESHOT, no_ipc)._record(custom.CaptureSession(), _call()) == 0


def test_capture_registration_refuses_mismatched_counts_before_touching_cuda():
    session = custom.CaptureSession()
    session.slots = {1 << 30: 1}
    problem = custom.register_captured(FakeState(), session, False, Exchange([[[0, 2]]]))
    assert "different numbers" in problem and "rank 0: 1" in problem and "rank 1: 2" in problem
    problem = custom.register_captured(FakeState(), session, False, Exchange([[[1, 1]]]))
    assert "capture failed on rank(s) 1" in problem


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
        assert not table.preference("all_gather", nbytes)[0].startswith("custom-")
