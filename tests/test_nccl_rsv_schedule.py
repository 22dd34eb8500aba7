"""The NCCL backend's uneven reduce_scatterv schedules, on CPU with a library that plays NCCL.

Each simulated rank runs the backend's private method in a thread of its own against one
shared fake library. The fake records every rank's calls and, at each ncclGroupEnd (or an
ungrouped collective), waits for all ranks and then moves bytes between their CPU tensors by
pointer as NCCL would: sends into the matching receives, ncclReduce / ncclReduceScatter as a
float64 reduction rounded once. So a test sees both the schedule (peers, offsets, byte counts)
and the output it produces. torch.empty is poisoned for every test (NaN, or 0x7F bytes), so
a temporary row that is read before it is written, or padding that reaches the output, shows.
"""
from __future__ import annotations

import ctypes
import math
import threading

import pytest
import torch

from symcomm import _nccl
from symcomm.operations import collectives
from symcomm.backends import nccl as nccl_backend
from symcomm.backends import nccl_schedules
from symcomm.backends.nccl_schedules import (RSV_PADDED, RSV_REDUCE_PER_ROOT, RSV_SCHEDULES, RSV_SEND_RECV, RsvRule,
                                             rsv_schedule)
from symcomm.errors import ArgumentError

CPU = torch.device("cpu")
SIZES = [3, 0, 5, 2]
_TORCH_DTYPES = {code: dtype for dtype, code in _nccl.DTYPES.items()}
# ncclRedOp_t -> reduction over the stacked ranks (dim 0), in float64
_REDUCE = {0: lambda t: t.sum(0), 1: lambda t: t.prod(0), 2: lambda t: t.amax(0), 3: lambda t: t.amin(0),
           4: lambda t: t.mean(0)}
_REAL_EMPTY = torch.empty


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    def empty(*args, **kwargs):
        t = _REAL_EMPTY(*args, **kwargs)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t.view(torch.uint8).fill_(0x7F).view(t.dtype)
    monkeypatch.setattr(torch, "empty", empty)


