"""The tuning table: lookups at and around the bounds, world-size fallback, bad tables."""
from __future__ import annotations

import pytest

from symcomm.dispatch import BUILTIN, INF, PLAIN_FIRST, SYMM_FIRST, DispatchTable, builtin_table


def test_bounds_are_inclusive():
    table = DispatchTable({"all_reduce": [(1024, SYMM_FIRST), (INF, PLAIN_FIRST)]}, "test")
    assert table.preference("all_reduce", 0) == SYMM_FIRST
    assert table.preference("all_reduce", 1024) == SYMM_FIRST
    assert table.preference("all_reduce", 1025) == PLAIN_FIRST
    assert table.preference("all_reduce", 1 << 40) == PLAIN_FIRST


def test_v_variants_follow_their_even_counterparts():
    table = DispatchTable({"all_gather": [(64, SYMM_FIRST), (INF, PLAIN_FIRST)]}, "test")
    assert table.preference("all_gatherv", 64) == SYMM_FIRST
    assert table.preference("all_gatherv", 65) == PLAIN_FIRST
    assert table.preference("reduce_scatterv", 1) == PLAIN_FIRST  # no rules: plain NCCL first


def test_every_preference_ends_with_the_torch_fallback():
    for rules in BUILTIN.values():
        for steps in rules.values():
            assert all(pref[-1] == "torch" for _, pref in steps)


@pytest.mark.parametrize(("world", "measured_at"), [(1, 2), (2, 2), (3, 2), (4, 4), (8, 4)])
def test_world_size_falls_back_to_nearest_measured(world, measured_at):
    assert builtin_table(world).source == f"builtin (measured at world {measured_at})"


def test_malformed_rules_are_rejected():
    with pytest.raises(ValueError, match="ascend"):
        DispatchTable({"all_reduce": [(2048, SYMM_FIRST), (1024, PLAIN_FIRST), (INF, PLAIN_FIRST)]}, "bad")
    with pytest.raises(ValueError, match="infinity"):
        DispatchTable({"all_reduce": [(1024, SYMM_FIRST)]}, "bad")
    with pytest.raises(ValueError, match="retired"):  # what comm.table = ... would otherwise ignore
        DispatchTable({"all_gather:inplace": [(INF, SYMM_FIRST)]}, "bad")


def test_validation_takes_this_ranks_slice_in_place_and_refuses_other_overlaps():
    import torch

    from symcomm import errors as symcomm_errors
    from symcomm.operations import collectives
    cpu = torch.device("cpu")
    out = torch.zeros(6, 3)
    in_place = collectives.all_gather_call(out[2:4], out, 1, 3, cpu)
    elsewhere = collectives.all_gather_call(out[0:2].clone(), out, 1, 3, cpu)
    assert in_place.op == elsewhere.op == "all_gather" and in_place.nbytes == elsewhere.nbytes
    with pytest.raises(symcomm_errors.ArgumentError, match="not this rank's slice"):
        collectives.all_gather_call(out[0:2], out, 1, 3, cpu)  # rank 1's slot is rows 2:4, not 0:2


# ------------------------------------------------------------------------- tuning files
import json  # noqa: E402

from symcomm import ArgumentError  # noqa: E402
from symcomm.dispatch import TUNING_ENV, check_tuning, load_table, read_tuning  # noqa: E402

CPU = __import__("torch").device("cpu")


def tuning(world=2, gpu="cpu", **rules):
    return {"version": 1, "gpu": gpu, "world_size": world, "nccl": None, "torch": "2.13.0",
            "date": "2026-11-23T00:00:00+00:00", "command": "symcomm-bench tune -g 2",
            "rules": rules or {"all_reduce": [[4096, ["custom-oneshot", "nccl-symm"]],
                                              [None, ["nccl", "torch"]]]}}


def write(tmp_path, payload, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(payload) if not isinstance(payload, str) else payload)
    return path


def test_tuning_file_rules_become_the_table(tmp_path):
    path = write(tmp_path, tuning())
    table = load_table(2, CPU, env={TUNING_ENV: str(path)}, packaged=tmp_path / "none")
    assert table.source == str(path)
    assert table.preference("all_reduce", 4096) == ("custom-oneshot", "nccl-symm")
    assert table.preference("all_reduce", 4097) == ("nccl", "torch")
    assert table.preference("reduce_scatter", 1) == PLAIN_FIRST  # a key the file leaves out


