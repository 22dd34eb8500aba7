"""symcomm-bench's PyTorch symmetric-memory columns on GPUs (symcomm/bench/torch_symm.py):
torch's one- and two-shot all-reduce at small odd sizes, checked as every column is (#wrong 0
against the float64 reference), eagerly and captured in a CUDA graph, through the bench's own
Runner; what torch would refuse is N/A with the reason, on every rank alike."""
from __future__ import annotations

import math

import pytest

from symcomm.bench import cli, report, runner
from symcomm.bench.torch_symm import ONE_SHOT, TWO_SHOT

COLUMNS = f"{ONE_SHOT},{TWO_SHOT}"


def _runner(comm, datatype: str, graph: int, sizes: list[int]) -> runner.Runner:
    # Plain buffers: torch's columns read their own symm_mem buffer, and the session's pool
    # stays as the other tests left it.
    args = cli.build_parser().parse_args(["all_reduce", "-d", datatype, "--algo", COLUMNS, "-n", "3", "-w", "1",
                                          "-G", str(graph), "--no-symmetric"])
    cfg = cli.build_config(args, "cuda")
    cfg.sizes = sizes  # sizes no -b/-e/-f sweep makes; the runner sizes its buffers for them
    return runner.Runner(cfg, comm)


def _measure(run: runner.Runner) -> dict[tuple[str, int], report.SizeRow]:
    progress = report.Progress(0, None)
    return {(row.algo, row.nbytes): row for n in run.cfg.sizes for row in run.measure_size("all_reduce", n, progress)}


@pytest.mark.parametrize("graph", [0, 2], ids=["eager", "graph"])
def test_one_and_two_shot_are_right_at_odd_float_sizes(comm, graph):
    """1, 3, 1001 and 262145 floats: no count a multiple of 16 bytes, each a whole 4-byte word."""
    sizes = [4, 12, 4004, 1048580]
    rows = _measure(_runner(comm, "float", graph, sizes))
    for column in (ONE_SHOT, TWO_SHOT):
        for n in sizes:
            for side in (rows[column, n].out_of_place, rows[column, n].in_place):
                assert not math.isnan(side.time_us) and side.time_us > 0, (column, n, side)
                assert side.wrong == 0, (column, n, side)


@pytest.mark.parametrize("graph", [0, 2], ids=["eager", "graph"])
def test_bfloat16_runs_at_even_counts_and_is_refused_at_odd_ones(comm, graph):
    """1002 and 32770 bfloat16s run (4-byte words, not 16-byte ones); 3 of them, half a word
    over, is torch's refusal, made before any rendezvous on every rank alike."""
    run = _runner(comm, "bfloat16", graph, [6, 2004, 65540])
    rows = _measure(run)
    for column in (ONE_SHOT, TWO_SHOT):
        for n in (2004, 65540):
            for side in (rows[column, n].out_of_place, rows[column, n].in_place):
                assert side.wrong == 0 and side.time_us > 0, (column, n, side)
        refused = rows[column, 6]
        assert math.isnan(refused.out_of_place.time_us) and math.isnan(refused.in_place.time_us)
        assert "whole 4-byte words" in run.refused[column], run.refused


def test_a_whole_run_beside_auto_exits_clean_with_the_comparison_in_its_summary(comm, capsys):
    """runner.run as symcomm-bench runs it: the probe, the blocks, the summary's 'auto vs
    symm_mem' column; status 0 means no element was wrong on any rank."""
    args = cli.build_parser().parse_args(["all_reduce", "-d", "bfloat16", "--algo", f"auto,{COLUMNS}", "-b", "1K",
                                          "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "-G", "2", "--no-symmetric"])
    assert runner.run(cli.build_config(args, "cuda"), comm) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert f"# Using algo: {ONE_SHOT}" in out and f"# Using algo: {TWO_SHOT}" in out
        assert "'auto vs symm_mem' = the fastest of" in out
        assert "refused some calls" not in out
