"""custom-flagfree's all_gather(v) and reduce_scatter(v) on real ranks (run it at world 2, the
size the open issue measures): bitwise against NCCL for the gathers, bitwise against the
flag-free all-reduce's chunk for the scatters, graph replay equal to eager, and auto picking them
where the world-2 tables say. At other world sizes they decline
(custom_ar.FLAGFREE_COLLECTIVE_WORLDS), and each test checks that instead.

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

SLOT = peer_context.default_flagfree_bytes(2)  # these kernels serve world 2 only
# One rank's chunk in bytes: one vector, an odd vector count, not a power of two (these three on
# the narrow grid), one vector past 256 KiB (the middle grid), one past 1 MiB and the whole slot
# (the widest grid; csrc/peer.cuh's flagfree_grid).
CHUNKS = (16, 1008, 65_552, 262_160, 1_048_592, SLOT)


@pytest.fixture(scope="module")
def fast_comm(dist_env):
    """No check mode and no pool, as test_custom_ar.py's ``fast``: for the loops."""
    c = symcomm.Communicator(symmetric=False, check=False)
    yield c
    c.close()


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // (torch.finfo(dtype).bits // 8)


def _graph_replays(c, launch, out: torch.Tensor) -> list[torch.Tensor]:
    """``launch(out)`` once eagerly on a side stream (the warm-up before capture), captured in
    a graph inside graph_capture(), then replayed four times, more than the three receive
    buffers rotate through: each replay's output, copied, after a synchronisation."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with c.graph_capture(), torch.cuda.graph(graph):
        launch(out)
    replays = []
    for _ in range(4):
        out.fill_(float("nan"))
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return replays


def _declined(c) -> bool:
    """Outside FLAGFREE_COLLECTIVE_WORLDS (world 2) both collectives decline when forced, with the
    reason, before any communication: checked here, and the caller's test then has nothing else
    to check at this world."""
    if c.world_size in FLAGFREE_COLLECTIVE_WORLDS:
        return False
    x = torch.ones(c.world_size * 8, dtype=torch.bfloat16, device="cuda")
    sizes = [8] * c.world_size
    for run in (lambda: c.all_gather(x[:8], algo=base.FLAGFREE), lambda: c.reduce_scatter(x, algo=base.FLAGFREE),
                lambda: c.all_gatherv(x[:8], sizes, algo=base.FLAGFREE),
                lambda: c.reduce_scatterv(x, sizes, algo=base.FLAGFREE)):
        with pytest.raises(symcomm.ArgumentError, match="world 2 only"):
            run()
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
    replays = _graph_replays(c, lambda out: run(x, out=out, algo=base.FLAGFREE), torch.empty_like(eager))
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


@pytest.mark.parametrize("op", ("all_gatherv", "reduce_scatterv"))
def test_auto_picks_them_for_uneven_calls_at_world_2(fast_comm, op):
    """The uneven calls too: the shipped H200 world-2 table ranks custom-flagfree first to 8 MiB,
    and the built-in table (other GPUs) takes the even ops' rows, first to 1 MiB."""
    c = fast_comm
    for rows in (1, 8, 24):  # of 7168 bf16 per rank r: (r + 1) * rows, under 1 MiB in all at world 2
        sizes = [(r + 1) * rows for r in range(c.world_size)]
        x = torch.ones(sizes[c.rank] if op == "all_gatherv" else sum(sizes), 7168, dtype=torch.bfloat16,
                       device="cuda")
        algo = c.select(op, x, sizes).algo
        assert (algo == base.FLAGFREE) == (c.world_size == 2), f"{op} of {sizes} rows at world {c.world_size}: {algo}"


# Rows per rank (world 2 uses the first two, larger worlds repeat them): a rank with none, a
# single row, odd counts, a rank holding a whole receive slot beside a small one. Rows of 7168
# bf16 (one token of hidden 7168, 14 KiB) and of 8 values (16 bytes).
UNEVEN = ((0, 3), (1, 70), (45, 2), (146, 1))


