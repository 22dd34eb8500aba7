"""Every collective on every path against float64 / exact references, on random data."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import symcomm
from symcomm.backends import nccl as nccl_backend
from _data import DTYPES, all_inputs, assert_reduced, assert_symmetric_served, rank_input

PATHS = ("nccl", "nccl-symm", "auto")
# Element counts: empty, tiny, not a multiple of 16 bytes, around the path thresholds, large.
NUMELS = (0, 1, 7, 1023, 4097, 65537, 1_000_003, 8 * 2**20 + 5)
# A reduce-scatter chunk must also come in whole 16-byte vectors for the symmetric and kernel
# paths to take it (NUMELS' odd counts send them all to plain NCCL): these do, at every dtype.
SCATTER_NUMELS = NUMELS + (8, 1024, 65536, 1 << 20)


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.dtype.is_floating_point else -1)


def _alloc(comm, shape, dtype, symmetric: bool) -> torch.Tensor:
    with symcomm.use_symmetric_memory(comm, disabled=not symmetric):
        return torch.empty(shape, dtype=dtype, device=comm.device)


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g.view(torch.uint8), t.view(torch.uint8)) for g in gathered)


def test_symmetric_path_is_enabled(comm):
    caps = comm.capabilities()
    assert caps["paths"]["nccl-symm"]["enabled"], caps
    assert caps["symmetric_memory"]["capacity"] >= 1536 << 20


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", PATHS)
def test_all_reduce(comm, algo, dtype, numel):
    seed = zlib.crc32(f"{algo}{dtype}{numel}".encode()) % 10_000  # str hash() differs per process
    x = _alloc(comm, numel, dtype, True).copy_(rank_input(numel, dtype, comm.rank, seed))
    out = _poison(_alloc(comm, numel, dtype, True))
    comm.all_reduce(x, out=out, algo=algo)
    same = _same_on_all_ranks(out)  # every collective before any assert: a failing rank must not desert the others
    assert_reduced(out, all_inputs(numel, dtype, comm.world_size, seed), f"all_reduce {algo}")
    assert same, "ranks disagree bitwise"


@pytest.mark.parametrize("algo", PATHS)
def test_all_reduce_in_place_and_ops(comm, algo):
    n = 12345
    for op in ("sum", "max", "min", "avg"):
        x = _alloc(comm, n, torch.float32, True).copy_(rank_input(n, torch.float32, comm.rank, 7))
        result = comm.all_reduce(x, out=x, op=op, algo=algo)
        assert result.data_ptr() == x.data_ptr()
        stacked = torch.stack(all_inputs(n, torch.float32, comm.world_size, 7)).double()
        ref = {"sum": stacked.sum(0), "max": stacked.max(0).values, "min": stacked.min(0).values,
               "avg": stacked.mean(0)}[op]
        torch.testing.assert_close(x.double(), ref, rtol=1e-5, atol=1e-5, msg=f"op={op}")


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", PATHS)
def test_all_gather(comm, algo, dtype, numel):
    seed = 31 + numel
    x = _alloc(comm, (numel, 1), dtype, True).copy_(rank_input((numel, 1), dtype, comm.rank, seed))
    out = _poison(_alloc(comm, (comm.world_size * numel, 1), dtype, True))
    comm.all_gather(x, out=out, algo=algo)
    assert torch.equal(out, torch.cat(all_inputs((numel, 1), dtype, comm.world_size, seed)))


@pytest.mark.parametrize("numel", SCATTER_NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", PATHS)
def test_reduce_scatter(comm, algo, dtype, numel):
    seed, w = 77 + numel, comm.world_size
    x = _alloc(comm, w * numel, dtype, True).copy_(rank_input(w * numel, dtype, comm.rank, seed))
    out = _poison(_alloc(comm, numel, dtype, True))
    if algo == "nccl-symm" and numel * dtype.itemsize % 16:
        # NCCL 2.28.9's symmetric reduce-scatter got such chunks wrong; the path refuses them.
        with pytest.raises(symcomm.ArgumentError, match="multiple of 16 bytes"):
            comm.reduce_scatter(x, out=out, algo=algo)
        return
    if algo == "auto" and numel and not numel * dtype.itemsize % 16:
        assert_symmetric_served(comm.select("reduce_scatter", x, out=out))
    comm.reduce_scatter(x, out=out, algo=algo)
    mine = [t[comm.rank * numel:(comm.rank + 1) * numel] for t in all_inputs(w * numel, dtype, w, seed)]
    assert_reduced(out, mine, f"reduce_scatter {algo}")


@pytest.mark.parametrize("algo", ("nccl-symm", "auto"))
@pytest.mark.parametrize("op", ("all_reduce", "all_gather", "reduce_scatter"))
def test_256_mib(comm, op, algo):
    dtype, nbytes, w = torch.bfloat16, 256 << 20, comm.world_size
    numel = nbytes // 2 // (w if op == "all_gather" else 1)
    x = _alloc(comm, numel, dtype, True).copy_(rank_input(numel, dtype, comm.rank, 5))
    out_numel = {"all_reduce": numel, "all_gather": numel * w, "reduce_scatter": numel // w}[op]
    out = _poison(_alloc(comm, out_numel, dtype, True))
    getattr(comm, op)(x, out=out, algo=algo)
    inputs = all_inputs(numel, dtype, w, 5)
    if op == "all_gather":
        assert torch.equal(out, torch.cat(inputs))
    elif op == "all_reduce":
        assert_reduced(out, inputs, "256 MiB all_reduce")
    else:
        assert_reduced(out, [t[comm.rank * out_numel:(comm.rank + 1) * out_numel] for t in inputs], op)
    del x, out


SIZE_PATTERNS = {
    "uneven_with_zero": lambda w: [3, 0, 5, 1, 9, 0, 2, 4][:w],
    "all_zero_but_last": lambda w: [0] * (w - 1) + [17],
    "all_zero": lambda w: [0] * w,
    "equal": lambda w: [6] * w,
    "large_uneven": lambda w: [100_003 * (r + 1) for r in range(w)],
}


# Uneven allocations in the shared pool would leave rank-dependent holes that shift every
# later symmetric tensor (the "same offset" rule), so uneven sizes use ordinary memory here;
# test_paths.py (test_check_mode_names_the_misplaced_tensor) shows check mode catching exactly that.
GATHERV_CASES = [(p, False) for p in SIZE_PATTERNS] + [("equal", True), ("all_zero", True)]
# Only an uneven call chooses between the two schedules (an even one is one ncclAllGather).
UNEVEN_PATTERNS = ("uneven_with_zero", "all_zero_but_last", "large_uneven")
GATHERV_SCHEDULED = ([(p, s, "send/recv") for p, s in GATHERV_CASES]
                     + [(p, s, "broadcast") for p, s in GATHERV_CASES if p in UNEVEN_PATTERNS])


@pytest.mark.parametrize(("pattern", "symmetric", "schedule"), GATHERV_SCHEDULED)
def test_all_gatherv_several_tensors(comm, pattern, symmetric, schedule, monkeypatch):
    if schedule == "broadcast":  # the uneven schedule of gathers over 64 MiB, at any size here
        monkeypatch.setattr(nccl_backend, "SENDRECV_GATHERV_MAX_BYTES", -1)
    w, rank = comm.world_size, comm.rank
    sizes = SIZE_PATTERNS[pattern](w)
    specs = [((64,), torch.uint8), ((4,), torch.float8_e4m3fn), ((8,), torch.int32), ((8,), torch.float32),
             ((33,), torch.bfloat16)]

    def rows_of(r, i, shape, dtype):
        base = rank_input((sizes[r], *shape), torch.float32 if dtype.is_floating_point else torch.int32, r, 100 + i)
        return base.to(dtype)

    xs = []
    for i, (shape, dtype) in enumerate(specs):
        xs.append(_alloc(comm, (sizes[rank], *shape), dtype, symmetric).copy_(rows_of(rank, i, shape, dtype)))
    outs = [_alloc(comm, (sum(sizes), *s), d, symmetric).view(torch.uint8).fill_(0xAB).view(d) for s, d in specs]
    choice = comm.select("all_gatherv", xs, out=outs, sizes=sizes)
    result = comm.all_gatherv(xs, sizes, out=outs)
    assert [o.data_ptr() for o in result] == [o.data_ptr() for o in outs]
    for i, (shape, dtype) in enumerate(specs):
        expect = torch.cat([rows_of(r, i, shape, dtype) for r in range(w)])
        assert torch.equal(outs[i].view(torch.uint8), expect.view(torch.uint8)), f"tensor {i} ({dtype})"
    even = len(set(sizes)) == 1
    if symmetric and even and sum(sizes):
        assert_symmetric_served(choice)
    elif not even:
        assert choice.algo == "nccl" and "uneven" in choice.rejected["nccl-symm"], choice


@pytest.mark.parametrize("pattern", ("uneven_with_zero", "all_zero_but_last", "equal", "large_uneven"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatterv(comm, pattern, dtype):
    w, rank = comm.world_size, comm.rank
    sizes = SIZE_PATTERNS[pattern](w)
    shape = (sum(sizes), 33)
    x = rank_input(shape, dtype, rank, 9)  # ordinary memory: see GATHERV_CASES
    out = _poison(torch.empty((sizes[rank], 33), dtype=dtype, device=comm.device))
    comm.reduce_scatterv(x, sizes, out=out)
    first = sum(sizes[:rank])
    assert_reduced(out, [t[first:first + sizes[rank]] for t in all_inputs(shape, dtype, w, 9)], "reduce_scatterv")


def test_matches_torch_distributed(comm):
    """Same inputs through torch.distributed's own NCCL: same sum (fp32, tolerance)."""
    x = rank_input(300_001, torch.float32, comm.rank, 3)
    ours = comm.all_reduce(x.clone(), algo="nccl")
    theirs = x.clone()
    dist.all_reduce(theirs)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
