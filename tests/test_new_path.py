"""Adding a path is one module plus one tuning-table row: nothing in communicator.py,
dispatch.py, check_mode.py or the benchmark changes.

The path here lives in this file (its "module"). It serves only int16 all_reduce sums, widening
to int32 over torch.distributed, and counts what happened to it, so the test can see that the
Communicator opened it, chose it by the table, explained it in select(), compared it in check
mode, captured nothing with it, and closed it.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

import symcomm
from _spawn import run_world
from symcomm.backends import PATHS
from symcomm.base import Call, Path, Setup

NAME = "test-int16"


class Int16Path(Path):
    name = NAME

    def __init__(self) -> None:
        self.events: list[str] = []
        self._group = None

    def open(self, setup: Setup) -> str | None:
        self.events.append("open")
        self._group = setup.peers.group
        # A path votes like any other: every rank agrees before it counts as open.
        votes = setup.peers.exchange([1])
        return None if all(v for v, in votes) else "a peer declined"

    def why_not(self, call: Call) -> str | None:
        if call.op != "all_reduce" or call.redop != "sum":
            return "serves all_reduce sums only"
        if call.dtype != torch.int16:
            return "serves int16 only"
        return None

    def run(self, call: Call) -> None:
        self.events.append("run")
        wide = call.inputs[0].to(torch.int32)
        dist.all_reduce(wide, group=self._group)
        call.outputs[0].copy_(wide.to(torch.int16))

    def close(self) -> None:
        self.events.append("close")
        self._group = None


def _world(rank, world, table_path):
    import os
    os.environ["SYMCOMM_TUNING_FILE"] = table_path
    made: list[Int16Path] = []

    def factory() -> Int16Path:
        made.append(Int16Path())
        return made[-1]

    comm = symcomm.Communicator(paths=(*PATHS, factory), check=True)
    path = made[0]
    assert comm.algorithms()[-1] == NAME and comm.capabilities()["paths"][NAME] == {"enabled": True}
    x = torch.arange(5, dtype=torch.int16) * (rank + 1)
    got = comm.all_reduce(x)
    expect = torch.arange(5, dtype=torch.int16) * sum(range(1, world + 1))
    assert torch.equal(got, expect) and path.events == ["open", "run"]
    choice = comm.select("all_reduce", x)
    assert choice.algo == NAME, choice
    # a call the new path declines falls through to the next path of the row, with its reason
    f = torch.ones(3)
    choice = comm.select("all_reduce", f)
    assert choice.algo == "torch" and choice.rejected[NAME] == "serves int16 only"
    assert torch.equal(comm.all_reduce(f), torch.full((3,), float(world)))
    assert path.events == ["open", "run"]
    forced = comm.all_reduce(x, algo=NAME)
    assert torch.equal(forced, expect) and path.events == ["open", "run", "run"]
    comm.close()
    assert path.events[-1] == "close"


def test_a_new_path_is_one_module_and_one_table_row(tmp_path):
    table = tmp_path / "table.json"
    rules = {"all_reduce": [[None, [NAME, "torch"]]]}
    for world in (2,):
        table.write_text(json.dumps({"version": 1, "gpu": "cpu", "world_size": world, "rules": rules}))
        run_world(_world, world, str(table))


class CapturePath(Int16Path):
    """Records the capture hooks; begin_capture fails once when asked to."""

    name = "test-capture"
    fail_begin = False

    def begin_capture(self) -> None:
        self.events.append("begin")
        if self.fail_begin:
            self.fail_begin = False
            raise RuntimeError("graph communicator could not open")

    def discard_capture(self) -> None:
        self.events.append("discard")

    def end_capture(self, failed: bool) -> str | None:
        self.events.append("end")
        return None


def _capture_hooks(rank, world):
    import pytest

    from symcomm import base
    made: list[CapturePath] = []
    comm = symcomm.Communicator(paths=(*PATHS, lambda: made.append(CapturePath()) or made[-1]))
    path = made[0]
    with comm.graph_capture():
        pass
    assert path.events == ["open", "begin", "end"]
    # a setup step that fails leaves no half-open session, and the next capture works
    path.fail_begin = True
    with pytest.raises(RuntimeError, match="could not open"):
        with comm.graph_capture():
            pass
    assert path.events[-2:] == ["begin", "discard"]
    with comm.graph_capture():
        pass
    assert path.events[-2:] == ["begin", "end"]
    # graph_capture() inside a capture: refused before any setup step, on every rank alike
    comm.device = torch.device("cuda", 0)  # the check only applies to CUDA communicators
    capturing = base._stream_capturing
    base._stream_capturing = lambda: True
    comm._capture.device = comm.device
    try:
        with pytest.raises(symcomm.ArgumentError, match="must enclose"):
            with comm.graph_capture():
                pass
    finally:
        base._stream_capturing = capturing
        comm.device = comm._capture.device = torch.device("cpu")
    assert path.events[-1] == "end"  # nothing began
    comm.close()


def test_capture_hooks_begin_end_and_discard_on_failure():
    run_world(_capture_hooks, 2)
