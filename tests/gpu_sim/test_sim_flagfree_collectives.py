"""The flag-free all-gather(v) and reduce-scatter(v) (csrc/custom_ar.cu, flag_free_gather and
flag_free_scatter) with W simulated ranks on ONE GPU (tests/gpu_sim/_sim.py).

What this proves: their slot indexing, uneven chunks (a rank with none, one with a whole
receive slot), the sentinel swap, and that they share the flag-free all-reduce's receive
buffers, turn and clear without corrupting one another when calls of the three kernels and of
different sizes follow each other without a host synchronisation. Not NVLink behaviour or
timing.
"""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from _sim import DTYPES, FLAGFREE_BYTES, LATE_CYCLES, SimWorld, _bits, check_outputs, make_inputs
from symcomm import _native
from symcomm.base import FLAGFREE

WORLDS = (2, 4, 8)
# One rank's chunk in bytes: empty, one vector, an odd vector count, two pages and a vector,
# the whole receive slot.
CHUNKS = (0, 16, 1008, 4096 * 2 + 16, FLAGFREE_BYTES)
GATHER, SCATTER = "symcomm_ar_flagfree_all_gatherv", "symcomm_ar_flagfree_reduce_scatterv"
SENTINEL, NOT_SENTINEL = -1, 0x7FFF7FFF  # csrc/peer.cuh's kSentinel / kNotSentinel as int32 words


def chunk_array(world: int, chunk_bytes) -> ctypes.Array:
    """The entry points' per-rank chunk sizes: one int (every rank alike) or a list."""
    sizes = [chunk_bytes] * world if isinstance(chunk_bytes, int) else list(chunk_bytes)
    return (ctypes.c_uint64 * world)(*sizes)


def launch(sim: SimWorld, fn: str, dtype: torch.dtype, inputs, outputs, chunk_bytes) -> None:
    """One collective on every simulated rank, each on its own stream, ordered after the
    current stream and before what follows on it (as SimWorld.launch does for all-reduce).
    ``chunk_bytes``: every rank's chunk, or one size for all."""
    here = torch.cuda.current_stream()
    sizes = chunk_array(sim.world, chunk_bytes)
    for r in range(sim.world):
        stream = sim.streams[r]
        stream.wait_stream(here)
        code = getattr(sim.lib, fn)(sim.ctxs[r], _native.DTYPE_CODES[dtype], inputs[r].data_ptr(),
                                    outputs[r].data_ptr(), sizes, stream.cuda_stream)
        _native.check(sim.lib, f"{fn}(rank {r})", code)
    for r in range(sim.world):
        here.wait_stream(sim.streams[r])


def all_reduce(sim: SimWorld, dtype: torch.dtype, inputs) -> list[torch.Tensor]:
    outputs = [torch.full_like(t, 7.0) for t in inputs]
    sim.launch(FLAGFREE, dtype, inputs, outputs)
    return outputs


