"""custom-push's all_gather and custom-oneshot's reduce_scatter on 1-D symmetric tensors (rows of
one element): with equal sizes each rank's part is addressed by byte offset, so one rank's chunk
being whole 16-byte vectors is enough (symcomm/backends/peer_path.py, offset_unit). Gathers are
checked bitwise against NCCL, scatters against the float64 reference and NCCL, out of place, in
place and replayed from a graph.

Run: torchrun --nproc-per-node=2 -m pytest tests/gpu/test_peer_chunks.py
"""
from __future__ import annotations

import pytest
import torch

import symcomm
from symcomm import base
from _data import DTYPES, all_inputs, assert_reduced

# One rank's chunk in bytes: one vector, an odd vector count, 64 KiB + 16, 4 MiB + 16 (beyond
# the flag-free slot, where these paths would take over).
CHUNKS = (16, 1008, 65_552, (4 << 20) + 16)


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // (torch.finfo(dtype).bits // 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_push_all_gather_1d_is_bitwise_nccl(comm, chunk, dtype):
    w, rank, n = comm.world_size, comm.rank, _numel(chunk, dtype)
    x = all_inputs(n, dtype, w, seed=chunk % 997 + 3)[rank]
    want = comm.all_gather(x, algo="nccl")
    with symcomm.use_symmetric_memory(comm):
        out = torch.full((w * n,), float("nan"), dtype=dtype, device="cuda")
    comm.all_gather(x, out=out, algo=base.PUSH)  # forced: raises if the path declines
    got = out.clone()
    out.fill_(float("nan"))
    out[rank * n:(rank + 1) * n] = x
    comm.all_gather(out[rank * n:(rank + 1) * n], out=out, algo=base.PUSH)  # in place
    # Asserts only after every collective, so that a failure on one rank cannot leave its
    # peers waiting in a call it never makes.
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_oneshot_reduce_scatter_1d_matches_the_reference(comm, chunk, dtype):
    w, rank, n = comm.world_size, comm.rank, _numel(chunk, dtype)
    inputs = all_inputs(w * n, dtype, w, seed=chunk % 997 + 7)
    with symcomm.use_symmetric_memory(comm):
        x = torch.empty_like(inputs[rank])
    x.copy_(inputs[rank])
    got = comm.reduce_scatter(x, algo=base.ONESHOT)
    theirs = comm.reduce_scatter(x, algo="nccl")
    mine = x[rank * n:(rank + 1) * n]
    comm.reduce_scatter(x, out=mine, algo=base.ONESHOT)  # in place: this rank's part of x
    # Asserts only after every collective; NCCL is held to the float64 reference, not to these
    # bits (from world 4 it rounds partial sums in the tensor's dtype).
    parts = [t[rank * n:(rank + 1) * n] for t in inputs]
    assert_reduced(got, parts, f"reduce_scatter {dtype} {chunk} B")
    assert_reduced(theirs, parts, f"NCCL's reduce_scatter {dtype} {chunk} B")
    assert torch.equal(mine.view(torch.uint8), got.view(torch.uint8))


def test_rows_shorter_than_a_vector_whose_chunks_are_whole_vectors(comm):
    """2-D tensors of 6-byte rows (3 bf16), 8 rows per rank: no row is a vector, each rank's
    48-byte chunk is three. Both paths serve them, checked against NCCL and the reference."""
    w, rank, rows = comm.world_size, comm.rank, 8
    inputs = [t.view(w * rows, 3) for t in all_inputs(w * rows * 3, torch.bfloat16, w, seed=61)]
    mine = inputs[rank][rank * rows:(rank + 1) * rows].contiguous()
    with symcomm.use_symmetric_memory(comm):
        gathered = torch.empty(w * rows, 3, dtype=torch.bfloat16, device="cuda")
        x = torch.empty(w * rows, 3, dtype=torch.bfloat16, device="cuda")
    x.copy_(inputs[rank])
    comm.all_gather(mine, out=gathered, algo=base.PUSH)
    want = comm.all_gather(mine, algo="nccl")
    got = comm.reduce_scatter(x, algo=base.ONESHOT)
    assert torch.equal(gathered.view(torch.uint8), want.view(torch.uint8))
    assert_reduced(got.reshape(-1), [t[rank * rows:(rank + 1) * rows].reshape(-1) for t in inputs],
                   "reduce_scatter of 6-byte rows")


def test_chunks_not_whole_vectors_are_refused(comm):
    w = comm.world_size
    with symcomm.use_symmetric_memory(comm):
        x = torch.ones(w * 4, dtype=torch.bfloat16, device="cuda")  # 8-byte chunks
        out = torch.empty(w * 4, dtype=torch.bfloat16, device="cuda")
    assert "one rank's chunk of 8 bytes" in comm.select("reduce_scatter", x, algo="auto").rejected[base.ONESHOT]
    assert "one rank's chunk of 8 bytes" in comm.select("all_gather", x[:4], out=out).rejected[base.PUSH]


@pytest.fixture()
def fresh(dist_env):
    """A communicator with a small pool of its own, so its allocations start from a known state
    on every rank (in the session's pool, the first run's graph test met offsets that differed
    between ranks, which check mode refused)."""
    c = symcomm.Communicator(symmetric_capacity=64 << 20, check=True)
    yield c
    c.close()


@pytest.mark.parametrize("op", ("all_gather", "reduce_scatter"))
def test_graph_replay_equals_eager(fresh, op):
    comm = fresh
    w, rank, n = comm.world_size, comm.rank, _numel(65_552, torch.bfloat16)
    algo = base.PUSH if op == "all_gather" else base.ONESHOT
    mine = all_inputs(w * n, torch.bfloat16, w, seed=41)[rank]
    with symcomm.use_symmetric_memory(comm):  # two allocations, nothing else, on every rank
        x = torch.empty(w * n, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(w * n if op == "all_gather" else n, dtype=torch.bfloat16, device="cuda")
    x.copy_(mine)
    src = x[:n] if op == "all_gather" else x
    run = getattr(comm, op)
    run(src, out=out, algo=algo)
    eager = out.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(src, out=out, algo=algo)  # warm-up before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        run(src, out=out, algo=algo)
    replays = []
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    for i, got in enumerate(replays):  # after every replay, so every rank replays alike
        assert torch.equal(got.view(torch.int16), eager.view(torch.int16)), f"replay {i}"