@pytest.mark.parametrize(("world", "gpu", "needle"), [
    (4, "cpu", "world size 4, but this communicator has 2"),
    (2, "NVIDIA H200", "measured on 'NVIDIA H200', but this communicator runs on 'cpu'"),
])
def test_tuning_file_for_another_machine_is_rejected(tmp_path, world, gpu, needle):
    path = write(tmp_path, tuning(world=world, gpu=gpu))
    with pytest.raises(ArgumentError, match=needle) as info:
        load_table(2, CPU, env={TUNING_ENV: str(path)}, packaged=tmp_path / "none")
    assert str(path) in str(info.value)


BAD_RULES = [
    ({"all_reduce": [[2048, ["nccl"]], [1024, ["nccl"]], [None, ["nccl"]]]}, "ascending"),
    ({"all_reduce": [[1024, ["nccl"]], [1024, ["nccl"]], [None, ["nccl"]]]}, "ascending"),
    ({"all_reduce": [[1024, ["nccl"]]]}, "last rule must have no upper bound"),
    ({"all_reduce": [[None, ["nccl"]], [None, ["nccl"]]]}, "only the last rule"),
    ({"all_reduce": [["1K", ["nccl"]], [None, ["nccl"]]]}, "integers"),
    ({"all_reduce": [[None, []]]}, "non-empty list of path names"),
    ({"all_reduce": [[None, ["nccl", 3]]]}, "path names"),
    ({"all_reduce": [[None, ["two words"]]]}, "path names"),
    ({"all_reduce": [[None, ["nccl", "nccl"]]]}, "listed twice"),
    ({"all_reduce": [[None]]}, r"\[max_bytes, \[paths\]\]"),
    ({"alltoall": [[None, ["nccl"]]]}, "unknown rule key 'alltoall'"),
    ({"all_reduce:inplace": [[None, ["nccl"]]]}, "'all_reduce:inplace' is retired: in-place calls take the op's own row"),
    ({"all_reduce": []}, "non-empty list"),
]


@pytest.mark.parametrize(("rules", "needle"), BAD_RULES)
def test_malformed_tuning_rules_name_the_problem(tmp_path, rules, needle):
    path = write(tmp_path, tuning(**rules))
    with pytest.raises(ArgumentError, match=needle) as info:
        read_tuning(path)
    assert str(info.value).startswith(f"tuning file {path}: ")


@pytest.mark.parametrize(("payload", "needle"), [
    ("{not json", "Expecting property name"),
    ("[]", "JSON object"),
    ({**tuning(), "version": 2}, "version must be 1"),
    ({**tuning(), "world_size": 0}, "world_size"),
    ({**tuning(), "gpu": ""}, "gpu"),
    ({**tuning(), "rules": {}}, "rules"),
])
def test_malformed_tuning_files_name_the_problem(tmp_path, payload, needle):
    path = write(tmp_path, payload)
    with pytest.raises(ArgumentError, match=needle):
        read_tuning(path)


def test_missing_tuning_file_names_the_file(tmp_path):
    with pytest.raises(ArgumentError, match="tuning file .*nope.json: No such file"):
        load_table(2, CPU, env={TUNING_ENV: str(tmp_path / "nope.json")})


def test_packaged_tables_match_on_gpu_and_world_else_builtin(tmp_path):
    write(tmp_path, tuning(world=4, gpu="cpu"), "cpu_w4.json")
    write(tmp_path, tuning(world=2, gpu="NVIDIA H200"), "h200_w2.json")
    assert load_table(4, CPU, env={}, packaged=tmp_path).source == "packaged cpu_w4.json"
    assert load_table(2, CPU, env={}, packaged=tmp_path).source.startswith("builtin")
    # The environment's file wins over a packaged match.
    own = write(tmp_path / "..", tuning(world=4), "own.json")
    assert load_table(4, CPU, env={TUNING_ENV: str(own)}, packaged=tmp_path).source == str(own)


def test_shipped_tables_are_valid():
    from symcomm.dispatch import PACKAGED_DIR
    for path in sorted(PACKAGED_DIR.glob("*.json")):
        tuned = read_tuning(path)
        assert path.name.endswith(f"_w{tuned.world_size}.json"), path


def test_check_tuning_converts_null_to_infinity():
    tuned = check_tuning(tuning())
    assert (tuned.gpu, tuned.world_size) == ("cpu", 2)
    assert tuned.rules["all_reduce"][-1] == (INF, ("nccl", "torch"))
