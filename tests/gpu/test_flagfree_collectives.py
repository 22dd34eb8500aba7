"""custom-flagfree's all_gather and reduce_scatter on real ranks (run it at world 2, the size the
open issue measures): bitwise against NCCL for the gather, bitwise against the flag-free
all-reduce's chunk for the scatter, graph replay equal to eager, and auto picking them where the
world-2 tables say. At other world sizes they decline (custom_ar.FLAGFREE_COLLECTIVE_WORLDS), and
each test checks that instead.

Run: torchrun --nproc-per-node=2 -m pytest tests/gpu/test_flagfree_collectives.py
"""
from __future__ import annotations

import pytest
import torch

import symcomm
from symcomm import base
from symcomm.backends.custom_ar import FLAGFREE_COLLECTIVE_WORLDS
from symcomm.peer import context as peer_context
from _data import DTYPES, all_inputs, assert_reduced, rank_input

SLOT = peer_context.DEFAULT_FLAGFREE_BYTES
# One rank's chunk in bytes: one vector, an odd vector count, not a power of two, the whole slot.
CHUNKS = (16, 1008, 65_552, SLOT)


@pytest.fixture(scope="module")
def fast_comm(dist_env):
    """No check mode and no pool, as test_custom_ar.py's ``fast``: for the loops."""
    c = symcomm.Communicator(symmetric=False, check=False)
    yield c
    c.close()


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // (torch.finfo(dtype).bits // 8)


def _declined(c) -> bool:
    """Outside FLAGFREE_COLLECTIVE_WORLDS (world 2) both collectives decline when forced, with the
    reason, before any communication: checked here, and the caller's test then has nothing else
    to check at this world."""
    if c.world_size in FLAGFREE_COLLECTIVE_WORLDS:
        return False
    x = torch.ones(c.world_size * 8, dtype=torch.bfloat16, device="cuda")
    for op, t in (("all_gather", x[:8]), ("reduce_scatter", x)):
        with pytest.raises(symcomm.ArgumentError, match="world 2 only"):
            getattr(c, op)(t, algo=base.FLAGFREE)
    return True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_all_gather_is_bitwise_nccl(fast_comm, chunk, dtype):
    c = fast_comm
    if _declined(c):
        return
    x = rank_input(_numel(chunk, dtype), dtype, c.rank, seed=chunk % 1000 + 5)
    want = c.all_gather(x, algo="nccl")
    got = c.all_gather(x, algo=base.FLAGFREE)
    out = torch.empty_like(want)
    out[c.rank * x.numel():(c.rank + 1) * x.numel()] = x
    c.all_gather(out[c.rank * x.numel():(c.rank + 1) * x.numel()], out=out, algo=base.FLAGFREE)  # in place
    # Asserts only after every collective: a rank that stopped early would pair its peers'
    # next flag-free calls with the wrong ones (the protocol pairs calls by count).
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_reduce_scatter_is_the_flagfree_all_reduce_chunk(fast_comm, chunk, dtype):
    c = fast_comm
    if _declined(c):
        return
    w, rank = c.world_size, c.rank
    n = _numel(chunk, dtype)
    inputs = all_inputs(w * n, dtype, w, seed=chunk % 1000 + 11)
    x = inputs[rank]
    # One all-reduce per chunk: the whole input may exceed the all-reduce's capacity while a
    # chunk fits the receive slot, which is the reduce-scatter's limit.
    mine = [c.all_reduce(x[j * n:(j + 1) * n], algo=base.FLAGFREE) for j in range(w)][rank]
    got = c.reduce_scatter(x, algo=base.FLAGFREE)
    theirs = c.reduce_scatter(x, algo="nccl")
    y = x.clone()
    c.reduce_scatter(y, out=y[rank * n:(rank + 1) * n], algo=base.FLAGFREE)  # in place
    # Asserts only after every collective (see test_all_gather_is_bitwise_nccl). NCCL is held to
    # the float64 reference, not to this sum's bits: from world 4 it rounds partial sums in bf16.
    mine_chunk = [t[rank * n:(rank + 1) * n] for t in inputs]
    assert torch.equal(got.view(torch.uint8), mine.view(torch.uint8))
    assert_reduced(got, mine_chunk, f"reduce_scatter {dtype} {chunk} B")
    assert_reduced(theirs, mine_chunk, f"NCCL's reduce_scatter {dtype} {chunk} B")
    assert torch.equal(y[rank * n:(rank + 1) * n].view(torch.uint8), mine.view(torch.uint8))


