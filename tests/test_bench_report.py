"""symcomm.bench.report: busbw factors and nccl-tests' exact table layout, JSON, summary."""
import io
import json
import os
import sys
from pathlib import Path

import pytest

from symcomm.bench import report as rp

# Lines printed by nccl-tests 2.18.3's all_reduce_perf (16 ranks, float, sum): the layout of
# current nccl-tests (the reference numbers in docs/measuring.md used 2.19.6). Our formatter must reproduce them character for
# character from the same numbers.
NCCL_TESTS_HEADER = [
    "#                                                              out-of-place                       in-place          ",
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong ",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         ",
]
NCCL_TESTS_ROWS = [
    "        1024           256     float     sum      -1    66.03    0.02    0.03       0    57.88    0.02    0.03       0",
    "     4194304       1048576     float     sum      -1  4355.19    0.96    1.81       0   757.17    5.54   10.39       0",
    "   268435456      67108864     float     sum      -1  12342.0   21.75   40.78       0  15660.4   17.14   32.14       0",
    "  2147483648     536870912     float     sum      -1   105680   20.32   38.10       0   105789   20.30   38.06       0",
    "  8589934592    2147483648     float     sum      -1   424241   20.25   37.96       0   422831   20.32   38.09       0",
]
TIMES = [(1024, 256, 66.03, 57.88), (4194304, 1048576, 4355.19, 757.17),
         (268435456, 67108864, 12342.0, 15660.4), (2147483648, 536870912, 105680.0, 105789.0),
         (8589934592, 2147483648, 424241.0, 422831.0)]
GOLDEN = Path(__file__).resolve().parent / "golden"


def info(op="all_reduce", world=16, redop="sum", **kw):
    base = dict(op=op, world=world, type_name="float", redop=redop, minbytes=8, maxbytes=1 << 31,
                stepfactor=2, warmup=5, iters=20, check=True, graph=0, device="cuda",
                device_name="NVIDIA H200", backend="nccl", torch_version="2.11.0",
                nccl_version="2.28.9")
    base.update(kw)
    return rp.RunInfo(**base)


def rows(wrong=0, algo="auto"):
    return [rp.SizeRow(algo, b, c, rp.Timing(t1, wrong), rp.Timing(t2, wrong)) for b, c, t1, t2 in TIMES]


@pytest.mark.parametrize("op,world,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("all_gatherv", 4, 0.75), ("reduce_scatter", 2, 0.5),
    ("reduce_scatterv", 8, 0.875),
])
def test_bus_factors(op, world, factor):
    assert rp.bus_factor(op, world) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_op():
    with pytest.raises(ValueError):
        rp.bus_factor("broadcastish", 4)


@pytest.mark.parametrize("us,text", [(4.0912, "   4.09"), (99.994, "  99.99"), (100.0, " 100.00"),
                                     (9999.994, "9999.99"), (10000.0, "10000.0"), (99999.94, "99999.9"),
                                     (100000.0, " 100000"), (1234567.8, "1234568")])
def test_time_column_keeps_seven_characters(us, text):
    assert rp.format_time(us) == text


def test_column_header_matches_nccl_tests():
    assert rp.column_header() == NCCL_TESTS_HEADER


def test_rows_match_nccl_tests_golden_output():
    assert [rp.format_row(r, info()) for r in rows()] == NCCL_TESTS_ROWS


def test_row_without_check_and_with_wrong_elements():
    run = info(op="all_gather", world=4, redop="none", type_name="bfloat16")
    row = rp.SizeRow("nccl", 4096, 512, rp.Timing(4.5, None), rp.Timing(3.25, 7))
    assert rp.format_row(row, run) == (
        "        4096           512  bfloat16    none      -1     4.50    0.91    0.68     N/A"
        "     3.25    1.26    0.95       7")


def test_footer_counts_wrong_and_averages_both_columns():
    run = info()
    ok = rp.footer_lines(rows(), run)
    busbws = [rp.algbw_gbs(b, t) * 1.875 for b, _, t1, t2 in TIMES for t in (t1, t2)]
    assert ok == ["# Out of bounds values : 0 OK",
                  "# Avg bus bandwidth    : %g " % (sum(busbws) / len(busbws)), "#"]
    assert rp.footer_lines(rows(wrong=2), run)[0] == "# Out of bounds values : 20 FAILED"


def test_header_has_nccl_tests_preamble_and_device_lines():
    dev = rp.DeviceInfo(1, 4242, "node7", 3, (0, 0x1b, 0), "NVIDIA H200")
    cpu = rp.DeviceInfo(0, 17, "laptop", None, None, "AMD EPYC")
    lines = rp.header_lines(info(devices=[cpu, dev], notes=["Buffers: plain"], version="9.9"))
    assert lines[:5] == [
        "# symcomm-bench version 9.9 nccl-library=2.28.9 torch=2.11.0",
        "# Collective test starting: symcomm-bench all_reduce",
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 2147483648 step: 2(factor) "
        "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    assert lines[5:8] == ["#  Rank  0 Group  0 Pid     17 on     laptop device cpu [cpu] AMD EPYC",
                          "#  Rank  1 Group  0 Pid   4242 on      node7 device  3 [0000:1b:00] NVIDIA H200",
                          "#"]
    assert "# Buffers: plain" in lines[8:] and lines[-1] == "#"


