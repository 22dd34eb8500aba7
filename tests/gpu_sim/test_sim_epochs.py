"""Barrier epochs near the points where 32-bit epochs went wrong, with simulated ranks.

The barrier flags once held 32-bit epochs compared wrap-safely (int32(flag - epoch) >= 0). One-shot
never writes the `mid` flags and two-shot never writes `end`, so after 2^31 calls of one kind a
never-written flag (0) read as "arrived" and two-shot passed its middle barrier early. Flags and
epochs are 64-bit now; symcomm_ar_debug_seed_epochs (testing only) puts every rank at a chosen
epoch so these tests reach 2^31 and 2^32 without 2^31 calls. Same harness and checks as
test_sim_ranks.py (tests/gpu_sim/_sim.py); skips without CUDA unless SYMCOMM_REQUIRE_GPU=1.
"""
from __future__ import annotations


import pytest
import torch

from symcomm.errors import CudaError

from _sim import ALGOS, FLAGFREE, ONESHOT, TWOSHOT, SimWorld, capacity, check_outputs, make_inputs

WORLDS = (2, 4, 8)
# 1 MiB: enough vectors that one-shot and two-shot use all of the simulated grid (8 blocks)
# at every world, so every block's epoch takes part; flag-free at its whole capacity.
BARRIER_BYTES = 1 << 20
WRAP_POINTS = (2**31, 2**32)  # where int32(flag - epoch) changed sign: 32-bit wrap-safe compare


def _nbytes(algo: str) -> int:
    return min(BARRIER_BYTES, capacity(algo))


@pytest.mark.parametrize("world", WORLDS)
def test_calls_across_the_old_wrap_points(world):
    """Seeded 5 below 2^31, then 5 below 2^32: 10 calls of each kernel, alternating, cross each
    point. Every call must match the reference; afterwards the epochs must stand exactly 20
    above the seed (the 20 barrier calls), which the seed's only-forward rule checks: seeding
    one below that is refused, seeding that value is accepted."""
    gen = torch.Generator().manual_seed(31 + world)
    order = (ONESHOT, TWOSHOT, FLAGFREE)
    with SimWorld(world) as sim:
        for point in WRAP_POINTS:
            seed = point - 5
            sim.seed_epochs(seed)
            calls = []
            for i in range(3 * 10):
                algo = order[i % 3]
                dtype = (torch.float32, torch.bfloat16)[i % 2]
                x = make_inputs(world, _nbytes(algo), dtype, gen)
                y = [torch.full_like(t, 7.0) for t in x]
                sim.launch(algo, dtype, x, y)
                calls.append((f"world {world} seed {seed} call {i} {algo} {dtype}", x, y))
            torch.cuda.synchronize()
            for what, x, y in calls:
                check_outputs(y, x, what)
            after = seed + 20  # one epoch per one-shot/two-shot call; flag-free uses none
            with pytest.raises(CudaError, match="invalid argument"):
                sim.seed_epochs(after - 1)
            sim.seed_epochs(after)


@pytest.mark.parametrize("world", WORLDS)
def test_two_shot_with_a_late_rank_past_2_31(world):
    """The review's scenario. Fresh contexts (every `mid` flag still 0), seeded to 2^31 + 100:
    the old code's int32(0 - (2^31 + 101)) >= 0 let the first two-shot through its middle
    barrier before the other owners had written their chunks. One rank starts ~30 ms late.
    Two sizes: one vector per thread per chunk (the tightest race between an owner's store and
    a reader's load) and the whole staging buffer. Each repetition is a fresh world, since only
    the first two-shot after the seed meets never-written flags."""
    gen = torch.Generator().manual_seed(7 + world)
    for rep in range(3):
        for nbytes in (world * 8 * 512 * 16, 2 << 20):
            with SimWorld(world) as sim:
                sim.seed_epochs(2**31 + 100)
                x = make_inputs(world, nbytes, torch.float32, gen)
                y = [torch.full_like(t, 7.0) for t in x]
                late = (rep + 1) % world
                sim.launch(TWOSHOT, torch.float32, x, y, late=late)
                torch.cuda.synchronize()
                check_outputs(y, x, f"world {world} rep {rep} {nbytes} B, rank {late} late")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_late_in_turn(world, algo):
    """Every rank in turn starts late, twice round, seeded just below 2^32 so the turns cross
    it: its peers wait in their barriers (or for its flag-free data) and must still get the
    right sum, and so must it."""
    gen = torch.Generator().manual_seed(100 * world + ALGOS.index(algo))
    with SimWorld(world) as sim:
        sim.seed_epochs(2**32 - world)
        for turn in range(2 * world):
            late = turn % world
            dtype = (torch.bfloat16, torch.float16, torch.float32)[turn % 3]
            x = make_inputs(world, _nbytes(algo), dtype, gen)
            y = [torch.full_like(t, 7.0) for t in x]
            sim.launch(algo, dtype, x, y, late=late)
            torch.cuda.synchronize()
            check_outputs(y, x, f"{algo} world {world} turn {turn}: rank {late} late")
