"""symcomm.bench.plot: the series drawn per path, and the axis labels."""
import json
import math
import os

import pytest

from symcomm.bench import plot
from symcomm.bench import report as rp


def row(algo, nbytes, t):
    return rp.SizeRow(algo, nbytes, nbytes // 2, rp.Timing(t, 0), rp.Timing(t, 0))


def test_series_per_path_sorted_without_refused_points():
    rows = [row("nccl", 4096, 20.0), row("nccl", 1024, 10.0), row("nccl-symm", 1024, 5.0),
            row("nccl-symm", 4096, math.nan), row("auto", 1024, 5.5)]
    data = plot.series(rows, ["nccl", "nccl-symm", "auto", "custom-oneshot"], "all_reduce", 4)
    assert list(data) == ["nccl", "nccl-symm", "auto"]  # a path with no point draws no line
    sizes, times, busbw = data["nccl"]
    assert sizes == [1024, 4096] and times == [10.0, 20.0]
    assert busbw == [1024 / 10e3 * 1.5, 4096 / 20e3 * 1.5]  # algbw x 2(n-1)/n
    assert data["nccl-symm"][0] == [1024]


def test_size_labels_use_the_flag_spelling():
    assert [plot.size_label(v) for v in (512, 1024, 1536, 1 << 20, 256 << 20, 1 << 30)] == [
        "512", "1K", "1.5K", "1M", "256M", "1G"]


def test_json_record_plots_the_same_series(tmp_path):
    if os.environ.get("SYMCOMM_REQUIRE_MATPLOTLIB") != "1":  # .ci/run installs it and sets this
        pytest.importorskip("matplotlib")
    from test_bench_report import info

    rows = [row("nccl", 1024, 10.0), row("nccl", 4096, 20.0), row("nccl-symm", 1024, 5.0),
            row("nccl-symm", 4096, math.nan)]
    record = tmp_path / "run.json"
    record.write_text(json.dumps(rp.json_payload(info(world=4), rows, "2026-11-23")))
    run, back, algos = plot.from_json(json.loads(record.read_text()))
    assert algos == ["nccl", "nccl-symm"] and (run.op, run.world) == ("all_reduce", 4)
    assert plot.series(back, algos, run.op, run.world) == plot.series(rows, algos, "all_reduce", 4)
    png = tmp_path / "run.png"
    assert plot.main([str(record), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.main([str(png), str(tmp_path / "again.png")]) == 2  # not a JSON record