def _bytes_at(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of CPU memory at ``ptr``."""
    if not nbytes:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)


def _at(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return _bytes_at(ptr, count * dtype.itemsize).view(dtype)


class _World:
    """The NCCL all ranks share: posted operations, matched and executed at group end."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.calls: list[list[tuple]] = [[] for _ in range(n)]
        self.posted: list[list[tuple]] = [[] for _ in range(n)]
        self.rs_results: dict[int, torch.Tensor] = {}  # rank -> its last ReduceScatter result

    def flush(self, rank: int, ops: list[tuple]) -> None:
        self.posted[rank] = ops
        self.barrier.wait()
        writes = self._results(rank)  # every rank reads before any rank writes
        self.barrier.wait()
        for ptr, data in writes:
            _bytes_at(ptr, data.numel()).copy_(data)
        self.barrier.wait()

    def _results(self, me: int) -> list[tuple[int, torch.Tensor]]:
        writes = []
        to_me = {peer: [op for op in self.posted[peer] if op[0] == "send" and op[1] == me] for peer in range(self.n)}
        for op in self.posted[me]:
            if op[0] == "recv":
                _, peer, ptr, nbytes = op
                assert to_me[peer], f"rank {me} receives from {peer}, which sends it nothing"
                send = to_me[peer].pop(0)
                assert send[3] == nbytes, f"{peer} -> {me}: {send[3]} bytes sent, {nbytes} received"
                writes.append((ptr, _bytes_at(send[2], nbytes).clone()))
        assert not any(to_me.values()), f"sends to rank {me} that it never receives: {to_me}"
        colls = [[op for op in ops if op[0] in ("reduce", "rs")] for ops in self.posted]
        assert len({len(c) for c in colls}) == 1, f"ranks enqueue different collectives: {colls}"
        for k, op in enumerate(colls[me]):
            peers = [c[k] for c in colls]
            shape = {(p[0], *p[4:]) for p in peers}  # kind, count, dtype, op (, root)
            assert len(shape) == 1, f"collective {k} differs between ranks: {peers}"
            count, dtype, redop = op[4], _TORCH_DTYPES[op[5]], op[6]
            if op[0] == "reduce":
                if op[7] == me:
                    parts = torch.stack([_at(p[2], count, dtype).double() for p in peers])
                    writes.append((op[3], _REDUCE[redop](parts).to(dtype).view(torch.uint8)))
            else:
                parts = torch.stack([_at(p[2] + me * count * dtype.itemsize, count, dtype).double() for p in peers])
                result = _REDUCE[redop](parts).to(dtype)
                self.rs_results[me] = result
                writes.append((op[3], result.view(torch.uint8)))
        return writes


class _RankLib:
    """One rank's libnccl: records, and hands each group to the world when it ends."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.depth, self.pending = world, rank, 0, []
        self.calls = world.calls[rank]

    def _post(self, op: tuple) -> int:
        self.calls.append(op)
        self.pending.append(op)
        if not self.depth:
            self._flush()
        return 0

    def _flush(self) -> None:
        ops, self.pending = self.pending, []
        self.world.flush(self.rank, ops)

    def ncclGroupStart(self):
        self.calls.append(("group",))
        self.depth += 1
        return 0

    def ncclGroupEnd(self):
        self.calls.append(("end",))
        self.depth -= 1
        if not self.depth:
            self._flush()
        return 0

    def ncclSend(self, buf, nbytes, dtype, peer, comm, stream):
        return self._post(("send", peer, buf, nbytes))

    def ncclRecv(self, buf, nbytes, dtype, peer, comm, stream):
        return self._post(("recv", peer, buf, nbytes))

    def ncclReduce(self, src, dst, count, dtype, op, root, comm, stream):
        return self._post(("reduce", None, src, dst, count, dtype, op, root))

    def ncclReduceScatter(self, src, dst, count, dtype, op, comm, stream):
        return self._post(("rs", None, src, dst, count, dtype, op))


def _inputs(sizes, dtype, row, seed=0):
    total = sum(sizes)
    gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(len(sizes))]
    return [(torch.randn(total, *row, generator=g, dtype=torch.float64) + 0.25).to(dtype) for g in gens]


def _poison(shape, dtype):
    return torch.full(shape, math.nan if dtype.is_floating_point else -7, dtype=dtype)


def _run_world(sizes, schedule, dtype=torch.bfloat16, row=(7,), redop="sum", in_place=False, inputs=None):
    """Every rank's reduce_scatterv through the backend: (world, [(x, out) per rank])."""
    n = len(sizes)
    inputs = inputs if inputs is not None else _inputs(sizes, dtype, row)
    world, results, errors = _World(n), [None] * n, []

    def rank_main(rank):
        try:
            backend = nccl_backend.NcclPath()
            backend.attach(_nccl.Library(_RankLib(world, rank), "/fake", "test", (2, 28, 9)), 1, rank, CPU)
            backend.force_rsv_schedule(schedule)
            x = inputs[rank].clone()
            start = sum(sizes[:rank])
            out = x.narrow(0, start, sizes[rank]) if in_place else _poison((sizes[rank], *x.shape[1:]), dtype)
            call = collectives.reduce_scatterv_call(x, sizes, out, redop, rank, n, CPU)
            backend._reduce_scatterv(call, 1, 0)
            results[rank] = (x, out)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return world, results


def _reference(inputs, sizes, rank):
    start = sum(sizes[:rank])
    parts = torch.stack([x[start:start + sizes[rank]].double() for x in inputs])
    return parts.sum(0), parts.abs().sum(0)


def _schedule_of(calls):
    kinds = {c[0] for c in calls} - {"group", "end"}
    return {frozenset({"reduce"}): RSV_REDUCE_PER_ROOT, frozenset({"rs"}): RSV_PADDED,
            frozenset({"send", "recv"}): RSV_SEND_RECV, frozenset({"send"}): RSV_SEND_RECV}[frozenset(kinds)]


def _row_bytes(dtype, row):
    return dtype.itemsize * math.prod(row)


# -- the schedules' calls -----------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [SIZES, [0, 4, 0, 1, 2], [2, 5], [1, 1, 1, 0]])
def test_send_recv_every_send_has_one_matching_receive(sizes):
    world, _ = _run_world(sizes, RSV_SEND_RECV)
    rb = _row_bytes(torch.bfloat16, (7,))
    sends = [(r, c[1], c[3]) for r, calls in enumerate(world.calls) for c in calls if c[0] == "send"]
    recvs = [(c[1], r, c[3]) for r, calls in enumerate(world.calls) for c in calls if c[0] == "recv"]
    assert sorted(sends) == sorted(recvs)  # (from, to, bytes): each send has exactly one receive
    assert len(set(sends)) == len(sends)
    n = len(sizes)
    assert set(sends) == {(s, d, sizes[d] * rb) for s in range(n) for d in range(n) if s != d and sizes[d]}
    assert all(calls[0] == ("group",) and calls[-1] == ("end",) for calls in world.calls)


def test_send_recv_offsets_and_receive_slots():
    sizes, rb = SIZES, _row_bytes(torch.bfloat16, (7,))
    world, results = _run_world(sizes, RSV_SEND_RECV)
    x, out = results[2]
    calls = world.calls[2]
    starts = [sum(sizes[:r]) for r in range(4)]
    # rank 2 sends root 0 its rows 0..2 and root 3 its rows 8..9; zero-row root 1 gets nothing
    assert {(c[1], c[2] - x.data_ptr(), c[3]) for c in calls if c[0] == "send"} == {
        (0, starts[0] * rb, 3 * rb), (3, starts[3] * rb, 2 * rb)}
    recvs = sorted((c[2], c[1], c[3]) for c in calls if c[0] == "recv")
    assert [peer for _, peer, _ in recvs] == [0, 1, 3]  # every peer, in rank order, into its own slot
    assert [ptr - recvs[0][0] for ptr, _, _ in recvs] == [0, 5 * rb, 10 * rb]
    assert all(n == 5 * rb for _, _, n in recvs)
    lo, hi = x.data_ptr(), x.data_ptr() + x.nbytes
    assert all(not lo <= ptr < hi for ptr, _, _ in recvs)  # never into the input


def test_send_recv_zero_row_rank_only_sends():
    world, results = _run_world(SIZES, RSV_SEND_RECV)
    calls = world.calls[1]
    assert not [c for c in calls if c[0] == "recv"]
    assert sorted(c[1] for c in calls if c[0] == "send") == [0, 2, 3]
    assert results[1][1].shape == (0, 7)


@pytest.mark.parametrize("sizes", [SIZES, [0, 4, 0, 1, 2]])
def test_reduce_per_root_one_reduce_per_non_empty_root(sizes):
    row = (7,)
    world, results = _run_world(sizes, RSV_REDUCE_PER_ROOT, row=row)
    rb, elems = _row_bytes(torch.bfloat16, row), math.prod(row)
    roots = [r for r, rows in enumerate(sizes) if rows]
    for rank, calls in enumerate(world.calls):
        x, out = results[rank]
        reduces = [c for c in calls if c[0] == "reduce"]
        assert [c[7] for c in reduces] == roots
        assert [c[4] for c in reduces] == [sizes[r] * elems for r in roots]
        assert [c[2] - x.data_ptr() for c in reduces] == [sum(sizes[:r]) * rb for r in roots]
        assert [c[3] for c in reduces if c[7] == rank] == ([out.data_ptr()] if sizes[rank] else [])
        assert not [c for c in calls if c[0] in ("send", "recv", "rs")]


@pytest.mark.parametrize("sizes", [SIZES, [0, 4, 0, 1, 2], [2, 5]])
def test_padded_one_reduce_scatter_of_max_rows_on_every_rank(sizes):
    row = (7,)
    world, results = _run_world(sizes, RSV_PADDED, row=row)
    for rank, calls in enumerate(world.calls):
        rs = [c for c in calls if c[0] == "rs"]
        assert len(rs) == 1 and rs[0][4] == max(sizes) * math.prod(row)
        assert rs[0][5] == _nccl.BFLOAT16 and rs[0][6] == _nccl.REDUCE_OPS["sum"]
        # straight into out where this rank has the longest slice, else into a temporary
        assert (rs[0][3] == results[rank][1].data_ptr()) == (sizes[rank] == max(sizes))
        assert not [c for c in calls if c[0] in ("send", "recv", "reduce")]


# -- what they compute --------------------------------------------------------------------------
CASES = [
    (SIZES, torch.bfloat16, (7,)),  # 14-byte rows: not a multiple of 16 bytes
    ([0, 4, 0, 1, 2], torch.bfloat16, (3,)),
    ([2, 5], torch.float16, (5,)),
    ([1, 3, 2], torch.float32, (2, 3)),
    (SIZES, torch.float64, (1,)),
]


@pytest.mark.parametrize("schedule", RSV_SCHEDULES)
@pytest.mark.parametrize("sizes,dtype,row", CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_output_matches_float64_reference(schedule, sizes, dtype, row, in_place):
    inputs = _inputs(sizes, dtype, row, seed=len(sizes))
    _, results = _run_world(sizes, schedule, dtype, row, in_place=in_place, inputs=inputs)
    eps = torch.finfo(dtype).eps
    for rank, (_, out) in enumerate(results):
        ref, abs_sum = _reference(inputs, sizes, rank)
        assert out.shape == (sizes[rank], *row) and out.dtype == dtype
        # one rounding to the dtype, after a sum whose error the fp32 accumulator bounds
        bound = ref.abs() * eps / 2 + abs_sum * len(sizes) * 2.0 ** -24
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), f"rank {rank}: max error {err.max()} (NaN: padding or an unset row)"


def test_send_recv_sums_in_fp32_then_rounds_once():
    # bf16 steps would give 256 + 1 -> 256, + 1 -> 256, - 256 -> 0; in fp32 the sum is exact.
    sizes = [2, 1, 3, 1]
    inputs = [torch.full((7, 4), v, dtype=torch.bfloat16) for v in (256.0, 1.0, 1.0, -256.0)]
    _, results = _run_world(sizes, RSV_SEND_RECV, inputs=inputs)
    for _, out in results:
        assert torch.equal(out, torch.full_like(out, 2.0))


def test_send_recv_sums_in_rank_order():
    # fp32, rank order: 2^24 + 1 -> 2^24 (ties to even), - 2^24 -> 0, + 1 -> 1; any order that
    # adds a 1 before the 2^24 terms cancel gives 2. The documented order is 0..world-1.
    big = float(2 ** 24)
    inputs = [torch.full((4, 2), v, dtype=torch.float32) for v in (big, 1.0, -big, 1.0)]
    _, results = _run_world([2, 0, 1, 1], RSV_SEND_RECV, torch.float32, (2,), inputs=inputs)
    for _, out in results:
        assert torch.equal(out, torch.ones_like(out))


def test_padding_is_reduced_but_never_reaches_out():
    sizes, row = SIZES, (7,)
    inputs = _inputs(sizes, torch.bfloat16, row)
    world, results = _run_world(sizes, RSV_PADDED, inputs=inputs)
    max_rows = max(sizes)
    for rank, (_, out) in enumerate(results):
        if sizes[rank] < max_rows:
            reduced = world.rs_results[rank].view(max_rows, *row)
            assert reduced[sizes[rank]:].isnan().all()  # the (poisoned) padding rows were reduced
            assert not reduced[:sizes[rank]].isnan().any()
        assert not out.isnan().any()
        ref, _ = _reference(inputs, sizes, rank)
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=0)


