"""all_reduce_rmsnorm on every path, all_to_allv, and the backward of every collective, on real ranks.

all_reduce_rmsnorm must give the bits of its all-reduce followed by the norm kernel
(symcomm.rmsnorm.add_rmsnorm), eager and replayed from a graph captured in graph_capture().
Gradients are checked as tests/test_autograd.py checks them over gloo: every rank computes the
single-process function of every rank's inputs and lets torch differentiate it.
"""
from __future__ import annotations

import pytest
import torch

import symcomm
from _data import assert_reduced, rank_input
from test_autograd import _a2a_reference, _reference_grad, _specs

HIDDEN = 7168
QUANT_SCALES = {None: None, "fp8": 0.37, "nvfp4": 448 * 6 / 9.0}


def _norm_inputs(comm, tokens: int, symmetric: bool, seed: int):
    x_own = rank_input((tokens, HIDDEN), torch.bfloat16, comm.rank, seed, comm.device)
    with symcomm.use_symmetric_memory(comm, disabled=not symmetric):
        x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=comm.device)
    x.copy_(x_own)
    # Residual and weight are the same on every rank, as under tensor parallelism.
    residual = rank_input((tokens, HIDDEN), torch.bfloat16, 0, seed + 1, comm.device)
    weight = rank_input(HIDDEN, torch.bfloat16, 0, seed + 2, comm.device)
    return x, residual, weight


def _same(got: symcomm.NormedResult, want: symcomm.NormedResult, what: str) -> None:
    for name in ("out", "residual", "scales"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, f"{what}: {name}"
            continue
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            f"{what}: {name} differs in {(a.view(torch.uint8) != b.view(torch.uint8)).sum().item()} bytes"


@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("quant", (None, "fp8", "nvfp4"))
@pytest.mark.parametrize("tokens", (1, 5, 64))
def test_the_op_gives_its_all_reduce_then_the_norm_kernels_bits(comm, tokens, quant, symmetric):
    x, residual, weight = _norm_inputs(comm, tokens, symmetric, 40 + tokens)
    scale = QUANT_SCALES[quant]
    got = comm.all_reduce_rmsnorm(x, weight, residual=residual, quant=quant, scale=scale, algo="unfused")
    summed = comm.all_reduce(x)
    want = symcomm.rmsnorm.add_rmsnorm(summed, weight, residual=residual, quant=quant, scale=scale)
    what = f"tokens={tokens} quant={quant} symmetric={symmetric}"
    _same(got, want, what)
    # The all-reduce against float64. The norm kernel's link is checked elsewhere: bitwise
    # against its CPU twin on simulated ranks (tests/gpu_sim/test_rmsnorm_kernel.py), and the
    # twin against reference_add_rmsnorm on the CPU (tests/test_rmsnorm.py).
    inputs = [rank_input((tokens, HIDDEN), torch.bfloat16, r, 40 + tokens, comm.device) for r in range(comm.world_size)]
    assert_reduced(summed, inputs, f"{what}: the all-reduce")


@pytest.mark.parametrize("tokens", (1, 64))
def test_captured_norm_replays_the_eager_bits(comm, tokens):
    """The op captured inside graph_capture() with x in the pool, replayed on new inputs: the
    bits of the eager call."""
    x, residual, weight = _norm_inputs(comm, tokens, True, 60 + tokens)
    comm.all_reduce_rmsnorm(x, weight, residual=residual, algo="unfused")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        captured = comm.all_reduce_rmsnorm(x, weight, residual=residual, algo="unfused")
    for seed in (61, 62):
        x.copy_(rank_input((tokens, HIDDEN), torch.bfloat16, comm.rank, seed))
        graph.replay()
        torch.cuda.synchronize()
        replayed = symcomm.NormedResult(captured.out.clone(), captured.residual.clone(), None)
        eager = comm.all_reduce_rmsnorm(x, weight, residual=residual, algo="unfused")
        _same(replayed, eager, f"tokens={tokens} replay seed {seed}")
    del graph


@pytest.mark.parametrize("tokens", (1, 64, 2048))
def test_ranks_differing_only_in_calling_the_norm_in_place_stay_in_step(comm, tokens):
    """Rank 0 passes residual_out=residual, the others a residual_out of their own, inside
    use_symmetric_memory with x in the pool. Every rank must take the same norm and all-reduce
    paths, allocate the same pool blocks (a later pool tensor sits at one offset everywhere),
    and give the bits of its all-reduce followed by the norm kernel."""
    x, residual, weight = _norm_inputs(comm, tokens, True, 80 + tokens)
    want = symcomm.rmsnorm.add_rmsnorm(comm.all_reduce(x), weight, residual=residual)
    res = residual.clone()
    residual_out = res if comm.rank == 0 else torch.empty_like(res)
    with symcomm.use_symmetric_memory(comm):  # select() explains under the call's own allocations
        choice = comm.select("all_reduce_rmsnorm", x, weight=weight, residual=res, residual_out=residual_out)
        got = comm.all_reduce_rmsnorm(x, weight, residual=res, residual_out=residual_out)
        later = torch.empty(4096, device=comm.device)
    seen = [None] * comm.world_size
    torch.distributed.all_gather_object(seen, (choice.algo, choice.all_reduce.algo,
                                               comm.symmetric_pool.locate(later.data_ptr())))
    assert len(set(seen)) == 1, f"{tokens} tokens, rank 0 in place: ranks saw {seen}"
    assert seen[0][2] != (-1, -1), "the later tensor is not in the pool"
    assert got.residual is residual_out
    _same(got, want, f"tokens={tokens}, rank 0 in place")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_all_to_allv_matches_the_reference(comm, dtype):
    w, rank = comm.world_size, comm.rank
    counts = [[(3 * r + 5 * p) % 7 for p in range(w)] for r in range(w)]  # zeros included
    xs = [rank_input((sum(counts[r]), 33), dtype, r, 70, comm.device) for r in range(w)]
    want = _a2a_reference(xs, counts)[rank]
    served = []
    for algo in comm.algorithms("all_to_allv"):
        try:
            got = comm.all_to_allv(xs[rank], counts[rank], [row[rank] for row in counts], algo=algo)
        except symcomm.ArgumentError as exc:  # e.g. nccl-symm: NCCL has no symmetric all-to-all
            assert "cannot serve" in str(exc), exc
            continue
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), algo
        served.append(algo)
    assert {"nccl", "torch"} <= set(served), served


