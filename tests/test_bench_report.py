"""symcomm.bench.report: busbw factors and nccl-tests' exact table layout, JSON, summary."""
import io
import json

import pytest

from symcomm.bench import report as rp

# Lines printed by nccl-tests' all_reduce_perf (16 ranks, float, sum). Our formatter must
# reproduce them character for character from the same numbers.
NCCL_TESTS_HEADER = [
    "#                                                              out-of-place                       in-place          ",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
]
NCCL_TESTS_ROWS = [
    "           8             2     float     sum      -1    135.8    0.00    0.00      0    123.5    0.00    0.00      0",
    "        1024           256     float     sum      -1    147.1    0.01    0.01      0    123.1    0.01    0.02      0",
    "       65536         16384     float     sum      -1    159.4    0.41    0.77      0    157.6    0.42    0.78      0",
    "    33554432       8388608     float     sum      -1   1059.9   31.66   59.36      0   1054.0   31.84   59.69      0",
    "  2147483648     536870912     float     sum      -1    12646  169.81  318.40      0    12641  169.88  318.52      0",
]
TIMES = [(8, 2, 135.8, 123.5), (1024, 256, 147.1, 123.1), (65536, 16384, 159.4, 157.6),
         (33554432, 8388608, 1059.9, 1054.0), (2147483648, 536870912, 12646.3, 12641.2)]


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


@pytest.mark.parametrize("us,text", [(4.0912, "   4.09"), (99.994, "  99.99"), (100.0, "  100.0"),
                                     (9999.94, " 9999.9"), (10000.0, "  10000"), (123456.7, " 123457")])
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
        "        4096           512  bfloat16    none      -1     4.50    0.91    0.68    N/A"
        "     3.25    1.26    0.95      7")


def test_footer_counts_wrong_and_averages_both_columns():
    run = info()
    ok = rp.footer_lines(rows(), run)
    busbws = [rp.algbw_gbs(b, t) * 1.875 for b, _, t1, t2 in TIMES for t in (t1, t2)]
    assert ok == ["# Out of bounds values : 0 OK",
                  "# Avg bus bandwidth    : %g " % (sum(busbws) / len(busbws)), "#"]
    assert rp.footer_lines(rows(wrong=2), run)[0] == "# Out of bounds values : 20 FAILED"


def test_header_has_nccl_tests_first_line_and_device_lines():
    dev = rp.DeviceInfo(1, 4242, "node7", 3, (0, 0x1b, 0), "NVIDIA H200")
    cpu = rp.DeviceInfo(0, 17, "laptop", None, None, "AMD EPYC")
    lines = rp.header_lines(info(devices=[cpu, dev], notes=["Buffers: plain"]))
    assert lines[0] == ("# nThread 1 nGpus 1 minBytes 8 maxBytes 2147483648 step: 2(factor) "
                        "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0")
    assert "# Buffers: plain" in lines
    assert "#  Rank  1 Group  0 Pid   4242 on      node7 device  3 [0000:1b:00] NVIDIA H200" in lines
    assert "#  Rank  0 Group  0 Pid     17 on     laptop device cpu [cpu] AMD EPYC" in lines


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
    assert cells == ["1024", "10.00", "4.00", "5.00", "nccl-symm", "2.50x", "2.00x"]
    assert rp.pick_baseline(["torch", "auto"]) == "torch"
