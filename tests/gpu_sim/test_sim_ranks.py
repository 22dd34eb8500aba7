"""symcomm's peer kernels with W simulated ranks on ONE GPU (tests/gpu_sim/_sim.py).

What this proves: the barrier, epoch, sentinel and indexing logic of the flag-free, one-shot
and two-shot kernels, for worlds of 2, 4 and 8, with W real concurrent kernels that write and
spin on each other's memory exactly as real ranks do. What it does not: anything about NVLink
(the "peers" are this GPU's own memory) or real timing; its run times are not performance.
Plain pytest, no torchrun. Skips without CUDA; SYMCOMM_REQUIRE_GPU=1 turns the skip into a
failure so a GPU run cannot pass by skipping.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from symcomm import _native
from symcomm.backends.custom_ar import ALGO_CODES
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT
from _sim import (ALGOS, DTYPES, MAX_BLOCKS, STAGING_BYTES, SimWorld, cannot_run, capacity, check_outputs,
                  make_inputs)

WORLDS = (2, 4, 8)
# Bytes: one vector, an odd vector count, two pages and a vector, flag-free's whole capacity,
# and (one-shot/two-shot only) their whole staging buffer.
SIZES = (16, 1008, 4096 * 2 + 16, 256 << 10, 2 << 20)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_the_rank_order_sum(world, dtype, algo):
    gen = torch.Generator().manual_seed(world * 100 + ALGOS.index(algo))
    with SimWorld(world) as sim:
        for nbytes in (s for s in SIZES if s <= capacity(algo)):
            x = make_inputs(world, nbytes, dtype, gen)
            y = [torch.full_like(t, 7.0) for t in x]
            sim.launch(algo, dtype, x, y)
            torch.cuda.synchronize()
            check_outputs(y, x, f"{algo} {dtype} world {world} {nbytes} B")


@pytest.mark.parametrize("world", WORLDS)
def test_many_calls_in_a_row_alternating_kernels(world):
    """200 calls enqueued back to back, synchronised once: ranks drift apart by whole calls,
    epochs climb, and the flag-free kernel rotates its three receive buffers across calls of
    different sizes (each clears what the call before last left, by that call's size). Every
    input is made first: its copy to the GPU would wait for every rank's calls so far."""
    gen = torch.Generator().manual_seed(world)
    sizes = (16, 1008, 4096 * 2 + 16, 65_552, 256 << 10)  # 5 sizes against 3 kernels: all pairs meet
    plan = [(ALGOS[i % 3], DTYPES[(i // 3) % 3], sizes[i % len(sizes)]) for i in range(200)]
    inputs = [make_inputs(world, nbytes, dtype, gen) for _, dtype, nbytes in plan]
    calls = []
    with SimWorld(world) as sim:
        for i, ((algo, dtype, nbytes), x) in enumerate(zip(plan, inputs)):
            y = [torch.full_like(t, 7.0) for t in x]
            sim.launch(algo, dtype, x, y)
            calls.append((f"call {i} {algo} {dtype} {nbytes} B", x, y))
        torch.cuda.synchronize()
    for what, x, y in calls:
        check_outputs(y, x, f"world {world} {what}")


@pytest.mark.parametrize("world", WORLDS)
def test_one_shot_in_place_sums_through_scratch_and_copies_back(world):
    """symcomm_ar_oneshot_in_place, the in-place one-shot of a pool input: every rank reads the
    others' inputs through a slot, sums into its scratch, and after the end barrier copies the
    sums over its own input, eight vectors a thread at a time and then the tail. The vector
    counts give a one-block grid, threads with a tail and no eight-vector pass, one pass and no
    tail, one pass and a tail, and two passes with tails of 5 and 6. The bits equal the
    out-of-place one-shot's, which the reference checks."""
    gen = torch.Generator().manual_seed(world + 1000)
    with SimWorld(world, graph_slots=2) as sim:
        stride = MAX_BLOCKS * 512  # the grid's threads: each thread copies every stride-th vector
        for nvec in (1, 8 * stride - 1, 8 * stride, 8 * stride + 1, 16 * stride + 5 * stride + 3):
            nbytes = 16 * nvec
            for dtype in DTYPES:
                x = make_inputs(world, nbytes, dtype, gen)
                inout = [t.clone() for t in x]
                scratch = [torch.full_like(t, 7.0) for t in x]
                sim.link_slot(1, inout)

                def run(r, stream):
                    code = sim.lib.symcomm_ar_oneshot_in_place(sim.ctxs[r], _native.DTYPE_CODES[dtype], 1, 0,
                                                               scratch[r].data_ptr(), inout[r].data_ptr(), nbytes,
                                                               stream.cuda_stream)
                    assert code == 0, f"rank {r}: {code}"
                sim.each_rank(run)
                torch.cuda.synchronize()
                check_outputs(inout, x, f"in place {dtype} world {world} {nvec} vectors")


@pytest.mark.parametrize("in_place", (False, True), ids=("out_of_place", "in_place"))
@pytest.mark.parametrize("world", WORLDS)
def test_two_shot_by_stores_into_pool_outputs(world, in_place):
    """symcomm_ar_twoshot_push: every rank stores its input's chunks into their owners' memory
    (the following rank into the owner's output chunk, the others into areas of its scratch),
    the owner sums in rank order and stores the sum into every rank's output, at one offset of
    the region every rank holds in slot 1. In place, `own` is a copy of the rank's chunk taken
    before the launch. The sizes: one vector (most ranks own nothing), an odd vector count,
    chunks that do not divide evenly, and at world 2 twice the scratch buffer (no scratch is
    used there), else the most scratch holds. Two calls in a row each: the second starts from
    the epochs and scratch the first left. The bits equal the reference's on every rank."""
    gen = torch.Generator().manual_seed(world + 2000 + in_place)
    biggest = 2 * STAGING_BYTES if world == 2 else STAGING_BYTES // (world - 2) // 16 * 16 * world
    with SimWorld(world, graph_slots=2) as sim:
        for nbytes in (16, 1008, 16 * (3 * MAX_BLOCKS * 512 + 5), biggest):
            nvec = nbytes // 16
            chunk = -(-nvec // world) * 16
            for dtype in DTYPES:
                offset = 4096  # the output's offset in its region, the same on every rank
                regions = [torch.empty(offset + nbytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
                sim.link_slot(1, regions)
                outs = [t[offset:].view(dtype) for t in regions]
                for round_ in range(2):
                    x = make_inputs(world, nbytes, dtype, gen)
                    if in_place:
                        for r in range(world):
                            outs[r].copy_(x[r])
                    else:
                        for t in outs:
                            t.fill_(7.0)
                    ins = outs if in_place else x
                    owns = [t.view(torch.uint8)[min(r * chunk, nbytes):][:chunk].clone() if in_place else None
                            for r, t in enumerate(ins)]

                    def run(r, stream):
                        src = ins[r].data_ptr()
                        own = owns[r].data_ptr() if in_place and owns[r].numel() else src + min(r * chunk, nbytes)
                        code = sim.lib.symcomm_ar_twoshot_push(sim.ctxs[r], _native.DTYPE_CODES[dtype], src, own, 1,
                                                               offset, outs[r].data_ptr(), nbytes, stream.cuda_stream)
                        assert code == 0, f"rank {r}: {code}"
                    sim.each_rank(run)
                    torch.cuda.synchronize()
                    check_outputs(outs, x, f"two-shot by stores {dtype} world {world} {nbytes} B round {round_}"
                                           f"{' in place' if in_place else ''}")


@pytest.mark.parametrize("world", (4, 8))
def test_two_shot_by_stores_refuses_more_than_its_scratch_holds(world):
    """Above world 2 each rank keeps W-2 peers' chunks in its scratch, which the staging size
    bounds. One vector per chunk past that bound is refused with cudaErrorInvalidValue on every
    rank, before anything is launched: the call at the bound right after it pairs correctly."""
    gen = torch.Generator().manual_seed(world + 4000)
    dtype = torch.bfloat16
    biggest = STAGING_BYTES // (world - 2) // 16 * 16 * world
    offset = 4096
    with SimWorld(world, graph_slots=2) as sim:
        regions = [torch.empty(offset + biggest + 16 * world, dtype=torch.uint8, device="cuda") for _ in range(world)]
        sim.link_slot(1, regions)
        for nbytes, refused in ((biggest + 16 * world, True), (biggest, False)):
            x = make_inputs(world, nbytes, dtype, gen)
            outs = [t[offset:offset + nbytes].view(dtype) for t in regions]
            for t in outs:
                t.fill_(7.0)
            chunk = nbytes // world

            def run(r, stream):
                code = sim.lib.symcomm_ar_twoshot_push(sim.ctxs[r], _native.DTYPE_CODES[dtype], x[r].data_ptr(),
                                                       x[r].data_ptr() + r * chunk, 1, offset, outs[r].data_ptr(),
                                                       nbytes, stream.cuda_stream)
                want = 1 if refused else 0  # cudaErrorInvalidValue
                assert code == want, f"rank {r}, {nbytes} B: code {code}, want {want}"
            sim.each_rank(run)
            torch.cuda.synchronize()
            if refused:
                assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in outs), "a refused call wrote"
            else:
                check_outputs(outs, x, f"two-shot by stores at the scratch bound, world {world}, {nbytes} B")
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_two_shot_by_stores_back_to_back_with_the_other_kernels(world):
    """Two of every three calls are symcomm_ar_twoshot_push (in place and out of place in
    turn), the third one-shot, two-shot or flag-free, all enqueued on each rank's own stream
    with no synchronisation between calls; a rotating rank starts each call late. So ranks
    drift apart by whole calls while the push kernel's epochs and scratch meet the other
    kernels' on the same contexts. The bits of every call equal the reference's on every rank."""
    gen = torch.Generator().manual_seed(world + 3000)
    dtype = torch.bfloat16
    sizes = (16, 1008, 65_552, 262_160) + (((1 << 20) + 48,) if world == 2 else ())
    others = (ONESHOT, TWOSHOT, FLAGFREE)
    offset = 4096  # the push outputs' offset in their regions, the same on every rank
    with SimWorld(world, graph_slots=2) as sim:
        regions = [torch.empty(offset + max(sizes), dtype=torch.uint8, device="cuda") for _ in range(world)]
        sim.link_slot(1, regions)
        plan = []
        for i in range(36 if world == 2 else 24):
            kind = "push" if i % 3 else others[i // 3 % len(others)]
            nbytes = sizes[(i // 3 + i % 3) % len(sizes)]  # every size for the push, in place and not
            if kind != "push":
                nbytes = min(nbytes, capacity(kind))
            plan.append((kind, nbytes, i // 2 % 2 == 1, make_inputs(world, nbytes, dtype, gen)))
        here = torch.cuda.current_stream()
        for stream in sim.streams:
            stream.wait_stream(here)
        results = []
        for i, (kind, nbytes, in_place, x) in enumerate(plan):
            outs = []
            for r, stream in enumerate(sim.streams):
                with torch.cuda.stream(stream):
                    if r == i % world:
                        torch.cuda._sleep(200_000)
                    if kind == "push":
                        out = regions[r][offset:offset + nbytes].view(dtype)
                        chunk = -(-nbytes // 16 // world) * 16
                        lo = min(r * chunk, nbytes)
                        keep = None
                        if in_place:
                            out.copy_(x[r])
                            keep = out.view(torch.uint8)[lo:lo + chunk].clone()
                        src = out.data_ptr() if in_place else x[r].data_ptr()
                        own = keep.data_ptr() if keep is not None and keep.numel() else src + lo
                        code = sim.lib.symcomm_ar_twoshot_push(sim.ctxs[r], _native.DTYPE_CODES[dtype], src, own, 1,
                                                               offset, out.data_ptr(), nbytes, stream.cuda_stream)
                        outs.append(out.clone())  # on this stream, before the next call writes the region
                    else:
                        out = torch.empty_like(x[r])
                        code = sim.lib.symcomm_ar_run(sim.ctxs[r], ALGO_CODES[kind], _native.DTYPE_CODES[dtype],
                                                      x[r].data_ptr(), 0, 0, out.data_ptr(), nbytes, 1,
                                                      stream.cuda_stream)
                        outs.append(out)
                    assert code == 0, f"call {i}, rank {r}: {code}"
            results.append(outs)
        for stream in sim.streams:
            here.wait_stream(stream)
        torch.cuda.synchronize()
        assert all(sim.alarm(r) == 0 for r in range(world)), [hex(sim.alarm(r)) for r in range(world)]
    for i, ((kind, nbytes, in_place, x), outs) in enumerate(zip(plan, results)):
        check_outputs(outs, x, f"world {world} call {i}: {kind} {nbytes} B{' in place' if in_place else ''}")


def test_wide_push_grid_alternates_with_narrow_grids_at_world_2():
    """The push kernels' wide grid (kWideGridBlocks, from kWideFromBytes sent to a peer) on the
    same contexts as narrower grids: two_shot_push and gather_push, alternating 16 MiB + 32 B
    (the wide grid), 1 MiB + 48 B (the default cap) and 16 B (one block), twice over, so that
    blocks past the narrow grid meet at their own epochs between calls they sat out. The grid
    cap is the SM count (at most 128): two ranks' blocks must all be resident at once, two to an
    SM at world 2 (csrc/peer.cuh). The bits equal the reference's on every rank."""
    world = 2
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    max_blocks = min(128, sms)
    if max_blocks <= 64:
        cannot_run(f"{sms} SMs leave no grid wider than the default cap of 64 blocks")
    gen = torch.Generator().manual_seed(4242)
    dtype = torch.bfloat16
    sizes = [16 * ((16 << 20) // 16 + 2), 16 * ((1 << 20) // 16 + 3), 16] * 2
    with SimWorld(world, graph_slots=2, max_blocks=max_blocks) as sim:
        offset = 4096  # the outputs' offset in their regions, the same on every rank
        regions = [torch.empty(offset + max(sizes) * world, dtype=torch.uint8, device="cuda") for _ in range(world)]
        sim.link_slot(1, regions)
        for step, nbytes in enumerate(sizes):
            x = make_inputs(world, nbytes, dtype, gen)
            outs = [t[offset:offset + nbytes].view(dtype) for t in regions]
            for t in outs:
                t.fill_(7.0)

            def reduce(r, stream):
                own = x[r].data_ptr() + min(r * -(-nbytes // 16 // world) * 16, nbytes)
                code = sim.lib.symcomm_ar_twoshot_push(sim.ctxs[r], _native.DTYPE_CODES[dtype], x[r].data_ptr(), own,
                                                       1, offset, outs[r].data_ptr(), nbytes, stream.cuda_stream)
                assert code == 0, f"rank {r}: {code}"
            sim.each_rank(reduce)
            torch.cuda.synchronize()
            check_outputs(outs, x, f"two-shot by stores, step {step}, {nbytes} B")

            gathered = [t[offset:offset + world * nbytes] for t in regions]
            for t in gathered:
                t.fill_(0x5A)

            def gather(r, stream):
                one = ctypes.c_int * 1
                code = sim.lib.symcomm_ar_gatherv(sim.ctxs[r], 1, (ctypes.c_uint64 * 1)(x[r].data_ptr()), one(1),
                                                  (ctypes.c_uint64 * 1)(offset + r * nbytes),
                                                  (ctypes.c_uint64 * 1)(nbytes), world * nbytes, stream.cuda_stream)
                assert code == 0, f"rank {r}: {code}"
            sim.each_rank(gather)
            torch.cuda.synchronize()
            want = torch.cat([t.view(torch.uint8) for t in x])
            for r, t in enumerate(gathered):
                differ = (t != want).nonzero()
                assert differ.numel() == 0, f"gather by push, step {step}, {nbytes} B: rank {r} differs at " \
                                            f"{differ[:8].flatten().tolist()}"