def test_a_rank_with_nothing_to_send_or_receive_still_takes_part(comm):
    """Rank 0 sends and receives nothing, every other rank sends rows to itself only: a rank's
    own bytes must not decide whether it takes part (torch's all_to_all_single is a collective
    every rank joins), on every path that serves the call; the next call then meets its own
    partners."""
    w, rank = comm.world_size, comm.rank
    send = [0] * w
    if rank:
        send[rank] = 3
    x = rank_input((send[rank], 33), torch.bfloat16, rank, 95, comm.device)
    served = []
    for algo in comm.algorithms("all_to_allv"):
        try:
            got = comm.all_to_allv(x, send, send, algo=algo)
        except symcomm.ArgumentError as exc:  # nccl-symm: NCCL has no symmetric all-to-all
            assert "cannot serve" in str(exc), exc
            continue
        assert torch.equal(got, x), algo
        after = comm.all_to_allv(torch.full((w, 4), float(rank), device=comm.device), [1] * w, [1] * w, algo=algo)
        assert after[:, 0].tolist() == [float(q) for q in range(w)], f"{algo}: the next call met other partners"
        served.append(algo)
    assert {"nccl", "torch"} <= set(served), served


# Every collective's backward; the spec with a CPU output buffer (all_gather out=) is the gloo suite's.
GRAD_SPECS = ("all_reduce sum", "all_reduce avg", "all_gather", "reduce_scatter sum", "reduce_scatter avg",
              "all_gatherv", "reduce_scatterv", "all_to_allv", "all_reduce out=", "all_reduce in place")


def _f64(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", GRAD_SPECS)
def test_backward_matches_the_single_process_gradient(comm, name):
    w, rank, dev = comm.world_size, comm.rank, comm.device
    fn, fn_ref, shape = _specs(comm)[name]
    i = GRAD_SPECS.index(name)
    xs = [_f64(shape(q), 1000 * i + q).to(dev) for q in range(w)]
    x = xs[rank].clone().requires_grad_()
    y = fn(x)
    shapes = [t.shape for t in fn_ref(xs)]
    gs = [_f64(shapes[q], 5000 + 1000 * i + q).to(dev) for q in range(w)]
    y.backward(gs[rank])
    want = _reference_grad(fn_ref, xs, gs, rank)
    assert x.grad.shape == want.shape and torch.allclose(x.grad, want, rtol=1e-12, atol=1e-12), (name, x.grad, want)
