"""The tuning table: lookups at and around the bounds, world-size fallback, bad tables."""
from __future__ import annotations

import pytest

from symcomm.dispatch import BUILTIN, INF, PLAIN, SYMM, DispatchTable, builtin_table


def test_bounds_are_inclusive():
    table = DispatchTable({"all_reduce": [(1024, SYMM), (INF, PLAIN)]}, "test")
    assert table.preference("all_reduce", 0) == SYMM
    assert table.preference("all_reduce", 1024) == SYMM
    assert table.preference("all_reduce", 1025) == PLAIN
    assert table.preference("all_reduce", 1 << 40) == PLAIN


def test_v_variants_follow_their_even_counterparts():
    table = DispatchTable({"all_gather": [(64, SYMM), (INF, PLAIN)]}, "test")
    assert table.preference("all_gatherv", 64) == SYMM
    assert table.preference("all_gatherv", 65) == PLAIN
    assert table.preference("reduce_scatterv", 1) == PLAIN  # no rules: plain NCCL first


def test_every_preference_ends_with_the_torch_fallback():
    for rules in BUILTIN.values():
        for steps in rules.values():
            assert all(pref[-1] == "torch" for _, pref in steps)


@pytest.mark.parametrize(("world", "measured_at"), [(1, 2), (2, 2), (3, 2), (4, 4), (8, 4)])
def test_world_size_falls_back_to_nearest_measured(world, measured_at):
    assert builtin_table(world).source == f"builtin (measured at world {measured_at})"


def test_malformed_rules_are_rejected():
    with pytest.raises(ValueError, match="ascend"):
        DispatchTable({"all_reduce": [(2048, SYMM), (1024, PLAIN), (INF, PLAIN)]}, "bad")
    with pytest.raises(ValueError, match="infinity"):
        DispatchTable({"all_reduce": [(1024, SYMM)]}, "bad")


def test_in_place_all_gather_has_its_own_row_with_fallback():
    table = DispatchTable({"all_gather": [(64, SYMM), (INF, PLAIN)]}, "test")
    assert table.preference("all_gather:inplace", 64) == SYMM  # no row of its own: the op's row
    w4 = builtin_table(4)
    assert w4.preference("all_gather", 256 << 20) == SYMM
    assert w4.preference("all_gather:inplace", 256 << 20) == PLAIN  # measured: in place differs


def test_validation_marks_in_place_gathers():
    import torch

    from symcomm import validate
    cpu = torch.device("cpu")
    out = torch.zeros(6, 3)
    in_place = validate.all_gather(out[2:4], out, 1, 3, cpu)
    assert in_place.table_key == "all_gather:inplace"
    elsewhere = validate.all_gather(out[0:2].clone(), out, 1, 3, cpu)
    assert elsewhere.table_key == "all_gather"
    with pytest.raises(validate.ArgumentError, match="not this rank's slice"):
        validate.all_gather(out[0:2], out, 1, 3, cpu)  # rank 1's slot is rows 2:4, not 0:2
