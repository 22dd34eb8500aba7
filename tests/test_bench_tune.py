"""symcomm-bench tune: ranking and merging into rules, the file it writes, and the round trip
through SYMCOMM_TUNING_FILE into a communicator."""
import json
import math

import pytest

from symcomm.bench import report as rp
from symcomm.bench import tune
from symcomm.dispatch import INF, PACKAGED_DIR, check_tuning

from test_bench_cli import bench, table_rows

PATHS = ["nccl", "nccl-symm", "custom-oneshot", "torch"]


def test_ranking_puts_fastest_first_then_refused_and_drops_wrong():
    at = {"nccl": 10.0, "nccl-symm": 4.0, "custom-oneshot": None, "torch": None}
    assert tune.ranking(at, set(), PATHS) == ["nccl-symm", "nccl", "custom-oneshot", "torch"]
    assert tune.ranking(at, {"nccl-symm"}, PATHS) == ["nccl", "custom-oneshot", "torch"]
    tie = {"nccl": 5.0, "nccl-symm": 5.0}
    assert tune.ranking(tie, set(), PATHS)[:2] == ["nccl", "nccl-symm"]  # ties keep the given order


def test_merge_joins_equal_neighbours_and_leaves_the_last_rule_open():
    a, b = ["nccl-symm", "nccl"], ["nccl", "nccl-symm"]
    assert tune.merge([1024, 2048, 4096, 8192, 16384], [a, a, b, b, a]) == [
        [2048, a], [8192, b], [None, a]]
    assert tune.merge([1024], [b]) == [[None, b]]
    with pytest.raises(ValueError):
        tune.merge([1024, 2048], [a])


def test_table_rules_per_key_with_a_wrong_path_left_out():
    sizes = [1024, 2048, 4096]
    times = {"all_reduce": {"nccl": [9.0, 9.5, 10.0], "nccl-symm": [4.0, 4.5, 20.0],
                            "custom-oneshot": [3.0, None, None]}}
    wrong = {"all_reduce": {"nccl": [0, 0, 0], "nccl-symm": [0, 7, 0], "custom-oneshot": [0, 0, 0]}}
    rules = tune.table_rules(sizes, times, wrong, PATHS)
    assert rules == {"all_reduce": [
        [1024, ["custom-oneshot", "nccl-symm", "nccl", "torch"]],
        [2048, ["nccl", "custom-oneshot", "torch"]],                  # wrong at 2 KiB: out; refused: after
        [None, ["nccl", "nccl-symm", "custom-oneshot", "torch"]],
    ]}