def words(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def sent(x: torch.Tensor) -> torch.Tensor:
    """The words a flag-free writer sends for x: the sentinel swapped for another NaN."""
    w = words(x).clone()
    w[w == SENTINEL] = NOT_SENTINEL
    return w


def check_gather(outputs, inputs, what: str) -> None:
    want = torch.cat([sent(x) for x in inputs])
    for r, out in enumerate(outputs):
        differ = (words(out) != want).nonzero().flatten()
        assert differ.numel() == 0, f"{what}: rank {r} differs at words {differ[:8].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_is_the_rank_order_concatenation(world, dtype):
    gen = torch.Generator().manual_seed(world * 10 + DTYPES.index(dtype))
    with SimWorld(world) as sim:
        for chunk in CHUNKS:
            x = make_inputs(world, chunk, dtype, gen) if chunk else [
                torch.empty(0, dtype=dtype, device="cuda") for _ in range(world)]
            y = [torch.full((world * t.numel(),), 7.0, dtype=dtype, device="cuda") for t in x]
            launch(sim, GATHER, dtype, x, y, chunk)
            torch.cuda.synchronize()
            if chunk == 0:  # nothing launched, no turn taken: the next chunk's call pairs correctly
                assert all(sim.alarm(r) == 0 for r in range(world))
                continue
            check_gather(y, x, f"all_gather {dtype} world {world} chunk {chunk} B")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_is_the_all_reduce_chunk(world, dtype):
    gen = torch.Generator().manual_seed(world * 20 + DTYPES.index(dtype))
    with SimWorld(world) as sim:
        for chunk in CHUNKS:
            x = make_inputs(world, world * chunk, dtype, gen) if chunk else [
                torch.empty(0, dtype=dtype, device="cuda") for _ in range(world)]
            y = [torch.full((t.numel() // world,), 7.0, dtype=dtype, device="cuda") for t in x]
            launch(sim, SCATTER, dtype, x, y, chunk)
            torch.cuda.synchronize()
            if chunk == 0:
                continue
            check_scatterv(sim, dtype, y, x, [chunk] * world, f"reduce_scatter {dtype} world {world} chunk {chunk} B")


@pytest.mark.parametrize("world", WORLDS)
def test_in_place(world):
    """all_gather with x this rank's slice of out; reduce_scatter with out this rank's slice of x:
    the only overlaps the host lets through."""
    gen = torch.Generator().manual_seed(world + 500)
    dtype, chunk = torch.bfloat16, 4096 * 2 + 16
    with SimWorld(world) as sim:
        x = make_inputs(world, chunk, dtype, gen)
        n = x[0].numel()
        y = [torch.full((world * n,), 7.0, dtype=dtype, device="cuda") for _ in x]
        for r in range(world):
            y[r][r * n:(r + 1) * n] = x[r]
        launch(sim, GATHER, dtype, [y[r][r * n:(r + 1) * n] for r in range(world)], y, chunk)
        torch.cuda.synchronize()
        check_gather(y, x, f"in-place all_gather world {world}")

        whole = make_inputs(world, world * chunk, dtype, gen)
        kept = [t.clone() for t in whole]
        outs = [whole[r][r * n:(r + 1) * n] for r in range(world)]
        launch(sim, SCATTER, dtype, whole, outs, chunk)
        torch.cuda.synchronize()
        check_scatterv(sim, dtype, outs, kept, [chunk] * world, f"in-place reduce_scatter world {world}")


@pytest.mark.parametrize("world", WORLDS)
def test_many_calls_in_a_row_alternating_with_the_all_reduce(world):
    """150 calls of the three flag-free kernels, back to back, synchronised once: ranks drift
    apart by whole calls while each kernel clears, two calls later, what a different kernel of
    a different size left in a receive buffer (every kernel records its own per-slot size). The
    sizes cross the grid thresholds both ways (at the simulated cap of 8 blocks: 2 below 16 KiB
    sent to a peer, 4 from there, 8 from 64 KiB): the two smallest run on the narrow grid, the
    next on the middle one, the two largest on the widest, whose extra blocks must find the live
    buffer that narrower calls left. Every input is made first: its copy to the GPU would wait
    for every rank's calls so far."""
    gen = torch.Generator().manual_seed(world + 900)
    chunks = (16, 1008, 32_784, 65_552, FLAGFREE_BYTES)  # 5 sizes against 3 kernels: all pairs meet
    # A period of four kinds over three rotating buffers: every kernel meets every buffer.
    plan = [(("ar", "ag", "rs", "ag")[i % 4], DTYPES[(i // 4) % 3], chunks[i % len(chunks)]) for i in range(150)]
    inputs = [make_inputs(world, world * chunk if kind == "rs" else chunk, dtype, gen) for kind, dtype, chunk in plan]
    calls = []
    with SimWorld(world) as sim:
        for (kind, dtype, chunk), x in zip(plan, inputs):
            if kind == "ar":
                y = [torch.full_like(t, 7.0) for t in x]
                sim.launch(FLAGFREE, dtype, x, y)
            elif kind == "ag":
                y = [torch.full((world * t.numel(),), 7.0, dtype=dtype, device="cuda") for t in x]
                launch(sim, GATHER, dtype, x, y, chunk)
            else:
                y = [torch.full((t.numel() // world,), 7.0, dtype=dtype, device="cuda") for t in x]
                launch(sim, SCATTER, dtype, x, y, chunk)
            calls.append((kind, dtype, chunk, x, y))
        torch.cuda.synchronize()
        for i, (kind, dtype, chunk, x, y) in enumerate(calls):
            what = f"world {world} call {i} {kind} {dtype} chunk {chunk} B"
            if kind == "ar":
                check_outputs(y, x, what)
            elif kind == "ag":
                check_gather(y, x, what)
            else:
                check_scatterv(sim, dtype, y, x, [chunk] * world, what)


def test_entry_points_refuse_what_why_not_refuses():
    """Sizes not whole vectors, chunks over the receive slot, integer dtypes: refused before
    anything is enqueued."""
    with SimWorld(2) as sim:
        x = torch.zeros(2 * FLAGFREE_BYTES, dtype=torch.uint8, device="cuda")
        y = torch.zeros(4 * FLAGFREE_BYTES, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        bf16 = _native.DTYPE_CODES[torch.bfloat16]
        for fn in (GATHER, SCATTER):
            f = getattr(sim.lib, fn)

            def call(dtype, in_ptr, sizes):
                return f(sim.ctxs[0], dtype, in_ptr, y.data_ptr(), chunk_array(2, sizes), stream)
            assert call(bf16, x.data_ptr(), 1000) != 0
            assert call(bf16, x.data_ptr(), [16, 1000]) != 0  # one rank's chunk is enough to refuse
            assert call(bf16, x.data_ptr(), FLAGFREE_BYTES + 16) != 0
            assert call(bf16, x.data_ptr(), [16, FLAGFREE_BYTES + 16]) != 0
            assert call(bf16, x.data_ptr() + 8, 16) != 0
            assert call(999, x.data_ptr(), 16) != 0
            assert f(sim.ctxs[0], bf16, x.data_ptr(), y.data_ptr(), None, stream) != 0
            assert call(bf16, x.data_ptr(), 0) == 0


# Uneven chunks in bytes per rank (world 8; smaller worlds take the first W): empty ranks,
# one vector, odd vector counts, a whole receive slot beside an empty one.
UNEVEN = ([0, 16, 1008, 0, 4096 * 2 + 16, 48, 16, 0],
          [FLAGFREE_BYTES, 0, 16, FLAGFREE_BYTES, 1024, 0, 65_552, 16],
          [16, FLAGFREE_BYTES, 0, 0, 0, 0, 0, 32])


def uneven_inputs(world: int, chunks, dtype: torch.dtype, gen: torch.Generator, each: bool):
    """Per rank: its own chunk (each=False, a gather's input) or every rank's chunks back to
    back (each=True, a scatter's input), from make_inputs' awkward data."""
    total = sum(chunks)
    whole = make_inputs(world, max(total, 16), dtype, gen)
    size = torch.empty((), dtype=dtype).element_size()
    if each:
        return [w[:total // size].clone() for w in whole]
    return [w[:chunks[r] // size].clone() for r, w in enumerate(whole)]


def segments(x: torch.Tensor, chunks) -> list[torch.Tensor]:
    size, at, out = x.element_size(), 0, []
    for c in chunks:
        out.append(x[at // size:(at + c) // size])
        at += c
    return out


def check_scatterv(sim: SimWorld, dtype, outputs, inputs, chunks, what: str) -> None:
    """Rank j's output is, bit for bit, the flag-free all-reduce of every rank's segment j (one
    all-reduce per segment: a reduce-scatter's limit is one chunk per receive slot, so its whole
    input may exceed the all-reduce's capacity while every segment fits); and (check_outputs)
    that all-reduce is the rank-order fp32 sum. Equal chunks are the even reduce_scatter."""
    for j, out in enumerate(outputs):
        if not chunks[j]:
            continue
        parts = [segments(x, chunks)[j] for x in inputs]
        reduced = all_reduce(sim, dtype, parts)
        torch.cuda.synchronize()
        check_outputs(reduced, parts, f"{what} (the all-reduce of segment {j})")
        differ = (_bits(out) != _bits(reduced[0])).nonzero().flatten()
        assert differ.numel() == 0, f"{what}: rank {j} differs from the all-reduce of its segment at {differ[:8].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_all_gatherv_concatenates_uneven_chunks(world, dtype):
    gen = torch.Generator().manual_seed(world * 30 + DTYPES.index(dtype))
    with SimWorld(world) as sim:
        for pattern in UNEVEN:
            chunks = pattern[:world]
            x = uneven_inputs(world, chunks, dtype, gen, each=False)
            y = [torch.full((sum(chunks) // x[0].element_size(),), 7.0, dtype=dtype, device="cuda") for _ in x]
            launch(sim, GATHER, dtype, x, y, chunks)
            torch.cuda.synchronize()
            check_gather(y, x, f"all_gatherv {dtype} world {world} chunks {chunks}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatterv_sums_uneven_segments(world, dtype):
    gen = torch.Generator().manual_seed(world * 40 + DTYPES.index(dtype))
    with SimWorld(world) as sim:
        for pattern in UNEVEN:
            chunks = pattern[:world]
            x = uneven_inputs(world, chunks, dtype, gen, each=True)
            y = [torch.full((chunks[r] // x[0].element_size(),), 7.0, dtype=dtype, device="cuda")
                 for r in range(world)]
            launch(sim, SCATTER, dtype, x, y, chunks)
            torch.cuda.synchronize()
            check_scatterv(sim, dtype, y, x, chunks, f"reduce_scatterv {dtype} world {world} chunks {chunks}")


@pytest.mark.parametrize("world", WORLDS)
def test_uneven_in_place(world):
    """all_gatherv with x this rank's chunk of out; reduce_scatterv with out this rank's segment of x."""
    gen = torch.Generator().manual_seed(world + 700)
    dtype, chunks = torch.bfloat16, UNEVEN[1][:world]
    x = uneven_inputs(world, chunks, dtype, gen, each=False)
    with SimWorld(world) as sim:
        y = [torch.full((sum(chunks) // 2,), 7.0, dtype=dtype, device="cuda") for _ in x]
        for r in range(world):
            segments(y[r], chunks)[r].copy_(x[r])
        launch(sim, GATHER, dtype, [segments(y[r], chunks)[r] for r in range(world)], y, chunks)
        torch.cuda.synchronize()
        check_gather(y, x, f"in-place all_gatherv world {world}")

        whole = uneven_inputs(world, chunks, dtype, gen, each=True)
        kept = [t.clone() for t in whole]
        outs = [segments(whole[r], chunks)[r] for r in range(world)]
        launch(sim, SCATTER, dtype, whole, outs, chunks)
        torch.cuda.synchronize()
        check_scatterv(sim, dtype, outs, kept, chunks, f"in-place reduce_scatterv world {world}")


@pytest.mark.parametrize("world", WORLDS)
def test_uneven_calls_in_a_row_with_the_even_ones(world):
    """90 calls, back to back, synchronised once: uneven gathers and scatters between even
    all-reduces. Each uneven call leaves its longest peer chunk in a receive buffer (a gather's
    slots differ in length), which the clear two calls later must cover whatever kernel runs.
    Every input is made first: its copy to the GPU would wait for every rank's calls so far."""
    rng = random.Random(world)
    gen = torch.Generator().manual_seed(world + 1100)
    dtype = torch.bfloat16
    plan = []
    for i in range(90):
        kind = ("ar", "agv", "rsv", "agv")[i % 4]  # four kinds over three buffers: all pairs meet
        chunks = [16 * rng.choice((0, 1, 63, 4097, FLAGFREE_BYTES // 16)) for _ in range(world)]
        if kind == "ar":
            x = make_inputs(world, 16 * rng.choice((1, 63, 4097)), dtype, gen)
        else:
            x = uneven_inputs(world, chunks, dtype, gen, each=kind == "rsv")
        plan.append((kind, chunks, x))
    calls = []
    with SimWorld(world) as sim:
        for kind, chunks, x in plan:
            if kind == "ar":
                y = [torch.full_like(t, 7.0) for t in x]
                sim.launch(FLAGFREE, dtype, x, y)
            elif kind == "agv":
                y = [torch.full((sum(chunks) // 2,), 7.0, dtype=dtype, device="cuda") for _ in x]
                launch(sim, GATHER, dtype, x, y, chunks)
            else:
                y = [torch.full((chunks[r] // 2,), 7.0, dtype=dtype, device="cuda") for r in range(world)]
                launch(sim, SCATTER, dtype, x, y, chunks)
            calls.append((kind, chunks, x, y))
        torch.cuda.synchronize()
        for i, (kind, chunks, x, y) in enumerate(calls):
            what = f"world {world} call {i} {kind} chunks {chunks}"
            if kind == "ar":
                check_outputs(y, x, what)
            elif kind == "agv":
                check_gather(y, x, what)
            else:
                check_scatterv(sim, dtype, y, x, chunks, what)


@pytest.mark.parametrize("op", ("gather", "scatter"))
def test_a_rank_with_nothing_to_send_does_not_run_ahead(op):
    """Chunks (0, n): in a gather rank 0 has nothing for rank 1, in a scatter rank 1 has nothing
    for rank 0. Without a placeholder vector the rank that receives nothing finishes its calls
    without waiting for its peer, and with the peer held up by a long kernel it writes its third
    call into a receive buffer the peer has yet to clear: the peer's clear then erases that
    call's data and the peer waits for it until its bound. Three calls per rank are enqueued
    with no wait between ranks, the receiving rank late; every output must be right and no
    rank may give up."""
    world, dtype, n = 2, torch.bfloat16, 4096
    chunks = [0, n]
    fn = GATHER if op == "gather" else SCATTER
    late = 0 if op == "gather" else 1  # the rank whose peer has something for it
    gen = torch.Generator().manual_seed(1300)
    with SimWorld(world) as sim:
        def make():
            x = uneven_inputs(world, chunks, dtype, gen, each=op == "scatter")
            size = sum(chunks) if op == "gather" else None
            y = [torch.full(((size if size is not None else chunks[r]) // 2,), 7.0, dtype=dtype, device="cuda")
                 for r in range(world)]
            return x, y
        first = make()
        launch(sim, fn, dtype, *first, chunks)  # sets each rank's record of what to clear
        calls = [make() for _ in range(3)]
        here, sizes = torch.cuda.current_stream(), chunk_array(world, chunks)
        for r in range(world):
            stream = sim.streams[r]
            stream.wait_stream(here)
            if r == late:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(LATE_CYCLES)
            for x, y in calls:
                code = getattr(sim.lib, fn)(sim.ctxs[r], _native.DTYPE_CODES[dtype], x[r].data_ptr(), y[r].data_ptr(),
                                            sizes, stream.cuda_stream)
                _native.check(sim.lib, f"{fn}(rank {r})", code)
        for r in range(world):
            here.wait_stream(sim.streams[r])
        torch.cuda.synchronize()
        assert [sim.alarm(r) for r in range(world)] == [0, 0]
        for i, (x, y) in enumerate([first, *calls]):
            if op == "gather":
                check_gather(y, x, f"all_gatherv call {i}")
            else:
                check_scatterv(sim, dtype, y, x, chunks, f"reduce_scatterv call {i}")
