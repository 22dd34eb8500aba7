"""The flag-free NVFP4 gather (all_gatherv_fp4's fused-flagfree, csrc/peer_gather.cu's
flag_free_gather_fp4) with W simulated ranks on ONE GPU (tests/gpu_sim/_sim.py).

What this proves: every rank's payload and block scales land bit for bit as the codec writes
them (uneven rows, a rank with none, odd block counts that end a chunk in half a payload vector
and part of a scale vector, a chunk that fills the receive slot, outputs at any alignment), that
the kernel shares the other flag-free kernels' receive buffers, turn and clear when calls of all
of them follow each other with no host synchronisation, that a rank with no rows does not run
ahead, and that a rank that never comes makes its peers give up within the bound. Not NVLink
behaviour or timing.
"""
from __future__ import annotations

import ctypes
import time

import pytest
import torch

from _sim import FLAGFREE_BYTES, SimWorld, check_outputs, make_inputs
from symcomm import _native, fp4
from symcomm.backends.fp4_flagfree import wire_bytes
from symcomm.base import FLAGFREE
from symcomm.peer.context import ABORT_TIMEOUT

WORLDS = (2, 4, 8)
FN = "symcomm_ar_flagfree_gatherv_fp4"
# Rows of hidden 7168 that nearly fill the simulated receive slot (4,032 wire bytes a row).
FULL_ROWS = FLAGFREE_BYTES // wire_bytes(1, 7168)
SPLITS = {2: [(0, 5), (1, 0), (3, 7), (FULL_ROWS, 1)], 4: [(0, 3, 1, 0), (7, 0, 2, 9), (1, FULL_ROWS, 0, 3)],
          8: [(0, 1, 0, 2, 5, 0, 0, 1), (3, 3, 3, 3, 0, 3, 3, 1)]}
HIDDEN = (7168, 48, 272)  # 448, 3 and 17 blocks a row


@pytest.fixture(autouse=True)
def _kernels_loaded(_gpu):
    """The codec's kernels are loaded before any rank spins (a lazily loaded first launch would
    wait for the device to go idle, which a spinning rank never lets it)."""
    for dtype in (torch.bfloat16, torch.float16):
        fp4.quantize(torch.randn(2, 32, device="cuda").to(dtype), 1.0)
    torch.cuda.synchronize()


def rows_of(n: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, h, generator=gen) * torch.logspace(-3, 3, max(n, 1))[:n, None]
    if n:
        x[0, :16] = -0.0
        x[-1, -16:] = float("nan") if n > 1 else 1.0
    return x.to(dtype).cuda()