def _sizes(c, pattern, row_bytes):
    sizes = [pattern[r % len(pattern)] for r in range(c.world_size)]
    return [min(n, SLOT // row_bytes) for n in sizes]  # every chunk fits one receive slot


@pytest.mark.parametrize("width", (8, 7168))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_all_gatherv_is_bitwise_nccl(fast_comm, pattern, dtype, width):
    c = fast_comm
    if _declined(c):
        return
    rank = c.rank
    sizes = _sizes(c, pattern, width * torch.finfo(dtype).bits // 8)
    x = rank_input((sizes[rank], width), dtype, rank, seed=sum(sizes) % 997 + 3)
    want = c.all_gatherv(x, sizes, algo="nccl")
    got = c.all_gatherv(x, sizes, algo=base.FLAGFREE)
    out = torch.empty_like(want)
    first = sum(sizes[:rank])
    mine = out[first:first + sizes[rank]]
    mine.copy_(x)
    c.all_gatherv(mine, sizes, out=out, algo=base.FLAGFREE)  # in place
    # Asserts only after every collective (see test_all_gather_is_bitwise_nccl).
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), sizes
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), sizes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_reduce_scatterv_is_the_flagfree_all_reduce_segment(fast_comm, pattern, dtype):
    c = fast_comm
    if _declined(c):
        return
    w, rank, width = c.world_size, c.rank, 7168
    sizes = _sizes(c, pattern, width * torch.finfo(dtype).bits // 8)
    total, first = sum(sizes), sum(sizes[:rank])
    inputs = all_inputs((total, width), dtype, w, seed=total % 991 + 17)
    x = inputs[rank]
    # Every segment through the flag-free all-reduce, in rank order on every rank (each fits it).
    starts = [sum(sizes[:j]) for j in range(w)]
    mine = [c.all_reduce(x[starts[j]:starts[j] + sizes[j]], algo=base.FLAGFREE) if sizes[j] else None
            for j in range(w)][rank]
    got = c.reduce_scatterv(x, sizes, algo=base.FLAGFREE)
    theirs = c.reduce_scatterv(x, sizes, algo="nccl")
    y = x.clone()
    c.reduce_scatterv(y, sizes, out=y[first:first + sizes[rank]], algo=base.FLAGFREE)  # in place
    # Asserts only after every collective (see test_all_gather_is_bitwise_nccl).
    assert got.shape == (sizes[rank], width)
    if sizes[rank]:
        parts = [t[first:first + sizes[rank]] for t in inputs]
        assert torch.equal(got.view(torch.uint8), mine.view(torch.uint8)), sizes
        assert torch.equal(y[first:first + sizes[rank]].view(torch.uint8), mine.view(torch.uint8)), sizes
        assert_reduced(got, parts, f"reduce_scatterv {dtype} {sizes}")
        assert_reduced(theirs, parts, f"NCCL's reduce_scatterv {dtype} {sizes}")


@pytest.mark.parametrize("op", ("all_gatherv", "reduce_scatterv"))
def test_uneven_graph_replay_equals_eager(fast_comm, op):
    c = fast_comm
    if _declined(c):
        return
    sizes = _sizes(c, (5, 77), 7168 * 2)
    rows = sizes[c.rank] if op == "all_gatherv" else sum(sizes)
    x = rank_input((rows, 7168), torch.bfloat16, c.rank, seed=29)
    run = getattr(c, op)
    eager = run(x, sizes, algo=base.FLAGFREE)
    replays = _graph_replays(c, lambda out: run(x, sizes, out=out, algo=base.FLAGFREE), torch.empty_like(eager))
    for i, got in enumerate(replays):
        assert torch.equal(got.view(torch.int16), eager.view(torch.int16)), f"replay {i}"


def test_uneven_calls_between_even_ones(fast_comm):
    """Uneven gathers and scatters leave receive-buffer slots of different lengths; 120 calls of
    the five flag-free collectives, no synchronisation between them."""
    c = fast_comm
    if _declined(c):
        return
    w, rank, width = c.world_size, c.rank, 7168
    results = []
    for i in range(120):
        sizes = _sizes(c, UNEVEN[i % len(UNEVEN)], width * 2)
        total, first = sum(sizes), sum(sizes[:rank])
        kind = i % 5
        every = all_inputs((max(total, 1), width), torch.bfloat16, w, seed=i % 11)
        x = every[rank]
        if kind == 0:
            got = c.all_reduce(x[:1], algo=base.FLAGFREE)
        elif kind == 1:
            got = c.all_gather(x[:1], algo=base.FLAGFREE)
        elif kind == 2:
            got = c.reduce_scatter(x[:w], algo=base.FLAGFREE)
        elif kind == 3:
            got = c.all_gatherv(x[first:first + sizes[rank]], sizes, algo=base.FLAGFREE)
        else:
            got = c.reduce_scatterv(x[:total], sizes, algo=base.FLAGFREE)
        results.append((kind, sizes, every, got))
    # Asserts only after every collective (see test_all_gather_is_bitwise_nccl).
    for i, (kind, sizes, every, got) in enumerate(results):
        total, first = sum(sizes), sum(sizes[:rank])
        if kind == 0:
            assert_reduced(got, [t[:1] for t in every], f"call {i} all_reduce")
        elif kind == 1:
            assert torch.equal(got, torch.cat([t[:1] for t in every])), f"call {i} all_gather"
        elif kind == 2:
            assert_reduced(got, [t[rank:rank + 1] for t in every], f"call {i} reduce_scatter")
        elif kind == 3:
            want = torch.cat([t[sum(sizes[:r]):sum(sizes[:r]) + sizes[r]] for r, t in enumerate(every)])
            assert torch.equal(got, want), f"call {i} all_gatherv {sizes}"
        elif sizes[rank]:
            assert_reduced(got, [t[first:first + sizes[rank]] for t in every], f"call {i} reduce_scatterv {sizes}")


@pytest.mark.parametrize("op", ("max", "min", "avg"))
def test_non_sum_reduce_scatters_do_not_take_the_summing_kernel(fast_comm, op):
    """The flag-free kernel only sums: a reduce_scatter(v) with another reduction, at a size its
    table row ranks it first, must go elsewhere and still be right (reduce_scatterv once took
    it and summed)."""
    c = fast_comm
    w, rank = c.world_size, c.rank
    sizes = [(r + 1) * 2 for r in range(w)]
    total, first = sum(sizes), sum(sizes[:rank])
    every = all_inputs((total, 64), torch.float32, w, seed=41)
    x = every[rank]
    for name, run, rows in (("reduce_scatterv", lambda: c.reduce_scatterv(x, sizes, op=op), slice(first, first + sizes[rank])),
                            ("reduce_scatter", lambda: c.reduce_scatter(x[:w * 2], op=op), slice(rank * 2, rank * 2 + 2))):
        args = (x, sizes) if name == "reduce_scatterv" else (x[:w * 2],)
        if w in FLAGFREE_COLLECTIVE_WORLDS:  # the sum of the same call does take the kernel
            assert c.select(name, *args).algo == base.FLAGFREE, name
        assert c.select(name, *args, op=op).algo != base.FLAGFREE
        got = run()
        stacked = torch.stack([t[:total if name == "reduce_scatterv" else w * 2][rows] for t in every])
        want = {"max": stacked.amax(0), "min": stacked.amin(0), "avg": stacked.mean(0)}[op]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{name} op={op}")
