"""Adding an operation is one module and one table row (tests/toy_scaled_all_reduce.py): the
Communicator validates it once, dispatches it by its row, explains the choice in select(),
compares it in check mode and traces it under torch.compile(fullgraph=True), with nothing in
symcomm changed. Also: the composite operations run their argument rules once per public call
(their inner collective is not validated again).
"""
from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

import symcomm
from _spawn import run_world
from symcomm.backends import PATHS
from symcomm.operations import ALL_GATHERV, ALL_GATHERV_FP4, ALL_REDUCE, ALL_REDUCE_RMSNORM, OPERATIONS


def _toy_world(rank, world, table):
    import toy_scaled_all_reduce as toy
    os.environ["SYMCOMM_TUNING_FILE"] = table
    comm = symcomm.Communicator(paths=(*PATHS, *toy.PATHS), operations=(*OPERATIONS, *toy.OPERATIONS), check=True)
    x = torch.arange(6, dtype=torch.float32) + rank
    want = 2.5 * sum(torch.arange(6, dtype=torch.float32) + r for r in range(world))
    toy.BUILDS.clear()
    got = comm.run("scaled_all_reduce", x, 2.5)
    assert torch.equal(got, want) and len(toy.BUILDS) == 1, (got, toy.BUILDS)  # validated once
    # Dispatched by its row: the peer-memory path first, off on the CPU, so torch serves.
    choice = comm.select("scaled_all_reduce", x, 2.5)
    assert choice.algo == "torch" and "custom-scaled" in choice.rejected, choice
    assert comm.capabilities()["operations"]["scaled_all_reduce"]["custom-scaled"]["enabled"] is False
    with pytest.raises(symcomm.ArgumentError, match="algo='custom-scaled' is unavailable"):
        comm.run("scaled_all_reduce", x, 2.5, algo="custom-scaled")
    # Its own scalar is compared in check mode, on every rank.
    with pytest.raises(symcomm.PeerMismatchError, match=r"scale \(rank 0: 2\.5, rank 1: 3\.0"):
        comm.run("scaled_all_reduce", x, 3.0 if rank == 1 else 2.5)
    expected = (symcomm.ArgumentError, "scale must be a number") if rank == 0 else (
        symcomm.PeerMismatchError, r"rejected the call.*scale must be a number")
    with pytest.raises(expected[0], match=expected[1]):
        comm.run("scaled_all_reduce", x, "two" if rank == 0 else 2.0)
    # Traced whole by torch.compile on the CPU, as its method would be.
    compiled = torch.compile(lambda t: comm.run("scaled_all_reduce", t, 2.5) + 1, fullgraph=True)
    assert torch.equal(compiled(x), want + 1)
    comm.close()


def test_a_new_operation_is_one_module_and_one_table_row(tmp_path):
    table = tmp_path / "table.json"
    rules = {"scaled_all_reduce": [[None, ["custom-scaled", "torch"]]]}
    table.write_text(json.dumps({"version": 1, "gpu": "cpu", "world_size": 2, "rules": rules}))
    run_world(_toy_world, 2, str(table), timeout_s=300)


def _counting(rank, world):
    counts: dict[str, int] = {}
    for op in (ALL_REDUCE, ALL_GATHERV, ALL_REDUCE_RMSNORM, ALL_GATHERV_FP4):
        build = type(op).build

        def counted(self, *args, _build=build, _name=op.name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _build(self, *args, **kwargs)
        type(op).build = counted
    for check in (False, True):
        comm = symcomm.Communicator(check=check)
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        counts.clear()
        comm.all_reduce_rmsnorm(x, torch.ones(64, dtype=torch.bfloat16), residual=x.clone())
        assert counts == {"all_reduce_rmsnorm": 1}, counts  # the inner all_reduce is not built again
        sizes = [2 + r for r in range(world)]
        counts.clear()
        comm.all_gatherv_fp4(torch.randn(sizes[rank], 64), sizes, 1.0, extra=[torch.zeros(sizes[rank], 4)])
        assert counts == {"all_gatherv_fp4": 1}, counts
        counts.clear()
        comm.all_reduce(x)
        assert counts == {"all_reduce": 1}, counts
        comm.close()


def test_every_public_call_runs_its_argument_rules_once():
    run_world(_counting, 2, timeout_s=180)


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.name)
def test_compiled_takes_builds_arguments_and_defaults(operation):
    """Communicator.run hands compiled() what the caller gave build() (under torch.compile, or when
    autograd records the call), so each descriptor's compiled form must take build's arguments
    with build's defaults, then algo="auto": a call that omits an optional argument works the
    same eagerly, compiled and under autograd."""
    def params(fn, skip):
        return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[skip:]]

    assert params(operation.compiled, 1) == params(operation.build, 1) + [("algo", "auto")]
