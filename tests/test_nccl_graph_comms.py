"""Captured NCCL launches go to a communicator of their own, eager ones to another, for every op.

NCCL's support for mixing captured and eager launches on one communicator costs microseconds
per captured collective, so once graph_capture() has opened a graph communicator, every call
made during a capture must reach it and every eager call must not. Checked on CPU with a
library that records which communicator each NCCL call names.
"""
from __future__ import annotations

import pytest
import torch

from symcomm import _nccl
from symcomm.operations import collectives
from symcomm.backends import nccl as nccl_backend
from symcomm.backends.nccl_symm import NcclSymmPath

EAGER, GRAPH = 11, 22
CPU = torch.device("cpu")


class _RecordingLib:
    """Every NCCL entry point a path calls, recording (name, communicator)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        if not name.startswith("nccl"):
            raise AttributeError(name)

        def call(*args):
            # every collective and point-to-point call takes (..., comm, stream); destroy takes (comm)
            comm = args[-2] if len(args) >= 2 else args[0] if args else None
            self.calls.append((name, comm))
            return 0
        return call


def _path(monkeypatch, capturing: bool, graph_comm: int = GRAPH):
    lib = _RecordingLib()
    path = nccl_backend.NcclPath()
    path.attach(_nccl.Library(lib, "/fake", "test", (2, 28, 9)), EAGER, 1, CPU)
    path.graph_comm = graph_comm
    monkeypatch.setattr(nccl_backend, "capturing", lambda: capturing)
    monkeypatch.setattr(nccl_backend, "raw_stream", lambda index: 0)
    return path, lib


def _calls(world=4, rank=1):
    x = torch.randn(8, 3)
    even, uneven = [2] * world, [3, 0, 5, 2][:world]
    return {
        "all_reduce": collectives.all_reduce_call(x, None, "sum", CPU),
        "all_gather": collectives.all_gather_call(x, None, rank, world, CPU),
        "all_gatherv even": collectives.all_gatherv_call(x[:2], even, None, rank, world, CPU),
        "all_gatherv uneven": collectives.all_gatherv_call(x[:uneven[rank]], uneven, None, rank, world, CPU),
        "reduce_scatter": collectives.reduce_scatter_call(x, None, "sum", rank, world, CPU),
        "reduce_scatterv even": collectives.reduce_scatterv_call(x, even, None, "sum", rank, world, CPU),
        "reduce_scatterv uneven": collectives.reduce_scatterv_call(torch.randn(10, 3), uneven, None, "sum", rank, world,
                                                           CPU),
    }


@pytest.mark.parametrize("capturing,expected", [(True, GRAPH), (False, EAGER)])
@pytest.mark.parametrize("op", list(_calls()))
def test_each_launch_names_only_its_own_communicator(monkeypatch, op, capturing, expected):
    path, lib = _path(monkeypatch, capturing)
    path.run(_calls()[op])
    named = {comm for _, comm in lib.calls if comm is not None}
    assert named == {expected}, lib.calls
    assert any(name not in ("ncclGroupStart", "ncclGroupEnd") for name, _ in lib.calls)


@pytest.mark.parametrize("schedule_limit", [1 << 40, -1])  # send/recv, and broadcasts per root
def test_both_uneven_gather_schedules_follow_the_capture(monkeypatch, schedule_limit):
    monkeypatch.setattr(nccl_backend, "SENDRECV_GATHERV_MAX_BYTES", schedule_limit)
    for capturing, expected in ((True, GRAPH), (False, EAGER)):
        path, lib = _path(monkeypatch, capturing)
        path.run(_calls()["all_gatherv uneven"])
        assert {c for _, c in lib.calls if c is not None} == {expected}


def test_before_the_first_graph_capture_captured_calls_use_the_eager_communicator(monkeypatch):
    path, lib = _path(monkeypatch, capturing=True, graph_comm=0)
    path.run(_calls()["all_reduce"])
    assert lib.calls == [("ncclAllReduce", EAGER)]


class _Peers:
    rank, world_size = 1, 4


def test_graph_communicator_opens_once_and_closes_with_the_path(monkeypatch):
    path, lib = _path(monkeypatch, capturing=False, graph_comm=0)
    made = []
    monkeypatch.setattr(nccl_backend, "new_comm", lambda nccl, peers, timeout_s, device, config=None: made.append(1) or GRAPH)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 2000))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    path._peers = _Peers()
    path.begin_capture()
    assert made == [], "graph communicators are opt-in (Communicator(graph_communicators=True))"
    path._graph_comms = True
    path.begin_capture()
    path.begin_capture()
    assert made == [1] and path.graph_comm == GRAPH
    assert path.info()["nccl_graph_communicator"] == {"enabled": True, "open": True, "device_bytes": 0}
    path.close()
    assert ("ncclCommDestroy", EAGER) in lib.calls and ("ncclCommDestroy", GRAPH) in lib.calls
    assert path.comm == path.graph_comm == 0


def test_the_symmetric_path_registers_its_windows_on_the_graph_communicator(monkeypatch):
    path = NcclSymmPath()
    path.attach(_nccl.Library(_RecordingLib(), "/fake", "test", (2, 28, 9)), EAGER, 1, CPU)

    class Pool:
        comms: list[int] = []

        def add_comm(self, comm):
            self.comms.append(comm)

    path.pool = Pool()
    path._peers = _Peers()
    path._graph_comms = True
    monkeypatch.setattr(nccl_backend, "new_comm", lambda nccl, peers, timeout_s, device, config=None: GRAPH)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 2000))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    path.begin_capture()
    assert path.pool.comms == [GRAPH]


class _Exchanger(_Peers):
    def exchange(self, values):
        return [values]


@pytest.mark.parametrize("version,early", [((2, 27, 7), True), ((2, 28, 9), False), ((2, 30, 6), False),
                                           ((2, 30, 7), True)])
def test_opening_beside_an_nccl_whose_symmetric_kernels_never_wait_turns_early_signals_off(
        monkeypatch, version, early):
    """NCCL 2.28 through 2.30.6 launch symmetric kernels that may start before ours end
    (csrc/launch.cuh): opening the NCCL path beside one must switch our early signal off."""
    from symcomm.base import Setup

    switched = []

    class Native:
        class lib:
            @staticmethod
            def symcomm_set_early_dependents(enabled):
                switched.append(enabled)
                return 1

    library = _nccl.Library(_RecordingLib(), "/fake", "test", version)
    monkeypatch.setattr(nccl_backend, "_native_or_none", lambda: Native)
    monkeypatch.setattr(nccl_backend.NcclPath, "_local_blocker", lambda self, setup: (None, library))
    monkeypatch.setattr(nccl_backend, "new_comm", lambda *args, **kwargs: EAGER)
    path = nccl_backend.NcclPath()
    assert path.open(Setup(_Exchanger(), CPU, 5.0, {})) is None
    assert switched == ([] if early else [0])
    assert path.info()["nccl"]["early_dependent_launch"] is early