def outputs_at(total: int, h: int, skew: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Payload and scales `skew` bytes past an aligned address, filled with 0xA5 (a byte the
    codec can write, so the comparison sees an unwritten byte only as a wrong one)."""
    raw = torch.full((total * (h // 2 + h // 16) + 64,), 0xA5, dtype=torch.uint8, device="cuda")
    payload = raw[skew:skew + total * (h // 2)].view(total, h // 2)
    at = 32 + skew + total * (h // 2)
    scales = raw[at:at + total * (h // 16)].view(total, h // 16)
    return payload, scales


def enqueue(sim: SimWorld, r: int, xs, sizes, gs, outs, stream: torch.cuda.Stream) -> None:
    """Rank r's call on `stream`, through the entry point."""
    rows = (ctypes.c_int64 * sim.world)(*sizes)
    gs_ptr, gs_value = fp4.launch_scale(gs)
    args = _native.FlagFreeFp4Args(xs[r].data_ptr(), _native.DTYPE_CODES[xs[r].dtype], xs[r].shape[1], rows, gs_ptr,
                                   gs_value, outs[r][0].data_ptr(), outs[r][1].data_ptr())
    _native.check(sim.lib, f"{FN}(rank {r})", getattr(sim.lib, FN)(sim.ctxs[r], ctypes.byref(args), stream.cuda_stream))


def launch(sim: SimWorld, xs, sizes, gs, outs, ranks=None) -> None:
    """One call on every rank in `ranks` (default all), each on its own stream (SimWorld.each_rank)."""
    sim.each_rank(lambda r, stream: enqueue(sim, r, xs, sizes, gs, outs, stream), ranks)


def expected(xs, gs):
    quantized = [fp4.quantize(x, gs) for x in xs]
    return torch.cat([p for p, _ in quantized]), torch.cat([s.view(torch.uint8) for _, s in quantized])


def check(outs, want, what: str) -> None:
    packed, scales = want
    for r, (p, s) in enumerate(outs):
        assert torch.equal(p, packed), f"{what}: payload on rank {r}"
        assert torch.equal(s, scales), f"{what}: scales on rank {r}"


def gather_flagfree(sim: SimWorld, x, chunk: int):
    """The flag-free all-gather of bf16 chunks `x` on every rank; returns the outputs (7.0 first)."""
    world = sim.world
    y = [torch.full((world * t.numel(),), 7.0, dtype=torch.bfloat16, device="cuda") for t in x]
    counts = (ctypes.c_uint64 * world)(*([chunk] * world))
    sim.each_rank(lambda r, stream: _native.check(sim.lib, "gather", sim.lib.symcomm_ar_flagfree_all_gatherv(
        sim.ctxs[r], _native.DTYPE_CODES[torch.bfloat16], x[r].data_ptr(), y[r].data_ptr(), counts,
        stream.cuda_stream)))
    return y


def check_gathered(x, y, what: str) -> None:
    want = torch.cat(x).view(torch.int32)
    want = torch.where(want == -1, torch.full_like(want, 0x7FFF7FFF), want)  # the sentinel swap
    for r, out in enumerate(y):
        assert torch.equal(out.view(torch.int32), want), f"{what}: rank {r}"


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_the_codec_bytes_in_rank_order(world, dtype):
    gen = torch.Generator().manual_seed(world)
    with SimWorld(world) as sim:
        for h in HIDDEN:
            for i, sizes in enumerate(SPLITS[world]):
                if h != 7168 and max(sizes) == FULL_ROWS:
                    continue  # the full slot is a hidden-7168 case
                xs = [rows_of(n, h, dtype, gen) for n in sizes]
                amax = max((x.float().nan_to_num(0.0).abs().amax().item() for x in xs if x.numel()), default=0.0)
                gs_value = 448.0 * 6.0 / amax if amax else 1.0
                gs = gs_value if i % 2 == 0 else torch.tensor([gs_value], device="cuda")  # read on the device
                outs = [outputs_at(sum(sizes), h, skew=(3 * r + i) % 16) for r in range(world)]
                launch(sim, xs, sizes, gs, outs)
                torch.cuda.synchronize()
                want = expected(xs, gs)
                what = f"world {world} {dtype} hidden {h} sizes {sizes}"
                check(outs, want, what)
                if sum(sizes):
                    assert want[0].any() and want[1].any(), "non-trivial data"
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_calls_in_a_row_with_the_other_flagfree_kernels(world):
    """90 calls, back to back, synchronised once: the FP4 gather, the flag-free all-reduce and
    all-gather, of different sizes, so each clears, two calls later, what another kernel of
    another size left in a receive buffer. Every input is made first: its copy to the GPU
    would wait for every rank's calls so far."""
    gen = torch.Generator().manual_seed(world + 500)
    plan = []
    for i in range(90):
        kind = ("fp4", "ar", "fp4", "ag")[i % 4]
        if kind == "fp4":
            h = HIDDEN[i % 3]
            sizes = [(i * 7 + 3 * r) % 11 for r in range(world)]
            if i % 5 == 0:
                sizes[0] = 0
            plan.append((kind, h, sizes, [rows_of(n, h, torch.bfloat16, gen) for n in sizes]))
        else:
            chunk = (16, 32_784, 65_552, FLAGFREE_BYTES)[(i // 4) % 4]  # grids of 2, 4, 8, 8 blocks
            plan.append((kind, None, chunk, make_inputs(world, chunk, torch.bfloat16, gen)))
    calls = []
    with SimWorld(world) as sim:
        for kind, h, sizes, xs in plan:
            if kind == "fp4":
                outs = [outputs_at(sum(sizes), h, skew=0) for _ in range(world)]
                launch(sim, xs, sizes, 1.0, outs)
                calls.append((kind, xs, outs, sizes))
            else:
                chunk, x = sizes, xs
                if kind == "ar":
                    y = [torch.full_like(t, 7.0) for t in x]
                    sim.launch(FLAGFREE, torch.bfloat16, x, y)
                else:
                    y = gather_flagfree(sim, x, chunk)
                calls.append((kind, x, y, None))
        torch.cuda.synchronize()
        for i, (kind, x, y, sizes) in enumerate(calls):
            what = f"world {world} call {i} {kind}"
            if kind == "fp4":
                check(y, expected(x, 1.0), what)
            elif kind == "ar":
                check_outputs(y, x, what)
            else:
                check_gathered(x, y, what)
        assert all(sim.alarm(r) == 0 for r in range(world))


# symcomm_fp4_debug_grid's launches (blocks, threads, block-major lanes), under the simulated
# ranks' cap of 8 blocks: one block, odd grids, 1024-thread blocks, both lane orders.
FORCED_LAUNCHES = [(1, 128, 0), (1, 128, 1), (3, 256, 1), (8, 1024, 0), (8, 1024, 1), (5, 512, 0)]


@pytest.mark.parametrize("world", (2, 8))
def test_every_forced_launch_writes_the_codec_bytes_and_keeps_the_turn(world):
    """Each launch the measurement hook may force writes the codec's bytes, in one pass or many
    (a full receive slot takes several on any grid here), and advances every flag-free record:
    the flag-free all-gather that follows each, on its own grid, must find its receive buffer
    and clear where its peers do. Calls back to back, synchronised once at the end."""
    gen = torch.Generator().manual_seed(world + 900)
    calls = []
    with SimWorld(world) as sim:
        try:
            for i, forced in enumerate(FORCED_LAUNCHES * 2):
                for r in range(world):
                    _native.check(sim.lib, "symcomm_fp4_debug_grid", sim.lib.symcomm_fp4_debug_grid(sim.ctxs[r], *forced))
                h = 7168 if i % 2 else 272
                sizes = list(SPLITS[world][-1] if h == 7168 else SPLITS[world][0])
                xs = [rows_of(n, h, torch.bfloat16, gen) for n in sizes]
                outs = [outputs_at(sum(sizes), h, skew=i % 16) for _ in range(world)]
                launch(sim, xs, sizes, 1.0, outs)
                calls.append((f"fp4 {forced} hidden {h} sizes {sizes}", xs, outs))
                chunk = (16, 65_552)[i % 2]
                x = make_inputs(world, chunk, torch.bfloat16, gen)
                calls.append((f"all-gather after {forced}", x, gather_flagfree(sim, x, chunk)))
            torch.cuda.synchronize()
        finally:
            for r in range(world):
                sim.lib.symcomm_fp4_debug_grid(sim.ctxs[r], 0, 0, 0)
        for what, x, y in calls:
            if what.startswith("fp4"):
                check(y, expected(x, 1.0), f"world {world} {what}")
            else:
                check_gathered(x, y, f"world {world} {what}")
        assert all(sim.alarm(r) == 0 for r in range(world))


def test_the_hook_refuses_blocks_too_small_to_keep_the_turn():
    with SimWorld(2) as sim:
        for bad in ((1, 64, 0), (1, 1100, 0), (1, 200, 0), (-1, 512, 0)):
            assert sim.lib.symcomm_fp4_debug_grid(sim.ctxs[0], *bad) != 0, bad
        assert sim.lib.symcomm_fp4_debug_grid(sim.ctxs[0], 0, 0, 0) == 0


def test_a_rank_with_no_rows_does_not_run_ahead():
    """Rows (0, n): rank 0 has no rows and sends only a placeholder, and it starts late. Three
    calls per rank go in with no wait between ranks; every output must be right and no rank may
    give up (without the placeholder, rank 1, which receives nothing else, would not wait for
    rank 0 and would write its third call into a buffer rank 0 has yet to clear)."""
    world, h = 2, 7168
    sizes = [0, 40]
    gen = torch.Generator().manual_seed(77)
    with SimWorld(world) as sim:
        first = [rows_of(n, h, torch.bfloat16, gen) for n in sizes]
        first_out = [outputs_at(sum(sizes), h, 0) for _ in range(world)]
        launch(sim, first, sizes, 2.0, first_out)
        calls = []
        for k in range(3):
            xs = [rows_of(n, h, torch.bfloat16, gen) for n in sizes]
            outs = [outputs_at(sum(sizes), h, 0) for _ in range(world)]
            calls.append((xs, outs))
        def all_three(r: int, stream: torch.cuda.Stream) -> None:
            for xs, outs in calls:
                enqueue(sim, r, xs, sizes, 2.0, outs, stream)

        sim.each_rank(all_three, late=0)
        torch.cuda.synchronize()
        assert [sim.alarm(r) for r in range(world)] == [0, 0]
        for i, (xs, outs) in enumerate([(first, first_out), *calls]):
            check(outs, expected(xs, 2.0), f"call {i}")


def test_a_rank_that_never_comes_fails_its_peers_within_the_bound():
    world, timeout_s, sizes, h = 4, 1.0, (2, 0, 5, 1), 48
    gen = torch.Generator().manual_seed(9)
    with SimWorld(world, timeout_s=timeout_s) as sim:
        xs = [rows_of(n, h, torch.bfloat16, gen) for n in sizes]
        outs = [outputs_at(sum(sizes), h, 0) for _ in range(world)]
        start = time.monotonic()
        launch(sim, xs, sizes, 1.0, outs, ranks=(0, 1, 3))  # rank 2 never launches
        torch.cuda.synchronize()
        assert timeout_s * 0.9 <= time.monotonic() - start < timeout_s + 10
        for r in (0, 1, 3):
            assert sim.alarm(r) >> 32 == ABORT_TIMEOUT and sim.alarm(r) & 0xFFFF == 2, hex(sim.alarm(r))


@pytest.mark.parametrize("gs", (-1.0, 0.0, float("nan"), float("inf")), ids=str)
def test_a_global_scale_validation_never_saw_still_arrives_whole(gs):
    """A device tensor's global scale is read by the kernel unvalidated (a check would need a
    host sync). Negative, zero, NaN or infinite, it must still put no sentinel word on the wire:
    every rank gets what the codec kernel writes with that scale, and no rank waits out its bound."""
    world, sizes, h = 2, (3, 2), 272
    gen = torch.Generator().manual_seed(13)
    with SimWorld(world, timeout_s=2.0) as sim:
        xs = [rows_of(n, h, torch.bfloat16, gen) for n in sizes]
        scale = torch.tensor([gs], device="cuda")
        outs = [outputs_at(sum(sizes), h, 0) for _ in range(world)]
        launch(sim, xs, sizes, scale, outs)
        torch.cuda.synchronize()
        assert [sim.alarm(r) for r in range(world)] == [0, 0]
        check(outs, expected(xs, scale), f"global scale {gs}")


def test_graph_replay_writes_what_the_codec_writes():
    world, sizes, h = 2, (3, 5), 272
    gen = torch.Generator().manual_seed(11)
    with SimWorld(world) as sim:
        xs = [rows_of(n, h, torch.float16, gen) for n in sizes]
        gs = torch.tensor([3.0], device="cuda")
        outs = [outputs_at(sum(sizes), h, 5) for _ in range(world)]
        graphs = []
        for r in range(world):  # one graph per rank, replayed on its own stream, as ranks would
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(sim.streams[r]), torch.cuda.graph(graph, stream=sim.streams[r]):
                enqueue(sim, r, xs, sizes, gs, outs, sim.streams[r])
            graphs.append(graph)

        def replay():
            torch.cuda.synchronize()
            for r in range(world):
                with torch.cuda.stream(sim.streams[r]):
                    graphs[r].replay()
            torch.cuda.synchronize()

        replay()
        check(outs, expected(xs, gs), "first replay")
        for p, sc in outs:
            p.fill_(1), sc.fill_(1)
        xs[1].mul_(-2.0)
        gs.fill_(0.5)
        replay()
        check(outs, expected(xs, gs), "replay with new rows and scale")
        assert all(sim.alarm(r) == 0 for r in range(world))
