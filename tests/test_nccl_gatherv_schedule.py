"""The NCCL backend's uneven all_gatherv schedules, on CPU with a library that records calls.

The GPU suite checks the gathered bytes; this checks the schedule itself: which calls each
rank enqueues, with which peers, offsets and byte counts, so that every send has its
matching receive and zero-row ranks stay out of it.
"""
import pytest
import torch

from symcomm import _nccl
from symcomm.operations import collectives
from symcomm.backends import nccl as nccl_backend

ROW = 6  # bytes per row: rows of 3 fp16


class _RecordingLib:
    def __init__(self):
        self.calls = []

    def ncclGroupStart(self):
        self.calls.append(("group",))
        return 0

    def ncclGroupEnd(self):
        self.calls.append(("end",))
        return 0

    def ncclSend(self, buf, nbytes, dtype, peer, comm, stream):
        self.calls.append(("send", peer, buf, nbytes))
        return 0

    def ncclRecv(self, buf, nbytes, dtype, peer, comm, stream):
        self.calls.append(("recv", peer, buf, nbytes))
        return 0

    def ncclBroadcast(self, src, dst, nbytes, dtype, root, comm, stream):
        self.calls.append(("bcast", root, src, dst, nbytes))
        return 0


def _run(sizes, rank, in_place=False):
    lib = _RecordingLib()
    backend = nccl_backend.NcclPath()
    backend.attach(_nccl.Library(lib, "/fake", "test", (2, 28, 9)), 1, rank, torch.device("cpu"))
    out = torch.zeros(sum(sizes), 3, dtype=torch.float16)
    start = sum(sizes[:rank])
    x = torch.arange(sizes[rank] * 3, dtype=torch.float16).view(sizes[rank], 3) + 1
    if in_place:
        out[start:start + sizes[rank]] = x
        x = out[start:start + sizes[rank]]
    call = collectives.all_gatherv_call(x, sizes, out, rank, len(sizes), torch.device("cpu"))
    backend._all_gatherv(call, 1, 0)
    return lib.calls, x, out


def test_send_recv_pairs_match_across_ranks_and_skip_empty_slices():
    sizes = [3, 0, 5, 2]
    per_rank = {r: _run(sizes, r)[0] for r in range(4)}
    sends = {(r, c[1], c[3]) for r, calls in per_rank.items() for c in calls if c[0] == "send"}
    recvs = {(c[1], r, c[3]) for r, calls in per_rank.items() for c in calls if c[0] == "recv"}
    assert sends == recvs  # every (from, to, bytes) sent is received, and nothing else
    assert sends == {(s, d, sizes[s] * ROW) for s in range(4) for d in range(4) if s != d and sizes[s]}
    assert all(c[0] in ("group", "send", "recv", "end") for calls in per_rank.values() for c in calls)
    assert all(calls[0] == ("group",) and calls[-1] == ("end",) for calls in per_rank.values())


def test_receives_land_at_each_peers_offset_and_own_rows_are_copied():
    sizes = [3, 0, 5, 2]
    calls, x, out = _run(sizes, 2)
    base = out.data_ptr()
    assert {(c[1], c[2] - base, c[3]) for c in calls if c[0] == "recv"} == {(0, 0, 18), (3, 8 * ROW, 12)}
    assert [c[2] for c in calls if c[0] == "send"] == [x.data_ptr()] * 3
    assert torch.equal(out[3:8], x) and not out[:3].any() and not out[8:].any()


def test_zero_row_rank_only_receives():
    calls, _, _ = _run([3, 0, 5, 2], 1)
    assert not [c for c in calls if c[0] == "send"]
    assert sorted(c[1] for c in calls if c[0] == "recv") == [0, 2, 3]


def test_in_place_input_is_sent_from_its_place_without_a_copy(monkeypatch):
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a: copies.append(1) or real_copy(self, src, *a))
    calls, x, out = _run([3, 0, 5, 2], 2, in_place=True)
    copies_in_place = len(copies)
    assert x.data_ptr() == out[3].data_ptr()
    assert [c[2] for c in calls if c[0] == "send"] == [out[3].data_ptr()] * 3
    _run([3, 0, 5, 2], 2)
    assert (copies_in_place, len(copies)) == (0, 1)  # out of place: exactly one local copy


def test_large_gathers_keep_one_broadcast_per_non_empty_root(monkeypatch):
    monkeypatch.setattr(nccl_backend, "SENDRECV_GATHERV_MAX_BYTES", 8 * ROW)
    sizes = [3, 0, 5, 2]  # 60 bytes gathered, over the lowered limit
    calls, x, out = _run(sizes, 2)
    base = out.data_ptr()
    bcasts = [c for c in calls if c[0] == "bcast"]
    assert [(root, dst - base, n) for _, root, _, dst, n in bcasts] == [(0, 0, 18), (2, 18, 30), (3, 48, 12)]
    assert [src for _, root, src, _, _ in bcasts if root == 2] == [x.data_ptr()]
    assert not [c for c in calls if c[0] in ("send", "recv")]
    assert not out.any()  # the root's broadcast writes its own rows on the GPU, not a host copy


@pytest.mark.parametrize("sizes", [[2, 2, 2, 2], [0, 0, 0, 0]])
def test_even_sizes_stay_one_all_gather(sizes, monkeypatch):
    seen = []
    monkeypatch.setattr(_RecordingLib, "ncclAllGather", lambda self, *a: seen.append(a) or 0, raising=False)
    calls, _, _ = _run(sizes, 1)
    assert not [c for c in calls if c[0] in ("send", "recv", "bcast")]
    assert len(seen) == 1 and seen[0][2] == sizes[1] * ROW
