"""Check mode, refusals and timeouts end to end over gloo, at 2 and 3 ranks (issue 23).

Each scenario makes ranks diverge the way a careless program would and asserts that every rank
gets an error naming the problem within the timeout, never a hang, a crash or a silently wrong
result; and, where the error came from check mode, that the ranks stay usable (a following
all_reduce is right).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import tempfile
import time

import numpy as np
import pytest
import torch

import symcomm
from _spawn import run_world
from symcomm import _native, settings

WORLDS = (2, 3)


def _sum_is_right(comm, rank, world):
    got = comm.all_reduce(torch.full((5,), float(rank + 1)))
    assert torch.equal(got, torch.full((5,), float(world * (world + 1) // 2))), got


# ------------------------------------------------------------------- item 3: the reduction op
def _reduction_op_differs(rank, world):
    comm = symcomm.Communicator(check=True, timeout_s=30)
    x = torch.full((4,), float(rank))
    with pytest.raises(symcomm.PeerMismatchError, match=r"reduction op \(rank 0: sum, rank 1: max"):
        comm.all_reduce(x, op="max" if rank == 1 else "sum")
    with pytest.raises(symcomm.PeerMismatchError, match="reduction op"):
        comm.reduce_scatter(torch.ones(world * 2), op="min" if rank == world - 1 else "sum")
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_check_mode_compares_the_reduction_op(world):
    run_world(_reduction_op_differs, world, timeout_s=120)


def _norm_scalars_differ(rank, world):
    comm = symcomm.Communicator(check=True, timeout_s=30)
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(symcomm.PeerMismatchError, match=r"eps \(rank 0: 9\.99.*e-07, rank 1: 9\.99.*e-06"):
        comm.all_reduce_rmsnorm(x, w, eps=1e-5 if rank == 1 else 1e-6)
    with pytest.raises(symcomm.PeerMismatchError, match=r"the residual \(rank 0: given, rank 1: none"):
        comm.all_reduce_rmsnorm(x, w, residual=None if rank == 1 else x.clone())
    with pytest.raises(symcomm.PeerMismatchError, match=r"the quant \(rank 0: fp8, rank 1: None"):
        comm.all_reduce_rmsnorm(x, w, quant=None if rank == 1 else "fp8", scale=None if rank == 1 else 1.0)
    with pytest.raises(symcomm.PeerMismatchError, match=r"the scale \(rank 0: 1\.0, rank 1: 2\.0"):
        comm.all_reduce_rmsnorm(x, w, quant="fp8", scale=2.0 if rank == 1 else 1.0)
    # weight is free per rank (each rank normalises its own rows with it): compared nowhere here
    comm.all_reduce_rmsnorm(x, w * (rank + 1))
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_check_mode_compares_every_result_changing_scalar_of_the_norm(world):
    run_world(_norm_scalars_differ, world, timeout_s=120)


# -------------------------------------------------- item 4: different operations, one framing
def _different_operations(rank, world):
    comm = symcomm.Communicator(check=True, timeout_s=30)
    sizes = [2] * world
    x = torch.randn(2, 32)
    if rank == 0:
        call = lambda: comm.all_gatherv_fp4(x, sizes, 1.0)  # noqa: E731
    else:
        call = lambda: comm.all_gatherv(x, sizes)  # noqa: E731
    with pytest.raises(symcomm.PeerMismatchError, match=r"op \(rank 0: all_gatherv_fp4, rank 1: all_gatherv"):
        call()
    _sum_is_right(comm, rank, world)
    # A rank that builds a communicator while its peers call: every rank names the other side.
    if rank == 0:
        with pytest.raises(symcomm.PeerMismatchError, match=r"different symcomm exchanges .rank 0: 'setup', rank 1: "
                                                            r"'check'"):
            symcomm.Communicator(check=True, timeout_s=30)
    else:
        with pytest.raises(symcomm.PeerMismatchError, match="different symcomm exchanges"):
            comm.all_reduce(torch.ones(3))
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_in_different_operations_all_get_a_mismatch(world):
    run_world(_different_operations, world, timeout_s=120)


# ---------------------------------------------- item 5: any exception on a checked call refuses
def _one_rank_fails_in_its_own_checks(rank, world):
    comm = symcomm.Communicator(check=True, timeout_s=30)
    x = torch.ones(1, 4096)
    sizes = [1] * world
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(symcomm.ArgumentError, match=r"sizes\[0\] = .* more than any tensor"):
            comm.all_gatherv(x, [10 ** 30, *sizes[1:]])
    else:
        with pytest.raises(symcomm.PeerMismatchError, match=r"rank\(s\) 0 rejected the call.*more than any tensor"):
            comm.all_gatherv(x, sizes)
    # Not a SymcommError: an allocation that fails on one rank only (2**40 rows of 16 KiB).
    if rank == 0:
        with pytest.raises(RuntimeError, match="alloc"):
            comm.all_gatherv(x, [1, 2 ** 40, *sizes[2:]])
    else:
        with pytest.raises(symcomm.PeerMismatchError, match=r"rank\(s\) 0 rejected the call.*RuntimeError"):
            comm.all_gatherv(x, sizes)
    assert time.monotonic() - start < 20
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_whose_call_fails_before_communicating_makes_every_rank_raise(world):
    run_world(_one_rank_fails_in_its_own_checks, world, timeout_s=120)


# ------------------------------------------------------ item 6: the timeout bounds gloo waits
def _late_peer(rank, world):
    comm = symcomm.Communicator(timeout_s=2)
    assert comm.capabilities()["timeout"]["seconds"] == 2.0
    late = world - 1
    if rank == late:
        time.sleep(6)
    start = time.monotonic()
    if rank != late:
        with pytest.raises(symcomm.CommTimeoutError, match="within 2 s"):
            comm.all_reduce(torch.ones(3))
        assert time.monotonic() - start < 5, "the wait outlived its bound"
        with pytest.raises(symcomm.CommTimeoutError):  # broken for good, at once
            comm.all_reduce(torch.ones(3))
        assert time.monotonic() - start < 5
    else:
        # The peers gave up on this call; whether it completes here depends on what they had
        # queued, but it must not wait past the bound.
        try:
            comm.all_reduce(torch.ones(3))
        except symcomm.CommTimeoutError:
            pass
        assert time.monotonic() - start < 5
    comm.close()


def _late_peer_in_check_mode(rank, world):
    comm = symcomm.Communicator(timeout_s=2, check=True)
    if rank == 0:
        time.sleep(6)
        return  # never joins: its peers must not wait for it past the bound
    start = time.monotonic()
    with pytest.raises(symcomm.CommTimeoutError, match="'check' exchange.*within 2 s"):
        comm.all_reduce(torch.ones(3))
    assert time.monotonic() - start < 5


def _late_constructor(rank, world):
    if rank == 0:
        time.sleep(6)
        return
    start = time.monotonic()
    with pytest.raises(symcomm.CommTimeoutError, match="'setup' exchange.*within 2 s"):
        symcomm.Communicator(timeout_s=2)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", (_late_peer, _late_peer_in_check_mode, _late_constructor))
def test_the_timeout_bounds_every_gloo_wait(world, scenario):
    run_world(scenario, world, timeout_s=120)


# ----------------------------------------------- item 7: a rank that fails in the constructor
def _bad_tuning_file_on_one_rank(rank, world):
    if rank == 1:
        os.environ["SYMCOMM_TUNING_FILE"] = "/nonexistent/table.json"
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(symcomm.ArgumentError, match="tuning file /nonexistent/table.json"):
            symcomm.Communicator(timeout_s=30)
    else:
        with pytest.raises(symcomm.PeerMismatchError, match=r"rank 1 could not take part.*tuning file /nonexistent"):
            symcomm.Communicator(timeout_s=30)
    assert time.monotonic() - start < 10
    os.environ.pop("SYMCOMM_TUNING_FILE", None)
    comm = symcomm.Communicator(timeout_s=30)  # everyone can start over
    _sum_is_right(comm, rank, world)
    comm.close()


def _arguments_differ(rank, world):
    with pytest.raises(symcomm.PeerMismatchError, match=r"disagree on check mode \(rank 0: 0, rank 1: 1"):
        symcomm.Communicator(timeout_s=30, check=rank == 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", (_bad_tuning_file_on_one_rank, _arguments_differ))
def test_constructor_failures_reach_every_rank(world, scenario):
    run_world(scenario, world, timeout_s=120)


# ------------------------------------------------- issue 26's options: checked, voted, reported
def _memory_options(rank, world):
    for bad in ("yes", 1, None):
        with pytest.raises(symcomm.ArgumentError, match="graph_communicators must be a bool"):
            symcomm.Communicator(graph_communicators=bad)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(symcomm.ArgumentError, match="nccl_max_ctas must be an int from 1 to 64"):
            symcomm.Communicator(nccl_max_ctas=bad)
    with pytest.raises(symcomm.PeerMismatchError, match="nccl_max_ctas"):
        symcomm.Communicator(timeout_s=30, nccl_max_ctas=8 if rank == 0 else 16)
    # A tuning file on one rank only: its table would send that rank down other paths.
    with tempfile.TemporaryDirectory() as folder:
        if rank == 0:
            path = os.path.join(folder, "tuning.json")
            with open(path, "w") as f:
                json.dump({"version": 1, "gpu": "cpu", "world_size": world, "nccl": None, "torch": torch.__version__,
                           "date": "2026-11-29T00:00:00+00:00", "command": "test",
                           "rules": {"all_reduce": [[None, ["torch", "nccl"]]]}}, f)
            os.environ["SYMCOMM_TUNING_FILE"] = path
        try:
            with pytest.raises(symcomm.PeerMismatchError, match=r"the dispatch table \(a digest; this rank's: "):
                symcomm.Communicator(timeout_s=30)
        finally:
            os.environ.pop("SYMCOMM_TUNING_FILE", None)
    comm = symcomm.Communicator(timeout_s=30, graph_communicators=True, nccl_max_ctas=4)
    memory = comm.capabilities()["memory"]
    # On the CPU nothing is measured: no component, and nothing beyond a pool that is not there.
    assert memory["components"] == {} and memory["total_bytes"] == 0 and memory["beyond_pool_bytes"] == 0, memory
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", (2,))
def test_memory_options_are_checked_and_must_agree(world):
    run_world(_memory_options, world, timeout_s=120)


# ------------------------------------------------------------ item 8: one rule for timeouts
def _bad_timeouts(rank, world):
    for bad in (math.nan, math.inf, 0, -5, True, "10"):
        with pytest.raises(symcomm.ArgumentError, match="timeout_s must be"):
            symcomm.Communicator(timeout_s=bad)
    os.environ["SYMCOMM_TIMEOUT_S"] = "inf"
    with pytest.raises(symcomm.ArgumentError, match="SYMCOMM_TIMEOUT_S must be"):
        symcomm.Communicator()
    os.environ["SYMCOMM_TIMEOUT_S"] = "ten"  # the message shows the text given, not nan
    with pytest.raises(symcomm.ArgumentError, match="SYMCOMM_TIMEOUT_S must be .*, got 'ten'"):
        symcomm.Communicator()
    os.environ["SYMCOMM_TIMEOUT_S"] = "5"
    comm = symcomm.Communicator()
    assert comm.capabilities()["timeout"]["seconds"] == 5.0 and comm.capabilities()["timeout"]["source"] == \
        "SYMCOMM_TIMEOUT_S"
    comm.close()  # a valid timeout closes cleanly
    del os.environ["SYMCOMM_TIMEOUT_S"]


@pytest.mark.parametrize("world", (2,))
def test_bad_timeouts_are_argument_errors_on_every_rank(world):
    run_world(_bad_timeouts, world, timeout_s=120)


@pytest.mark.parametrize("value", ("nan", "inf", "-inf", "0", "-1", "1e9", "abc", ""))
def test_one_rule_for_every_timeout(value, monkeypatch):
    monkeypatch.setenv("SYMCOMM_TIMEOUT_S", value)
    if value == "":
        assert settings.timeout_s(default=7.0) == 7.0  # unset
        return
    with pytest.raises(symcomm.ArgumentError, match="SYMCOMM_TIMEOUT_S must be a finite number"):
        settings.timeout_s()
    with pytest.raises(symcomm.ArgumentError, match="timeout_s must be a finite number"):
        settings.checked_timeout(value if value == "abc" else float(value), "timeout_s")


def test_the_largest_timeout_is_accepted_and_held_by_the_kernels_clock():
    assert settings.checked_timeout(settings.MAX_TIMEOUT_S, "timeout_s") == settings.MAX_TIMEOUT_S
    assert settings.MAX_TIMEOUT_S * 1e9 < 2 ** 64  # csrc counts the bound in uint64 nanoseconds


# ----------------------------------------------------------------------------- item 9
BOOLEAN_SETTINGS = {"SYMCOMM_CHECK": settings.check_mode, "SYMCOMM_DISABLE_CUSTOM_AR": settings.custom_kernels_disabled,
                    "SYMCOMM_BENCH_DEBUG": settings.bench_debug}


@pytest.mark.parametrize("name", BOOLEAN_SETTINGS)
@pytest.mark.parametrize("word,on", [("1", True), ("true", True), ("Yes", True), ("ON", True), ("0", False),
                                     ("false", False), ("no", False), ("off", False)])
def test_boolean_settings_accept_the_usual_spellings(name, word, on, monkeypatch):
    monkeypatch.setenv(name, word)
    assert BOOLEAN_SETTINGS[name]() is on


@pytest.mark.parametrize("name", BOOLEAN_SETTINGS)
def test_an_unknown_boolean_spelling_is_an_error(name, monkeypatch):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(symcomm.ArgumentError, match=f"{name} must be one of"):
        BOOLEAN_SETTINGS[name]()


def _numpy_sizes_and_select(rank, world):
    comm = symcomm.Communicator(timeout_s=30)
    sizes = np.array([1 + r for r in range(world)], dtype=np.int64)
    got = comm.all_gatherv(torch.full((1 + rank, 2), float(rank)), list(sizes))
    assert got.shape == (int(sizes.sum()), 2)
    got = comm.all_gatherv(torch.full((1 + rank, 2), float(rank)), [np.int32(s) for s in sizes])
    assert got.shape == (int(sizes.sum()), 2)
    with pytest.raises(symcomm.ArgumentError) as info:
        comm.select("allreduce", torch.ones(2))
    for op in ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "all_gatherv_fp4",
               "all_reduce_rmsnorm"):
        assert op in str(info.value), info.value
    comm.close()


def test_numpy_integers_are_sizes_and_select_lists_every_op():
    run_world(_numpy_sizes_and_select, 2, timeout_s=120)


def test_a_foreign_native_library_is_named_as_such():
    with pytest.raises(OSError, match="is not symcomm's native library"):
        _native.bind(ctypes.CDLL("libc.so.6"), "libc.so.6")


# --------------------------------------------------------------------------------- issue 35
# Misuse on purpose: after any of these, every rank has an error within the timeout, and the
# README's last two lines (comm.close(), dist.destroy_process_group()) still return at once.
STOPPED_S = 12.0  # how long a peer that "stops participating" stays away: far past every bound below


def _close_and_destroy_promptly(comm, rank):
    import torch.distributed as dist

    start = time.monotonic()
    comm.close()
    dist.destroy_process_group()  # waited for symcomm's abandoned collective on the user's group
    assert time.monotonic() - start < 3, f"rank {rank}: close() + destroy_process_group() took " \
                                         f"{time.monotonic() - start:.1f} s"


def _peer_stops_participating(rank, world, check):
    comm = symcomm.Communicator(timeout_s=2, check=check)
    _sum_is_right(comm, rank, world)
    stopped = world - 1
    if rank == stopped:
        time.sleep(STOPPED_S)  # alive, holding its connections, but no longer calling symcomm
        _close_and_destroy_promptly(comm, rank)
        return
    start = time.monotonic()
    with pytest.raises(symcomm.CommTimeoutError, match=f"rank.*{stopped}.* did not arrive within 2 s"
                       if check else "did not arrive within 2 s"):
        comm.all_reduce(torch.ones(3))
    assert time.monotonic() - start < 4, "the wait outlived its bound"
    _close_and_destroy_promptly(comm, rank)
    assert time.monotonic() - start < 7, "a survivor had to wait for the stopped peer"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", (False, True), ids=("plain", "check"))
def test_after_a_timeout_close_and_destroy_process_group_return(world, check):
    run_world(_peer_stops_participating, world, check, timeout_s=60)


def _refused_without_check_mode(rank, world):
    os.environ["SYMCOMM_TIMEOUT_S"] = "2"
    comm = symcomm.Communicator()
    del os.environ["SYMCOMM_TIMEOUT_S"]
    sizes = [1] * world
    x = torch.ones(1, 8)
    refused = r"sizes\[0\] = .* more than any tensor"
    # Peers in the same call: the refusal joins their comparison of calls on CPU tensors, so
    # they raise with its reason at once, and the next call of every rank meets its partners.
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(symcomm.ArgumentError, match=refused):
            comm.all_gatherv(x, [10 ** 30, *sizes[1:]])
    else:
        with pytest.raises(symcomm.PeerMismatchError, match=r"rank\(s\) 0 refused the call.*" + refused):
            comm.all_gatherv(x, sizes)
    assert time.monotonic() - start < 1.5, "nobody should wait for a refusal its peers are there to hear"
    assert comm.all_reduce(torch.ones(3)).tolist() == [world] * 3
    # Peers that never make the call: the refusing rank waits for them at most the timeout
    # (SYMCOMM_TIMEOUT_S, not the group's 30 minutes), then raises its own error.
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(symcomm.ArgumentError, match=refused):
            comm.all_gatherv(x, [10 ** 30, *sizes[1:]])
        assert time.monotonic() - start < 4, "the refusal's wait outlived SYMCOMM_TIMEOUT_S"
        with pytest.raises(symcomm.CommTimeoutError):  # broken: a later call fails at once
            comm.all_reduce(torch.ones(3))
        assert time.monotonic() - start < 4
    else:
        time.sleep(STOPPED_S)  # rank 0 must not need them to end its wait, nor to tear down
    _close_and_destroy_promptly(comm, rank)


@pytest.mark.parametrize("world", WORLDS)
def test_a_refusal_without_check_mode_reaches_peers_or_waits_at_most_the_timeout(world):
    run_world(_refused_without_check_mode, world, timeout_s=60)


def _dead_peer(rank, world):
    comm = symcomm.Communicator(timeout_s=20)
    _sum_is_right(comm, rank, world)
    dead = world - 1
    if rank == dead:
        os._exit(0)  # dies without a word: no close(), no destroy, its sockets closed by the OS
    start = time.monotonic()
    with pytest.raises(symcomm.CommTimeoutError, match="a peer is gone"):
        comm.all_reduce(torch.ones(3))  # gloo's own error is a RuntimeError: mapped, not leaked
    assert time.monotonic() - start < 20
    again = time.monotonic()
    with pytest.raises(symcomm.CommTimeoutError, match="a peer is gone"):
        comm.all_gather(torch.ones(3))  # marked broken: fails at once, not after another timeout
    with pytest.raises(symcomm.CommTimeoutError, match="a peer is gone"):
        comm.check_health()
    assert time.monotonic() - again < 1
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_a_dead_peer_is_a_symcomm_error_and_breaks_the_communicator(world):
    run_world(_dead_peer, world, timeout_s=60, may_exit=frozenset({world - 1}))


def _bad_timeout_variable_on_one_rank(rank, world):
    bad = world - 1
    if rank == bad:
        os.environ["SYMCOMM_TIMEOUT_S"] = "soon"
    start = time.monotonic()
    rule = r"SYMCOMM_TIMEOUT_S must be a finite number of seconds > 0"
    if rank == bad:
        with pytest.raises(symcomm.ArgumentError, match=rule):
            symcomm.Communicator()
    else:  # the group's 30 minutes are its bound here: the refusal must come long before
        with pytest.raises(symcomm.PeerMismatchError, match=rf"rank {bad} could not take part.*{rule}"):
            symcomm.Communicator()
    assert time.monotonic() - start < 10
    os.environ.pop("SYMCOMM_TIMEOUT_S", None)
    comm = symcomm.Communicator(timeout_s=30)  # everyone can start over
    _sum_is_right(comm, rank, world)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_a_bad_timeout_variable_on_one_rank_is_voted(world):
    run_world(_bad_timeout_variable_on_one_rank, world, timeout_s=60)
