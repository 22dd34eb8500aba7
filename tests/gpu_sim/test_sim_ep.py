"""MoE dispatch and combine on the peer-push kernels (csrc/ep.cu) with simulated ranks
(tests/gpu_sim/_sim.py), W = 2, 4 and 8, through the production descriptors and paths (each
rank a Router holding its peer-push paths, as a Communicator runs them).

Every buffer peers write (received rows and scales, recv_src, the counts table, returned) stands
in for a symmetric-pool region, mapped the way map_regions would. Checked bit for bit against the
single-process loop reference (tests/_ep_reference.py): the receive layout, every received row
(NVFP4 against fp4.quantize_reference of the row, FP8 against symcomm.ep.fp8), send_rows, and
the combined tokens; graph replay against eager; a rank that never arrives makes the others
raise the alarm within the bound. Timings here are never performance.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from _sim import SimWorld
from symcomm import DtypeError, fp4
from symcomm.backends.ep_push import PushCombinePath, PushDispatchPath
from symcomm.dispatch import Router, builtin_table
from symcomm.ep import fp8
from symcomm.operations import ALL_TO_ALLV, MOE_COMBINE, MOE_DISPATCH
from symcomm.operations.moe_dispatch import PUSH, Dispatched, EpHandle, buffer_specs, row_bytes
from symcomm.peer.context import ABORT_MISMATCH, ABORT_TIMEOUT
from symcomm.peer.setup import SharedContext
from test_sim_peer_gather import _each_rank, _map_region, _region_tensor

# The loop reference lives beside the CPU tests, which hold the a2a path and the CPU twin to it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _ep_reference import encode, group_mismatches, random_case, world_combine, world_dispatch, world_groups  # noqa: E402

# (tokens per rank, experts, top-k, align, quant, swizzle, hidden): zero-token ranks, one token,
# top-k 1..8, 12 and 32 (past one group of the sum's loads), experts nobody picks (few tokens,
# many experts), alignment, the three encodings, and thousands of entries (a counting warp's run
# of many 32-entry chunks, and entries past the dispatch's shared cache of rows). The last case of
# each world passes the built-in dedup threshold (4 MiB of rows per rank: about 300 rows of hidden
# 7168); the cases of small rows reach dedup only at DEDUP's "always". Every third case but the
# last repeats experts within tokens (an entry naming its token's expert again sends nothing), and
# hidden 144 gives NVFP4 rows nine scales, a short last group of the swizzled layout's four.
CASES = {
    2: [((0, 5), 4, 1, 1, None, False, 256), ((7, 3), 8, 2, 4, "nvfp4", False, 256),
        ((1, 9), 16, 8, 1, "fp8", False, 256), ((4, 0), 6, 3, 128, "nvfp4", True, 7168),
        ((3, 2), 32, 12, 1, None, False, 256), ((700, 651), 256, 8, 1, None, False, 128),
        ((260, 300), 32, 5, 1, "nvfp4", False, 144), ((5, 6), 16, 4, 1, "nvfp4", True, 144),
        ((48, 44), 256, 8, 1, None, False, 7168)],
    4: [((3, 0, 5, 1), 8, 4, 1, None, False, 7168), ((0, 0, 2, 0), 64, 7, 2, "fp8", False, 128),
        ((6, 6, 6, 6), 16, 5, 1, "nvfp4", False, 512), ((2, 9, 1, 4), 4, 3, 8, None, False, 136),
        ((2, 1, 0, 3), 64, 32, 1, "fp8", False, 256), ((300, 0, 530, 129), 64, 8, 2, "fp8", False, 128),
        ((140, 130, 150, 120), 16, 5, 8, "nvfp4", True, 256), ((44, 48, 40, 46), 64, 8, 2, None, False, 7168)],
    8: [((1, 0, 3, 2, 0, 4, 1, 2), 16, 6, 1, None, False, 256), ((5,) * 8, 64, 8, 1, "nvfp4", True, 256),
        ((0, 2, 0, 0, 3, 0, 0, 1), 256, 8, 4, "fp8", False, 384),
        ((90, 0, 110, 85, 80, 150, 1, 120), 256, 8, 1, None, False, 136),
        ((44, 40, 48, 44, 42, 46, 44, 45), 256, 8, 1, None, False, 7168)],
}


@pytest.fixture(autouse=True)
def _torch_kernels_loaded(_gpu):
    """Load every torch kernel the test runs between ranks' launches before any rank spins: with
    lazy module loading a first launch waits for the device to be idle, and a simulated rank
    spinning for its peers never is (the EP kernels load themselves: csrc/ep.cu's preload)."""
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    fp4.dequantize(*fp4.quantize(x, 1.0), 1.0, torch.bfloat16)
    fp8.dequantize(*fp8.quantize(x), torch.bfloat16) * 2
    x.clone().fill_(3)
    torch.cuda.synchronize()


class SimComm:
    """One simulated rank's moe_dispatch and moe_combine as a Communicator runs them (validate
    once -> choose -> run -> result), without check mode."""

    def __init__(self, sim: SimWorld, rank: int):
        self.rank, self.world_size = rank, sim.world
        self.device = torch.device("cuda", sim.device)
        ops = (MOE_DISPATCH, MOE_COMBINE, ALL_TO_ALLV)
        self.router = Router(builtin_table(sim.world), {op.name: op for op in ops}, rank)
        for path in (PushDispatchPath(SharedContext(sim.state(rank))), PushCombinePath(SharedContext(sim.state(rank)))):
            self.router.add(path, None)

    def _run(self, op, *args, **kwargs):
        call = op.build(self, *args, **kwargs)
        path, choice = self.router.choose(op, call, "auto", explain=True)
        assert path.name == PUSH, choice
        path.run(call)
        return op.result(call)

    def moe_dispatch(self, *args, **kwargs) -> Dispatched:
        return self._run(MOE_DISPATCH, *args, **kwargs)

    def moe_combine(self, *args, **kwargs) -> torch.Tensor:
        return self._run(MOE_COMBINE, *args, **kwargs)


def _buffers(sim: SimWorld, tokens: int, hidden: int, k: int, experts: int, align: int, quant, swizzle,
             dtype: torch.dtype) -> list[Dispatched]:
    """Per rank, every buffer of a dispatch, the ones peers write each alone in its granules and
    mapped into a slot per kind, as pool regions would be."""
    world = sim.world
    specs = buffer_specs(world, tokens, k, experts, hidden, dtype, quant, swizzle, align)
    scales_spec = specs.get("out.scales")
    kinds = [specs["out.x"], scales_spec or ((16,), torch.uint8)] + [
        specs[name] for name in ("handle.recv_src", "handle.table", "handle.returned", "handle.recv_group")]
    per_kind = []
    for number, (shape, kind_dtype) in enumerate(kinds):
        raw = [_region_tensor(shape, torch.uint8 if kind_dtype.itemsize == 1 else kind_dtype, 0) for _ in range(world)]
        per_kind.append([t.view(kind_dtype) if kind_dtype.itemsize == 1 else t for t in raw])
        _map_region(sim, per_kind[-1], number)
    local = experts // world
    out = []
    for r in range(world):
        offsets = torch.zeros(local + 1, dtype=torch.int32, device="cuda")
        handle = EpHandle(torch.full((tokens, k), -7, dtype=torch.int32, device="cuda"), per_kind[2][r], offsets,
                          per_kind[3][r], per_kind[4][r], per_kind[5][r], None, None, experts, tokens, align, dtype)
        out.append(Dispatched(per_kind[0][r], per_kind[1][r] if scales_spec else None,
                              torch.zeros(local, dtype=torch.int32, device="cuda"), offsets, handle, None))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _full_ranks(sim: SimWorld, tokens: int, hidden: int, k: int, experts: int, seed: int):
    """Every rank's SimComm, bf16 dispatch buffers, ``tokens`` random tokens (with top-k ids and
    weights) on the GPU, and a stream: the setup of the tests where ranks stall or disagree."""
    world = sim.world
    comms = [SimComm(sim, r) for r in range(world)]
    bufs = _buffers(sim, tokens, hidden, k, experts, 1, None, False, torch.bfloat16)
    xs, ids, ws = random_case(world, [tokens] * world, hidden, experts, k, seed=seed)
    xs, ids, ws = ([t.cuda() for t in ts] for ts in (xs, ids, ws))
    return comms, bufs, xs, ids, ws, [torch.cuda.Stream() for _ in range(world)]


def _check_received(got: Dispatched, rec, xs, quant, gs, swizzle, hidden, where: str) -> None:
    assert got.expert_counts.tolist() == rec.counts, where
    assert got.expert_offsets.tolist() == rec.offsets, where
    assert got.handle.recv_src[:rec.offsets[-1]].tolist() == rec.recv_src, where
    assert got.handle.table[:, :-1].tolist() == rec.table, where
    filled = sorted(rec.rows)
    if not filled:
        return
    want = [encode(xs[q][t:t + 1].cpu(), quant, gs) for q, t in (rec.rows[r] for r in filled)]
    rows = _bytes(got.x).cpu()[filled].reshape(len(filled), -1)
    assert torch.equal(rows, torch.cat([_bytes(w[0]).reshape(1, -1) for w in want])), f"{where}: rows"
    if quant is not None:
        scales = got.scales.cpu()
        if swizzle:
            scales = fp4.unswizzle_scales(scales, got.x.shape[0], hidden // 16)
        got_scales = _bytes(scales)[filled].reshape(len(filled), -1)
        assert torch.equal(got_scales, torch.cat([_bytes(w[1]).reshape(1, -1) for w in want])), f"{where}: scales"


# expand_duplicates' threshold (valid entries per rank): the built-in one, which only the cases
# of hundreds of large rows pass; 0, so that every case sends a token once per peer; and one no
# case reaches, so that the cases past the built-in threshold also run with a row per entry.
DEDUP = {"builtin": None, "always": 0, "never": 1 << 40}
BUILTIN_DEDUP_BYTES = 4 << 20  # csrc/ep.cu's kDedupFromBytes


def _dedups(dedup: str, received, world: int, row_size: int) -> bool:
    """Whether a dispatch sends each token once per peer: every rank's valid entries against the
    threshold times the world (csrc/ep.cu's decision, from the counts table every rank sees)."""
    entries = sum(sum(rec.counts) for rec in received)
    builtin = -(-BUILTIN_DEDUP_BYTES // row_size)
    threshold = builtin if DEDUP[dedup] is None else DEDUP[dedup]
    return world > 1 and entries >= threshold * world


@pytest.mark.parametrize("dedup", sorted(DEDUP))
@pytest.mark.parametrize("world", sorted(CASES))
def test_peer_dispatch_and_combine_equal_the_reference(world, dedup):
    for i, (tokens, experts, k, align, quant, swizzle, hidden) in enumerate(CASES[world]):
        dtype = torch.float16 if i % 2 else torch.bfloat16
        max_tokens = max(tokens) + 1
        repeat = 0.25 if i % 3 == 1 and i < len(CASES[world]) - 1 else 0.0
        xs, ids, ws = random_case(world, list(tokens), hidden, experts, k, seed=world * 31 + i, dtype=dtype,
                                  ids_dtype=torch.int32 if i % 2 else torch.int64, repeat=repeat)
        amax = max((float(x.float().abs().max()) for x in xs if x.numel()), default=1.0)
        gs_value = 448.0 * 6 / amax
        # NVFP4's global scale as a float on even cases, a device tensor (read by the kernel) on odd ones
        gs = (gs_value if i % 2 == 0 else torch.tensor([gs_value], device="cuda")) if quant == "nvfp4" else None
        where = f"world {world} case {i} tokens {tokens} E {experts} k {k} align {align} {quant} {dtype}"
        with SimWorld(world, graph_slots=8) as sim:
            for r in range(world):
                sim.state(r).set_ep_dedup_from(DEDUP[dedup])
            comms = [SimComm(sim, r) for r in range(world)]
            bufs = _buffers(sim, max_tokens, hidden, k, experts, align, quant, swizzle, dtype)
            xd = [x.cuda() for x in xs]
            idd = [t.cuda() for t in ids]
            wd = [w.cuda() for w in ws]
            got = [None] * world
            streams = [torch.cuda.Stream() for _ in range(world)]

            def dispatch(r):
                got[r] = comms[r].moe_dispatch(xd[r], idd[r], wd[r], experts, max_tokens=max_tokens, quant=quant,
                                               global_scale=gs, align=align, swizzle=swizzle, out=bufs[r])

            _each_rank(sim, streams, dispatch)
            received, send_rows = world_dispatch(ids, experts, max_tokens, align)
            groups = world_groups(ids, ws, send_rows, experts, max_tokens)
            for r in range(world):
                _check_received(got[r], received[r], xs, quant, gs_value, swizzle, hidden, f"{where} rank {r}")
                assert torch.equal(got[r].handle.send_rows[:tokens[r]].cpu(), send_rows[r]), where
                wrong = group_mismatches(got[r].handle.recv_group, groups[r])
                assert not wrong, f"{where} rank {r}: recv_group {wrong[:3]}"
            # The dispatch met every block (the dedup path) exactly when the threshold says so.
            meetings = int(_dedups(dedup, received, world, row_bytes(hidden, dtype, quant)))
            if dedup == "builtin" and i == len(CASES[world]) - 1:
                assert meetings == 1, f"{where}: the last case is meant to pass the built-in threshold"
            assert [sim.meetings(r) for r in range(world)] == [meetings] * world, f"{where} {dedup}"
            # Expert outputs drawn per rank in the received layout, summed back
            gen = torch.Generator().manual_seed(i)
            outs = [torch.randn(got[r].x.shape[0], hidden, generator=gen).to(dtype) for r in range(world)]
            for combine_quant in (None, "fp8") if hidden % fp8.BLOCK == 0 else (None,):
                combined = [None] * world
                outs_d = [o.cuda() for o in outs]

                def combine(r):
                    combined[r] = comms[r].moe_combine(outs_d[r], got[r].handle, quant=combine_quant)

                _each_rank(sim, streams, combine)
                want = world_combine(ids, ws, send_rows, outs, experts, combine_quant)
                for r in range(world):
                    assert torch.equal(_bytes(combined[r].cpu()), _bytes(want[r])), f"{where} combine {combine_quant}"
                meetings += 1
            assert [sim.meetings(r) for r in range(world)] == [meetings] * world, where
            assert all(sim.alarm(r) == 0 for r in range(world)), where


def test_calls_that_dedup_and_calls_that_do_not_interleave():
    """One world alternates dispatches that send each token once per peer with dispatches that send
    a row per entry, eagerly and then as graphs captured under one setting and replayed after eager
    calls under the other: every call gives the reference's rows and sums, and each rank's count of
    meetings grows by one per combine and one per deduplicating dispatch, so each call took the
    path its setting asked for."""
    world, experts, k, hidden, tokens = 2, 16, 6, 256, 37
    with SimWorld(world, graph_slots=16) as sim:
        comms, bufs, xs, ids, ws, streams = _full_ranks(sim, tokens, hidden, k, experts, seed=29)
        cpu_ids, cpu_ws = [t.cpu() for t in ids], [t.cpu() for t in ws]
        received, send_rows = world_dispatch(cpu_ids, experts, tokens, 1)
        gen = torch.Generator().manual_seed(5)
        outs = [torch.randn(bufs[r].x.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in range(world)]
        outs_d = [o.cuda() for o in outs]
        want = world_combine(cpu_ids, cpu_ws, send_rows, outs, experts)
        got, combined = [None] * world, [None] * world

        def step(r):
            got[r] = comms[r].moe_dispatch(xs[r], ids[r], ws[r], experts, max_tokens=tokens, out=bufs[r])
            combined[r] = comms[r].moe_combine(outs_d[r], got[r].handle)

        def check(where: str, results=None) -> None:
            for r, (dispatched, summed) in enumerate(results or zip(got, combined)):
                _check_received(dispatched, received[r], xs, None, None, False, hidden, f"{where} rank {r}")
                assert torch.equal(_bytes(summed.cpu()), _bytes(want[r])), f"{where} rank {r}"

        def use(dedup: str) -> None:
            for r in range(world):
                sim.state(r).set_ep_dedup_from(DEDUP[dedup])

        meetings = 0
        for dedup in ("always", "never", "always", "builtin", "always"):
            use(dedup)
            _each_rank(sim, streams, step)
            check(f"eager {dedup}")
            meetings += 1 + int(_dedups(dedup, received, world, row_bytes(hidden, torch.bfloat16, None)))
            assert [sim.meetings(r) for r in range(world)] == [meetings] * world, dedup
        graphs, captured = {}, {}
        for dedup in ("always", "never"):
            use(dedup)
            graphs[dedup], captured[dedup] = [], []
            for r in range(world):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                    step(r)
                graphs[dedup].append(g)
                captured[dedup].append((got[r], combined[r]))
        for replayed, eager in (("always", "never"), ("never", "always"), ("always", "always")):
            use(eager)
            _each_rank(sim, streams, step)
            check(f"eager {eager}")
            # Graphs keep the launches they captured, with the setting of their capture.
            for _, summed in captured[replayed]:
                summed.fill_(7)
            _each_rank(sim, streams, lambda r: graphs[replayed][r].replay())
            check(f"replayed {replayed} after eager {eager}", captured[replayed])
            meetings += 2 + int(eager == "always") + int(replayed == "always")
            assert [sim.meetings(r) for r in range(world)] == [meetings] * world, (replayed, eager)
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("dedup", ["builtin", "always"])
def test_replay_equals_eager_and_reuses_the_buffers(dedup):
    """dispatch + a stand-in expert + combine captured once per rank, replayed with new tokens:
    the same bits as the eager calls on those tokens. Eagerly the three run as three passes over
    the ranks (a rank's torch kernels must not be first loaded while its dispatch spins for a
    peer its host thread has not launched yet); a graph holds all three."""
    world, experts, k, hidden, max_tokens = 4, 16, 4, 512, 6
    with SimWorld(world, graph_slots=8) as sim:
        for r in range(world):
            sim.state(r).set_ep_dedup_from(DEDUP[dedup])
        comms = [SimComm(sim, r) for r in range(world)]
        bufs = _buffers(sim, max_tokens, hidden, k, experts, 1, "fp8", False, torch.bfloat16)
        streams = [torch.cuda.Stream() for _ in range(world)]
        static = [(torch.zeros(max_tokens, hidden, dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(max_tokens, k, dtype=torch.int64, device="cuda"),
                   torch.zeros(max_tokens, k, device="cuda")) for _ in range(world)]
        got, expert_out, outs = [None] * world, [None] * world, [None] * world

        def dispatch(r):
            x, ids, w = static[r]
            got[r] = comms[r].moe_dispatch(x, ids, w, experts, max_tokens=max_tokens, quant="fp8", out=bufs[r])

        def expert(r):
            expert_out[r] = fp8.dequantize(got[r].x, got[r].scales, torch.bfloat16) * 2

        def combine(r):
            outs[r] = comms[r].moe_combine(expert_out[r], got[r].handle, quant="fp8")

        def load(seed):
            xs, ids, ws = random_case(world, [max_tokens] * world, hidden, experts, k, seed=seed)
            for r in range(world):
                for dst, src in zip(static[r], (xs[r], ids[r], ws[r])):
                    dst.copy_(src)

        def eager():
            for phase in (dispatch, expert, combine):
                _each_rank(sim, streams, phase)
            return [o.clone() for o in outs]

        load(1)
        eager()  # every kernel loaded, on an idle device, before any capture
        graphs = []
        for r in range(world):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                dispatch(r)
                expert(r)
                combine(r)
            graphs.append(g)
        captured = list(outs)
        for seed in (2, 3):
            load(seed)
            want = eager()
            for o in captured:
                o.fill_(7)
            load(seed)
            _each_rank(sim, streams, lambda r: graphs[r].replay())
            for r in range(world):
                assert torch.equal(_bytes(captured[r]), _bytes(want[r])), f"replay {seed} rank {r}"
            assert any(w.abs().sum() > 0 for w in want)
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("missing_from", ["dispatch", "combine"])
def test_a_stalled_rank_raises_the_alarm_within_the_bound(missing_from):
    """Rank 2 never dispatches, or dispatches and never combines (whose blocks wait for every block
    of every peer before they add): the others stop within the bound and name rank 2, and a stopped
    rank's later calls return at once without writing."""
    world, timeout_s, experts, k, hidden, max_tokens = 4, 1.0, 8, 2, 256, 3
    with SimWorld(world, timeout_s=timeout_s, graph_slots=8) as sim:
        comms, bufs, xs, ids, ws, streams = _full_ranks(sim, max_tokens, hidden, k, experts, seed=5)
        got = [None] * world

        def dispatch(r):
            got[r] = comms[r].moe_dispatch(xs[r], ids[r], ws[r], experts, max_tokens=max_tokens, out=bufs[r])

        outs = []

        def combine(r):
            comms[r].moe_combine(outs[r], got[r].handle)

        if missing_from == "combine":
            _each_rank(sim, streams, dispatch)
            assert all(sim.alarm(r) == 0 for r in range(world))
            outs += [torch.randn(got[r].x.shape[0], hidden, device="cuda").to(torch.bfloat16) for r in range(world)]
        stalled = combine if missing_from == "combine" else dispatch
        start = time.monotonic()
        _each_rank(sim, streams, lambda r: stalled(r) if r != 2 else None)
        elapsed = time.monotonic() - start
        assert timeout_s * 0.9 <= elapsed < timeout_s + 10, elapsed
        for r in (0, 1, 3):
            alarm = sim.alarm(r)
            assert alarm >> 32 == ABORT_TIMEOUT and alarm & 0xFFFF == 2, hex(alarm)
        # A sentinel no dispatch writes (an earlier dispatch's bytes would be written again alike).
        bufs[0].handle.recv_src.fill_(-7)
        start = time.monotonic()
        _each_rank(sim, streams, lambda r: dispatch(r) if r == 0 else None)
        assert time.monotonic() - start < timeout_s * 0.5, "a stopped rank's dispatch waited"
        assert bool((bufs[0].handle.recv_src == -7).all()), "a stopped rank's dispatch wrote"


def test_ranks_that_disagree_on_sizes_stop_before_any_row_moves():
    """Rank 1 states max_tokens 1 and rank 0 states 4, so their receive buffers differ in size.
    The counts table, which dispatch allocates first (its shape follows the world and the experts
    alone), still sits at one offset: both ranks find the other's fingerprint there and raise the
    alarm naming it, before any row moves."""
    world, experts, k, hidden = 2, 2, 1, 128
    with SimWorld(world, timeout_s=5.0, graph_slots=16) as sim:
        comms = [SimComm(sim, r) for r in range(world)]
        big = _buffers(sim, 4, hidden, k, experts, 1, None, False, torch.bfloat16)
        small = _buffers(sim, 1, hidden, k, experts, 1, None, False, torch.bfloat16)[1]
        h = small.handle
        small = small._replace(handle=EpHandle(h.send_rows, h.recv_src, h.expert_offsets, big[1].handle.table,
                                               h.returned, h.recv_group, None, None, experts, 1, 1, torch.bfloat16))
        x = torch.randn(4, hidden, dtype=torch.bfloat16, device="cuda")
        ids = torch.ones(4, 1, dtype=torch.int64, device="cuda")
        w = torch.ones(4, 1, device="cuda")
        before = [big[0].handle.recv_src.clone(), small.handle.recv_src.clone(), big[1].handle.recv_src.clone()]

        def launch(r):
            if r == 0:
                comms[0].moe_dispatch(x, ids, w, experts, max_tokens=4, out=big[0])
            else:
                comms[1].moe_dispatch(x[:1], ids[:1], w[:1], experts, max_tokens=1, out=small)

        _each_rank(sim, [torch.cuda.Stream() for _ in range(world)], launch)
        for r in range(world):
            assert sim.alarm(r) >> 32 == ABORT_MISMATCH and sim.alarm(r) & 0xFFFF == 1 - r, hex(sim.alarm(r))
        after = [big[0].handle.recv_src, small.handle.recv_src, big[1].handle.recv_src]
        assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_ranks_that_disagree_on_the_dedup_threshold_stop_at_once():
    """The threshold from which a token crosses once per peer is part of the fingerprint (one rank
    would send markers the other never expands): rank 0 dedups every call, rank 1 keeps the
    built-in threshold, and both raise the mismatch alarm naming the other before any row moves.
    It also shows the testing hook reaches the kernels, which the equality tests alone cannot."""
    world, experts, k, hidden, tokens = 2, 4, 2, 256, 3
    with SimWorld(world, timeout_s=5.0, graph_slots=16) as sim:
        sim.state(0).set_ep_dedup_from(0)
        comms, bufs, xs, ids, ws, streams = _full_ranks(sim, tokens, hidden, k, experts, seed=23)
        before = [b.handle.recv_src.clone() for b in bufs]
        started = time.monotonic()
        _each_rank(sim, streams, lambda r: comms[r].moe_dispatch(xs[r], ids[r], ws[r], experts, max_tokens=tokens,
                                                                out=bufs[r]))
        assert time.monotonic() - started < 4.0
        for r in range(world):
            assert sim.alarm(r) >> 32 == ABORT_MISMATCH and sim.alarm(r) & 0xFFFF == 1 - r, hex(sim.alarm(r))
        assert all(torch.equal(b.handle.recv_src, a) for b, a in zip(bufs, before))


@pytest.mark.parametrize("differs", ["dispatch dtype", "combine quant"])
def test_ranks_that_disagree_on_encoding_stop_at_once(differs):
    """fp16 and bf16 rows have the same bytes, and a combine's quant is each rank's own argument:
    the dispatch's fingerprint and the combine's meeting flags carry them, so every rank raises
    the mismatch alarm naming its peer at once (not at the timeout), and the combine writes no
    output."""
    world, experts, k, hidden, tokens, timeout_s = 2, 4, 2, 256, 3, 5.0
    with SimWorld(world, timeout_s=timeout_s, graph_slots=16) as sim:
        comms, bufs, xs, ids, ws, streams = _full_ranks(sim, tokens, hidden, k, experts, seed=17)
        phase = 1 if differs == "dispatch dtype" else 2
        if differs == "dispatch dtype":
            # rank 1's fp16 buffers, at the counts table rank 0 writes to (as in the test above)
            half = _buffers(sim, tokens, hidden, k, experts, 1, None, False, torch.float16)[1]
            h = half.handle
            bufs[1] = half._replace(handle=EpHandle(h.send_rows, h.recv_src, h.expert_offsets, bufs[1].handle.table,
                                                    h.returned, h.recv_group, None, None, experts, tokens, 1,
                                                    torch.float16))
            xs[1] = xs[1].to(torch.float16)
            before = [b.handle.recv_src.clone() for b in bufs]
            outs = None
        else:
            got = [None] * world

            def agreeing(r):
                got[r] = comms[r].moe_dispatch(xs[r], ids[r], ws[r], experts, max_tokens=tokens, out=bufs[r])

            _each_rank(sim, streams, agreeing)
            assert all(sim.alarm(r) == 0 for r in range(world))
            ys = [torch.randn(got[r].x.shape[0], hidden, device="cuda").to(torch.bfloat16) for r in range(world)]
            outs = [torch.full((tokens, hidden), float("nan"), device="cuda").to(torch.bfloat16) for _ in range(world)]

        def launch(r):
            if outs is None:
                comms[r].moe_dispatch(xs[r], ids[r], ws[r], experts, max_tokens=tokens, out=bufs[r])
            else:
                comms[r].moe_combine(ys[r], got[r].handle, quant="fp8" if r == 1 else None, out=outs[r])

        start = time.monotonic()
        _each_rank(sim, streams, launch)
        assert time.monotonic() - start < timeout_s * 0.8
        for r in range(world):
            alarm = sim.alarm(r)
            assert (alarm >> 32, (alarm >> 16) & 0xFFFF, alarm & 0xFFFF) == (ABORT_MISMATCH, phase, 1 - r), hex(alarm)
        if outs is None:
            assert all(torch.equal(b.handle.recv_src, was) for b, was in zip(bufs, before))
        else:
            assert all(bool(o.isnan().all()) for o in outs)


def test_the_paths_decline_what_the_kernels_cannot_take():
    world = 2
    with SimWorld(world, graph_slots=8) as sim:
        comm = SimComm(sim, 0)
        x = torch.zeros(2, 128, dtype=torch.float32, device="cuda")
        ids = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
        w = torch.ones(2, 1, device="cuda")
        call = MOE_DISPATCH.build(comm, x, ids, w, 2, max_tokens=2)  # buffers outside any mapped region
        reason = comm.router.paths_of(MOE_DISPATCH.name)[PUSH].why_not(call)
        assert "not in a mapped symmetric pool region" in reason, reason
        with pytest.raises(DtypeError, match="quant='fp8' takes bfloat16 or float16 x"):  # on every path
            MOE_DISPATCH.build(comm, x, ids, w, 2, max_tokens=2, quant="fp8")