# -- which schedule ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [3, 4, 8])
def test_unmeasured_worlds_keep_reduce_per_root_for_every_call(world):
    for sizes in ([1] + [0] * (world - 1), list(range(world)), [5] * (world - 1) + [4], [10 ** 6] + [1] * (world - 1)):
        for row_bytes in (2, 14, 14336, 1 << 20):
            for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn):
                for redop in ("sum", "avg", "max", "min", "prod"):
                    assert rsv_schedule(sizes, row_bytes, world, dtype, redop) == RSV_REDUCE_PER_ROOT


@pytest.mark.parametrize("sizes, row_bytes, want", [
    ([20, 11], 14336, RSV_PADDED),             # the measured split (padding 1.29), 434 KiB
    ([188, 104], 14336, RSV_PADDED),           # 4 MiB - 8 KiB: the largest size measured to win
    ([755, 415], 14336, RSV_REDUCE_PER_ROOT),  # 16 MiB: padded measured 0.73x
    ([20, 5], 14336, RSV_REDUCE_PER_ROOT),     # padding 1.6: not measured
    ([1, 0], 14, RSV_REDUCE_PER_ROOT),         # padding 2
])
def test_world_two_pads_where_it_was_measured_to_win(sizes, row_bytes, want):
    for dtype in (torch.bfloat16, torch.int32):
        assert rsv_schedule(sizes, row_bytes, 2, dtype, "max") == want