def test_a_path_refused_past_its_capacity_keeps_the_place_its_trend_gives_it():
    """The world-2 table of 2026-11-30: flag-free all_gatherv took 6.005 and 8.007 us at 1 and
    2 MiB and refused 4 MiB (the larger rank's chunk outgrew its receive slot), where push took
    15.048. At 3 MiB, inside the rule that ends at 4 MiB, flag-free took 10.12 and push 12.09: the
    line through its two last times (12.01 at 4 MiB) ranks it first in that rule. One size
    further it refuses again and, with no two measured sizes right below, goes last."""
    sizes = [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    times = {"all_gatherv": {"custom-flagfree": [6.005, 8.007, None, None],
                             "custom-push": [8.718, 10.415, 15.048, 22.453]}}
    assert tune.estimated(sizes, times["all_gatherv"]["custom-flagfree"], 2, [False] * 4) == pytest.approx(12.011)
    rules = tune.table_rules(sizes, times, {}, ["custom-push", "custom-flagfree"])
    assert rules == {"all_gatherv": [[4 << 20, ["custom-flagfree", "custom-push"]],
                                     [None, ["custom-push", "custom-flagfree"]]]}
    slower = {"all_gatherv": {"custom-flagfree": [6.005, 8.007, None, None],
                              "custom-push": [8.718, 10.415, 11.5, 22.453]}}
    assert tune.table_rules(sizes, slower, {}, ["custom-push", "custom-flagfree"]) == {
        "all_gatherv": [[2 << 20, ["custom-flagfree", "custom-push"]], [None, ["custom-push", "custom-flagfree"]]]}


def test_split_rows_records_every_op_in_place_column():
    rows = [rp.SizeRow("nccl", 1024, 256, rp.Timing(9.0, 0), rp.Timing(8.0, 0)),
            rp.SizeRow("nccl-symm", 1024, 256, rp.Timing(4.0, 0), rp.Timing(math.nan, None)),
            rp.SizeRow("nccl", 2048, 512, rp.Timing(9.5, 2), rp.Timing(8.5, 0))]
    times, wrong = tune.split_rows(rows, [1024, 2048], "all_gather", ["nccl", "nccl-symm"])
    assert set(times) == {"all_gather", "all_gather:inplace"}
    assert times["all_gather"] == {"nccl": [9.0, 9.5], "nccl-symm": [4.0, None]}
    assert times["all_gather:inplace"] == {"nccl": [8.0, 8.5], "nccl-symm": [None, None]}
    assert wrong["all_gather"]["nccl"] == [0, 2]
    only = tune.split_rows(rows, [1024], "all_reduce", ["nccl"])[0]
    assert set(only) == {"all_reduce", "all_reduce:inplace"}


def test_one_row_per_op_ranked_out_of_place():
    """World 2, 16 MiB measured one-shot faster out of place (68.19 against 72.59 us) and slower
    in place (74.13 against 68.79): the op's one row, which both kinds of call take, follows the
    out-of-place column, and no in-place row is written."""
    paths = ["custom-oneshot", "custom-twoshot"]
    times = {"all_reduce": {"custom-oneshot": [68.19], "custom-twoshot": [72.59]},
             "all_reduce:inplace": {"custom-oneshot": [74.13], "custom-twoshot": [68.79]},
             "reduce_scatter": {"custom-oneshot": [2.0], "custom-twoshot": [1.0]},
             "reduce_scatter:inplace": {"custom-oneshot": [1.5], "custom-twoshot": [2.5]}}
    rules = tune.table_rules([16 << 20], times, {}, paths)
    assert rules == {"all_reduce": [[None, ["custom-oneshot", "custom-twoshot"]]],
                     "reduce_scatter": [[None, ["custom-twoshot", "custom-oneshot"]]]}


def test_a_path_wrong_in_place_is_left_out_of_the_op_row():
    paths = ["nccl-symm", "nccl", "torch"]
    times = {"all_gather": {"nccl-symm": [4.0, 4.0], "nccl": [9.0, 9.0]},
             "all_gather:inplace": {"nccl-symm": [4.0, 4.0], "nccl": [8.0, 8.0]}}
    wrong = {"all_gather:inplace": {"nccl-symm": [0, 3], "nccl": [0, 0]}}
    rules = tune.table_rules([1024, 2048], times, wrong, paths)
    assert rules == {"all_gather": [[1024, ["nccl-symm", "nccl", "torch"]],
                                    [None, ["nccl", "torch"]]]}  # wrong in place at 2 KiB: out


def test_no_estimate_from_wrong_results_at_the_last_size_or_below_the_last_time():
    sizes = [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    flagfree = [6.0, 8.0, None, None]
    assert tune.estimated(sizes, flagfree, 2, [False] * 4) == pytest.approx(12.0)
    # Wrong at either size the line is drawn through: no estimate, so the path stays out of the
    # rule where it was wrong and goes after the measured paths above it.
    assert tune.estimated(sizes, flagfree, 2, [False, True, False, False]) is None
    assert tune.estimated(sizes, flagfree, 2, [True, False, False, False]) is None
    times = {"all_gatherv": {"custom-flagfree": flagfree, "custom-push": [8.7, 10.4, 15.0, 22.5]}}
    wrong = {"all_gatherv": {"custom-flagfree": [0, 3, 0, 0], "custom-push": [0, 0, 0, 0]}}
    assert tune.table_rules(sizes, times, wrong, ["custom-push", "custom-flagfree"]) == {
        "all_gatherv": [[1 << 20, ["custom-flagfree", "custom-push"]], [2 << 20, ["custom-push"]],
                        [None, ["custom-push", "custom-flagfree"]]]}
    # The last size's rule has no bound: an estimate there would rank the path first for good.
    assert tune.estimated(sizes[:3], flagfree[:3], 2, [False] * 3) is None
    # A falling trend: never below the last measured time.
    assert tune.estimated(sizes, [9.0, 8.0, None, None], 2, [False] * 4) == 8.0


@pytest.mark.parametrize("name", sorted(p.name for p in PACKAGED_DIR.glob("*.json")))
def test_shipped_tables_rules_are_what_tune_derives_from_their_own_times(name):
    """A shipped table's rules are tune's ranking of the times it records (never edited by hand):
    table_rules over its times_us and wrong, with the measured paths in recorded order and
    torch, which tune does not measure on GPUs, last."""
    payload = json.loads((PACKAGED_DIR / name).read_text())
    paths = [*payload["times_us"]["all_reduce"], "torch"]
    derived = tune.table_rules(payload["sizes"], payload["times_us"], payload["wrong"] or {}, paths)
    assert derived == payload["rules"]


def test_no_table_where_every_path_was_wrong():
    times = {"all_reduce": {"nccl": [1.0, 1.0]}, "all_reduce:inplace": {"nccl": [1.0, 1.0]}}
    wrong = {"all_reduce:inplace": {"nccl": [0, 5]}}
    with pytest.raises(ValueError, match="every path returned wrong results for all_reduce at 2048 bytes"):
        tune.table_rules([1024, 2048], times, wrong, ["nccl"])


def test_default_output_is_the_packaged_name():
    assert tune.default_output("NVIDIA H200", 4) == "nvidia_h200_w4.json"
    assert tune.default_output("cpu", 2) == "cpu_w2.json"


def test_dumps_is_json_with_one_rule_a_line():
    rules = {"all_reduce": [[1024, ["a", "b"]], [None, ["b", "a"]]]}
    text = tune.dumps({"version": 1, "rules": rules, "empty": {}})
    assert json.loads(text) == {"version": 1, "rules": rules, "empty": {}}
    assert '  "all_reduce": [[1024, ["a", "b"]], [null, ["b", "a"]]]' in text.splitlines()


def test_tune_two_ranks_writes_a_table_a_communicator_loads(tmp_path):
    out = tmp_path / "cpu_w2.json"
    res = bench("tune", "-g", "2", "--device", "cpu", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0",
                "-o", str(out))
    assert res.returncode == 0, res.stderr
    rows = table_rows(res.stdout)
    assert len(rows) == 5 * 2  # 5 ops x 2 sizes, one path (torch) on CPU
    assert "symm_mem" not in res.stdout  # torch's comparison columns are never tuned: auto cannot pick them
    assert all(w_oop == "0" and w_ip in ("0", "N/A") for _, _, w_oop, w_ip in rows)
    for op in tune.KEYS:
        if ":" not in op:
            assert f"# Collective test concluded: symcomm-bench {op}" in res.stdout

    payload = json.loads(out.read_text())
    tuned = check_tuning(payload)
    assert (tuned.gpu, tuned.world_size) == ("cpu", 2)
    # one path on CPU ranks identically in place: only the out-of-place rows remain
    assert set(payload["rules"]) == {key for key in tune.KEYS if ":" not in key}
    assert all(steps[-1][0] is None for steps in payload["rules"].values())
    assert tuned.rules["all_reduce"][-1] == (INF, ("torch",))
    for key in ("nccl", "torch", "date", "command", "dtype", "timing", "sizes", "times_us", "wrong"):
        assert key in payload
    assert payload["command"].startswith("symcomm-bench tune -g 2") and payload["dtype"] == "bfloat16"
    assert payload["sizes"] == [1024, 2048]
    assert all(len(ts) == 2 and all(t > 0 for t in ts)
               for per_path in payload["times_us"].values() for ts in per_path.values())

    # The table loads in a communicator: the bench's header reports capabilities()["tuning_table"].
    # (Refusing it at another world size is test_dispatch's.)
    used = bench("all_reduce", "-g", "2", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1",
                 SYMCOMM_TUNING_FILE=str(out))
    assert used.returncode == 0, used.stderr
    assert f"auto follows the {out} table" in used.stdout