@pytest.mark.parametrize("misaligned", ("x", "out", "both"))
def test_misaligned_views_are_copied_not_declined(fast_comm, misaligned):
    """Alignment is one rank's own: here only rank 0's views are 2 bytes off, and every rank
    must still take the flag-free path (a decline on rank 0 alone would leave its peer waiting)."""
    c = fast_comm
    if _declined(c):
        return
    w, rank, n = c.world_size, c.rank, 1024
    shift = {"x": (1, 0), "out": (0, 1), "both": (1, 1)}[misaligned] if rank == 0 else (0, 0)
    every = all_inputs(w * n, torch.bfloat16, w, seed=83)
    x_buf = torch.empty(w * n + 1, dtype=torch.bfloat16, device="cuda")
    x = x_buf[shift[0]:shift[0] + w * n]
    x.copy_(every[rank])
    gather_buf = torch.empty(w * n + 1, dtype=torch.bfloat16, device="cuda")
    gathered = gather_buf[shift[1]:shift[1] + w * n]
    scatter_buf = torch.empty(n + 1, dtype=torch.bfloat16, device="cuda")
    scattered = scatter_buf[shift[1]:shift[1] + n]
    c.all_gather(x[:n], out=gathered, algo=base.FLAGFREE)
    c.reduce_scatter(x, out=scattered, algo=base.FLAGFREE)
    want = c.all_gather(x[:n].clone(), algo="nccl")
    assert torch.equal(gathered.view(torch.uint8), want.view(torch.uint8))
    assert_reduced(scattered, [t[rank * n:(rank + 1) * n] for t in every], f"misaligned {misaligned}")


def test_empty(fast_comm):
    c = fast_comm
    if _declined(c):
        return
    x = torch.empty(0, dtype=torch.bfloat16, device="cuda")
    gathered, scattered = c.all_gather(x, algo=base.FLAGFREE), c.reduce_scatter(x, algo=base.FLAGFREE)
    # An empty call must take no turn of the protocol: the next call still pairs correctly.
    y = rank_input(8, torch.bfloat16, c.rank, seed=71)
    after, want = c.all_gather(y, algo=base.FLAGFREE), c.all_gather(y, algo="nccl")
    assert gathered.numel() == 0 and scattered.numel() == 0
    assert torch.equal(after.view(torch.uint8), want.view(torch.uint8))


def test_interleaved_with_the_all_reduce(fast_comm):
    """The three flag-free kernels share receive buffers: 300 calls of changing kernel and size,
    no synchronisation between them."""
    c = fast_comm
    if _declined(c):
        return
    w, rank = c.world_size, c.rank
    results = []
    for i in range(300):
        n = _numel(CHUNKS[i % len(CHUNKS)], torch.bfloat16)
        x = rank_input(w * n, torch.bfloat16, rank, seed=i % 7)  # every rank's is all_inputs(..., seed)[rank]
        kind = i % 3
        # The all-reduce takes one chunk: w chunks of the largest size exceed its capacity.
        got = (c.all_reduce(x[:n], algo=base.FLAGFREE) if kind == 0 else c.all_gather(x[:n], algo=base.FLAGFREE)
               if kind == 1 else c.reduce_scatter(x, algo=base.FLAGFREE))
        results.append((kind, x, n, got))
    gathered = [c.all_gather(x[:n], algo="nccl") if kind == 1 else None for kind, x, n, _ in results]
    # Asserts only after every collective (see test_all_gather_is_bitwise_nccl). Sums are held to
    # the float64 reference: from world 4 NCCL rounds partial sums in bf16, so its bits differ.
    for i, ((kind, x, n, got), want) in enumerate(zip(results, gathered)):
        if kind == 1:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"call {i}"
            continue
        every = all_inputs(w * n, torch.bfloat16, w, seed=i % 7)
        parts = [t[:n] for t in every] if kind == 0 else [t[rank * n:(rank + 1) * n] for t in every]
        assert_reduced(got, parts, f"call {i}, {('all_reduce', '', 'reduce_scatter')[kind]}")


@pytest.mark.parametrize("op", ("all_gather", "reduce_scatter"))
def test_graph_replay_equals_eager(fast_comm, op):
    c = fast_comm
    if _declined(c):
        return
    w, n = c.world_size, _numel(65_552, torch.bfloat16)
    x = rank_input(w * n if op == "reduce_scatter" else n, torch.bfloat16, c.rank, seed=23)
    run = getattr(c, op)
    eager = run(x, algo=base.FLAGFREE)
    out = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(x, out=out, algo=base.FLAGFREE)  # warm-up before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with c.graph_capture(), torch.cuda.graph(graph):
        run(x, out=out, algo=base.FLAGFREE)
    replays = []
    for _ in range(4):  # more than three replays: the receive buffers rotate
        out.fill_(float("nan"))
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    for i, got in enumerate(replays):  # after every replay (see test_all_gather_is_bitwise_nccl)
        assert torch.equal(got.view(torch.int16), eager.view(torch.int16)), f"replay {i}"


@pytest.mark.parametrize("op", ("all_gather", "reduce_scatter"))
def test_auto_picks_them_where_the_world_2_tables_do(fast_comm, op):
    """At world 2 both the built-in table and the shipped H200 table put custom-flagfree first
    to 1 MiB in all; above world 2 it declines these ops (the H200 world-4 table ranks it behind
    NCCL, so auto would not reach it anyway)."""
    c = fast_comm
    for nbytes in (1 << 10, 64 << 10, 1 << 20):
        n = _numel(nbytes // c.world_size, torch.bfloat16)
        x = torch.ones(c.world_size * n if op == "reduce_scatter" else n, dtype=torch.bfloat16, device="cuda")
        algo = c.select(op, x).algo
        assert (algo == base.FLAGFREE) == (c.world_size == 2), f"{op} of {nbytes} B at world {c.world_size}: {algo}"