def test_block_names_the_algo_then_the_table():
    block = rp.format_block("nccl-symm", rows(), info())
    assert block[0] == "# Using algo: nccl-symm"
    assert block[2:5] == NCCL_TESTS_HEADER
    assert block[5:10] == NCCL_TESTS_ROWS
    assert block[10] == "# Out of bounds values : 0 OK"


def test_json_payload_schema():
    payload = rp.json_payload(info(), rows(), "2026-11-21T00:00:00+00:00")
    assert payload["schema"] == "symcomm-bench/1"
    for key in ("op", "dtype", "world_size", "device_name", "torch", "nccl", "date",
                "graph_replays", "iters", "rows"):
        assert key in payload
    assert len(payload["rows"]) == 2 * len(TIMES)
    first = payload["rows"][0]
    assert set(first) == {"algo", "bytes", "count", "time_us", "algbw", "busbw", "wrong", "inplace"}
    assert first["inplace"] is False and payload["rows"][1]["inplace"] is True
    assert first["busbw"] == pytest.approx(first["algbw"] * 1.875)
    json.dumps(payload)  # serialisable as is


def test_summary_table_names_winner_and_speedup():
    both = [rp.SizeRow("nccl", 1024, 256, rp.Timing(10.0, 0), rp.Timing(10.0, 0)),
            rp.SizeRow("nccl-symm", 1024, 256, rp.Timing(4.0, 0), rp.Timing(4.0, 0)),
            rp.SizeRow("auto", 1024, 256, rp.Timing(5.0, 0), rp.Timing(5.0, 0))]
    out = io.StringIO()
    rp.print_summary(both, ["nccl", "nccl-symm", "auto"], out)
    text = out.getvalue()
    line = next(l for l in text.splitlines() if "1024" in l)
    cells = [c.strip() for c in line.strip("│┃| ").split("│")]
    assert cells == ["1024", "10.00", "4.00", "5.00", "nccl-symm", "2.50x", "2.00x", "0.80x"]
    assert rp.pick_baseline(["torch", "auto"]) == "torch"


def test_conclusion_names_the_test():
    assert rp.conclusion_lines(info(op="reduce_scatter")) == [
        "# Collective test concluded: symcomm-bench reduce_scatter", "#"]


def golden_output() -> str:
    """A whole non-streaming report (--algo all) from fixed numbers: header, one block per
    path (one refused size), the conclusion and the comparison table."""
    devs = [rp.DeviceInfo(r, 1000 + r, "node0", r, (0, 0x18 + r, 0), "NVIDIA H200") for r in range(4)]
    run = info(op="all_reduce", world=4, type_name="bfloat16", minbytes=1024, maxbytes=1 << 28,
               stepfactor=16, graph=10, devices=devs, version="0.1.0",
               notes=["Paths on this communicator: nccl, nccl-symm, torch; auto follows the builtin table",
                      "Buffers: symmetric (pool of 520 MiB reserved per rank)"])
    times = {"nccl": [9.05, 10.9, 19.73, 99.09, 1166.58, 4660.31, 18620.2],
             "nccl-symm": [4.09, 9.45, 19.75, 113.08, 1552.38, float("nan"), float("nan")],
             "auto": [4.12, 9.51, 19.8, 99.5, 1170.0, 4670.0, 18630.0]}
    rows = []
    for algo, ts in times.items():
        for i, t in enumerate(ts):
            nbytes = 1024 * 16 ** i if i < 5 else (1 << 30) * 4 ** (i - 5)
            wrong = None if t != t else (3 if (algo, i) == ("auto", 1) else 0)
            rows.append(rp.SizeRow(algo, nbytes, nbytes // 2, rp.Timing(t, wrong), rp.Timing(t * 0.98, wrong)))
    out = io.StringIO()
    emit = rp.Emitter(True, out)
    emit(rp.header_lines(run))
    rp.emit_blocks(emit, run, rows, list(times), {"nccl-symm": "nccl-symm at 1073741824 B out-of-place: too big"})
    return out.getvalue()


def test_whole_report_matches_golden_file():
    path = GOLDEN / "report_all_reduce_w4.txt"
    text = golden_output()
    if os.environ.get("SYMCOMM_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), "rerun with SYMCOMM_UPDATE_GOLDEN=1 after a deliberate change"


def test_progress_lines_name_each_measurement_as_it_starts(capsys):
    with rp.Progress(2, "lines") as progress:
        progress.starting("all_reduce 1024 B auto, round 1 of 1")
        progress.advance("all_reduce 1024 B auto")
        progress.starting("all_reduce 2048 B auto, round 1 of 1")
    out, err = capsys.readouterr()
    assert out == ""  # never stdout: the table's
    assert err.splitlines() == ["# progress 1/2: all_reduce 1024 B auto, round 1 of 1",
                                "# progress 2/2: all_reduce 2048 B auto, round 1 of 1"]


def test_progress_mode_bar_on_a_terminal_lines_in_a_log_nothing_off_lead(monkeypatch):
    from symcomm.bench.runner import progress_mode
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress_mode(True, False) == "bar"
    assert progress_mode(True, True) is None  # rows stream to the same terminal
    assert progress_mode(False, False) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_mode(True, True) == "lines"
    assert progress_mode(False, True) is None