def test_default_backend_runs_reduce_per_root():
    world, _ = _run_world(SIZES, None)
    assert [_schedule_of(calls) for calls in world.calls] == [RSV_REDUCE_PER_ROOT] * 4


@pytest.mark.parametrize("schedule", RSV_SCHEDULES)
def test_forcing_runs_that_schedule_on_every_rank(schedule):
    world, _ = _run_world(SIZES, schedule)
    assert [_schedule_of(calls) for calls in world.calls] == [schedule] * 4


def test_force_rejects_unknown_names_and_none_restores_the_rules():
    backend = nccl_backend.NcclPath()
    with pytest.raises(ArgumentError, match="schedule must be one of"):
        backend.force_rsv_schedule("ring")
    backend.force_rsv_schedule(RSV_PADDED)
    assert backend.rsv_forced == RSV_PADDED
    backend.force_rsv_schedule(None)
    assert backend.rsv_forced is None
    assert nccl_backend.NcclPath().rsv_forced is None  # per instance, not a module switch


@pytest.mark.parametrize("dtype,redop", [(torch.bfloat16, "max"), (torch.bfloat16, "avg"), (torch.int32, "sum"),
                                         (torch.float32, "prod")])
def test_send_recv_falls_back_off_a_float_sum(dtype, redop):
    inputs = _inputs(SIZES, dtype, (3,)) if dtype.is_floating_point else [
        torch.randint(-50, 50, (10, 3), dtype=dtype, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    world, results = _run_world(SIZES, RSV_SEND_RECV, dtype, (3,), redop=redop, inputs=inputs)
    assert [_schedule_of(calls) for calls in world.calls] == [RSV_REDUCE_PER_ROOT] * 4
    reduce = {"max": lambda t: t.amax(0), "avg": lambda t: t.mean(0), "sum": lambda t: t.sum(0),
              "prod": lambda t: t.prod(0)}[redop]
    for rank, (_, out) in enumerate(results):
        start = sum(SIZES[:rank])
        want = reduce(torch.stack([x[start:start + SIZES[rank]].double() for x in inputs])).to(dtype)
        assert torch.equal(out, want)


def test_send_recv_is_not_eligible_for_fp8():
    assert rsv_schedule(SIZES, 7, 4, torch.float8_e4m3fn, "sum", RSV_SEND_RECV) == RSV_REDUCE_PER_ROOT
    assert rsv_schedule(SIZES, 7, 4, torch.float8_e4m3fn, "sum", RSV_PADDED) == RSV_PADDED


def test_rules_pick_by_bytes_and_padding_and_skip_ineligible(monkeypatch):
    monkeypatch.setattr(nccl_schedules, "RSV_SCHEDULE_RULES", {4: (
        RsvRule(max_bytes=1000, max_padding=math.inf, schedule=RSV_SEND_RECV),
        RsvRule(max_bytes=10 ** 6, max_padding=1.5, schedule=RSV_PADDED),
    )})
    bf16 = torch.bfloat16
    assert rsv_schedule(SIZES, 100, 4, bf16, "sum") == RSV_SEND_RECV  # 1000 input bytes
    assert rsv_schedule(SIZES, 101, 4, bf16, "sum") == RSV_REDUCE_PER_ROOT  # padding 2.0 > 1.5
    assert rsv_schedule([3, 4, 3, 2], 101, 4, bf16, "sum") == RSV_PADDED  # padding 16/12
    assert rsv_schedule([3, 4, 3, 2], 10 ** 5, 4, bf16, "sum") == RSV_REDUCE_PER_ROOT  # over 10^6 bytes
    assert rsv_schedule([3, 4, 3, 2], 10, 4, bf16, "max") == RSV_PADDED  # send-recv skipped: max
    assert rsv_schedule([3, 4], 10, 2, bf16, "sum") == RSV_REDUCE_PER_ROOT  # world 2 has no rules
    assert rsv_schedule([3, 4, 3, 2], 10, 4, bf16, "sum", RSV_REDUCE_PER_ROOT) == RSV_REDUCE_PER_ROOT  # forced


def test_rules_choose_the_same_schedule_on_every_rank(monkeypatch):
    # Limits between the ranks' own output sizes (0 to 5 rows of 14 bytes) and the input's 140
    # bytes: a choice read from this rank's slice, not the call, would split the ranks here.
    monkeypatch.setattr(nccl_schedules, "RSV_SCHEDULE_RULES", {4: (
        RsvRule(max_bytes=50, max_padding=math.inf, schedule=RSV_SEND_RECV),
        RsvRule(max_bytes=200, max_padding=math.inf, schedule=RSV_PADDED),
    )})
    world, _ = _run_world(SIZES, None)
    assert [_schedule_of(calls) for calls in world.calls] == [RSV_PADDED] * 4
    world, _ = _run_world(SIZES, None, redop="max")
    assert [_schedule_of(calls) for calls in world.calls] == [RSV_PADDED] * 4


@pytest.mark.parametrize("sizes", [[2, 2, 2, 2], [0, 0, 0, 0]])
@pytest.mark.parametrize("schedule", RSV_SCHEDULES)
def test_even_sizes_stay_one_reduce_scatter_whatever_is_forced(sizes, schedule):
    world, _ = _run_world(sizes, schedule, row=(7,))
    for calls in world.calls:
        assert [c[0] for c in calls] == ["rs"] and calls[0][4] == sizes[0] * 7
