"""A path whose kernels gave up on a peer: the Communicator raises CommTimeoutError on the next
call and on every call after it, and the default wait bound follows the process group.

The path here stands in for symcomm's kernels: its alarm word is a plain ctypes integer that the
test sets, where the real one is mapped host memory the GPU writes (tests/gpu_sim proves that
side on a GPU).
"""
from __future__ import annotations

import ctypes
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import symcomm
from _spawn import run_world
from symcomm.base import Alarm, Call, Path

NAME = "test-alarmed"


class AlarmedPath(Path):
    name = NAME

    def __init__(self) -> None:
        self.word = ctypes.c_uint64(0)
        self.alarm = Alarm(self.word, lambda code: f"rank 0 waited for rank {code & 0xFFFF} and gave up")
        self.runs = 0

    def why_not(self, call: Call) -> str | None:
        return None if call.op == "all_reduce" else "all_reduce only"

    def run(self, call: Call) -> None:
        self.runs += 1
        call.outputs[0].copy_(call.inputs[0])


def _alarm_world(rank, world):
    made: list[AlarmedPath] = []

    def factory() -> AlarmedPath:
        made.append(AlarmedPath())
        return made[-1]

    comm = symcomm.Communicator(paths=[factory])
    x = torch.randn(5)
    comm.all_reduce(x, algo=NAME)
    comm.check_health()  # healthy: nothing to raise
    made[0].word.value = (1 << 32) | 3  # what a kernel writes when rank 3 never arrived
    for _ in range(2):  # the next call raises, and so does every one after it
        with pytest.raises(symcomm.CommTimeoutError, match="waited for rank 3"):
            comm.all_reduce(x, algo=NAME)
    with pytest.raises(symcomm.CommTimeoutError, match="waited for rank 3"):
        comm.check_health()
    with pytest.raises(symcomm.CommTimeoutError):
        comm.select("all_reduce", x)
    assert made[0].runs == 1
    comm.close()
    comm.check_health()  # closed: the word is no longer read (the real one is freed)


def test_a_path_that_gave_up_breaks_the_communicator_for_good():
    run_world(_alarm_world, 1, timeout_s=120)


def _timeout_world(rank, world):
    group = dist.new_group([0], timeout=timedelta(seconds=77))
    with symcomm.Communicator(group=group, paths=[AlarmedPath]) as comm:
        assert comm.timeout_s == 77.0
    os.environ["SYMCOMM_TIMEOUT_S"] = "5"
    with symcomm.Communicator(group=group, paths=[AlarmedPath]) as comm:
        assert comm.timeout_s == 5.0
    with symcomm.Communicator(group=group, paths=[AlarmedPath], timeout_s=9) as comm:
        assert comm.timeout_s == 9.0


def test_the_wait_bound_follows_the_group_unless_told_otherwise():
    run_world(_timeout_world, 1, timeout_s=120)
