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
