"""scripts/compare.py: nccl-tests' stdout and symcomm-bench's JSON side by side.

The nccl-tests text here is written by hand in its table layout (size, count, type, redop, root,
then time, algbw, busbw, #wrong out of place and in place); the symcomm-bench JSON comes from
the real CLI over gloo at world 2, so a change to its record that compare.py cannot read fails
here, and from hand-made records where exact numbers matter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional, Sequence

import pytest

from symcomm.bench import ops

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SYMCOMM_BENCH_CORRUPT")


def _load() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("compare", ROOT / "scripts" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


compare = _load()

# Two sizes of an all_reduce at world 2, bf16, with a warning line and a row whose out-of-place
# time needs the exponent form, as a 7-character column prints very large times.
SAMPLE = """\
# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 2 minBytes 1024 maxBytes 4194304 step: 4096(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 20 unalign: 0
#
# Using devices
#  Rank  0 Group  0 Pid   4242 on       host device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   4242 on       host device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
host:4242:4250 [0] NCCL WARN something NCCL says on the way
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
        1024           512  bfloat16     sum      -1     6.03    0.17    0.17       0     5.90    0.17    0.17     N/A
     4194304       2097152  bfloat16     sum      -1  1.2e+05    0.03    0.03       0    34.31  122.25  122.25       0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 30.6546
#
# Collective test concluded: all_reduce_perf
"""


def nccl_tests_text(rows: Sequence[tuple[int, int, float, int]], world: int, type_name: str = "bfloat16",
                    redop: str = "sum", footer: bool = True, library: int = 22809) -> str:
    """nccl-tests-style stdout: one row per (size, count, out-of-place us, #wrong out of place)."""
    lines = [f"# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library={library}",
             f"# nThread 1 nGpus {world} minBytes 1024 maxBytes 4096 step: 4(factor) warmup iters: 5 iters: 20",
             "#"]
    for size, count, time_us, wrong in rows:
        bw = size / time_us / 1e3
        side = f"  {time_us:7.2f}  {bw:6.2f}  {bw:6.2f}  {{:6d}}"
        lines.append(f"{size:12d}  {count:12d}  {type_name:>8s}  {redop:>6s}  {-1:6d}"
                     + side.format(wrong) + side.format(0))
    if footer:
        lines.append(f"# Out of bounds values : {sum(r[3] for r in rows)} OK")
    return "\n".join(lines) + "\n"


def symcomm_payload(op: str, times: dict[int, dict[str, Optional[float]]], world: int = 2,
                    dtype: str = "bfloat16", wrong: int = 0) -> dict:
    """A record in symcomm-bench's layout (report.json_payload): out of place and in place per
    path and size; ``wrong`` lands on the first path's first in-place column."""
    rows = []
    for nbytes, by_path in times.items():
        for algo, time_us in by_path.items():
            for inplace in (False, True):
                rows.append({"algo": algo, "bytes": nbytes, "count": nbytes // 2, "time_us": time_us,
                             "algbw": None, "busbw": None, "inplace": inplace, "wrong": 0})
    rows[1]["wrong"] = wrong
    return {"schema": "symcomm-bench/1", "op": op, "dtype": dtype, "redop": "sum", "world_size": world,
            "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130",
            "nccl": "2.28.9", "date": "2026-11-28T00:00:00+00:00", "graph_replays": 20, "iters": 20,
            "warmup_iters": 5, "rounds": 3, "rows": rows}


def write_op(folder: Path, op: str, r0: Optional[str], r2: Optional[str], payload: Optional[dict]) -> None:
    for mode, text in (("R0", r0), ("R2", r2)):
        if text is not None:
            (folder / f"{op}_nccl_tests_{mode}.txt").write_text(text)
    if payload is not None:
        (folder / f"{op}_symcomm.json").write_text(json.dumps(payload))


# -------------------------------------------------------------------------- parsing
def test_nccl_tests_rows_header_and_footer():
    run = compare.parse_nccl_tests(SAMPLE)
    assert sorted(run.rows) == [1024, 4194304]
    small = run.rows[1024]
    assert (small.count, small.type_name, small.redop) == (512, "bfloat16", "sum")
    assert small.out_of_place == compare.Side(6.03, 0)
    assert small.in_place == compare.Side(5.90, None)  # N/A: not checked
    assert run.rows[4194304].out_of_place.time_us == 1.2e5
    assert run.world == 2 and run.library == "2.28.9" and run.footer_wrong == 0 and run.wrong == 0
    assert run.version.startswith("nccl-tests version 2.19.6")


def test_a_run_cut_short_has_no_footer_and_wrong_counts_add_up():
    run = compare.parse_nccl_tests(nccl_tests_text([(1024, 256, 5.0, 3), (4096, 1024, 6.0, 2)], 2, footer=False))
    assert run.footer_wrong is None and run.wrong == 5
    assert compare.parse_nccl_tests("").rows == {}


def test_sizes_mean_the_same_bytes_on_both_sides():
    """nccl-tests' size column: count // world elements per rank, times world (whole output of a
    gather, whole input of a reduce-scatter). symcomm-bench's layouts must give the same bytes,
    or the rows would not meet."""
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        spec = ops.spec(op)
        for world in (2, 3, 4, 8):
            for nbytes in (1024, 1000, 4 << 20):
                itemsize = 2
                per_rank = nbytes // itemsize if op == "all_reduce" else nbytes // itemsize // world
                expected = per_rank * itemsize * (1 if op == "all_reduce" else world)
                assert spec.layout(nbytes, world, itemsize, 0).nbytes == expected, (op, world, nbytes)


# ----------------------------------------------------------------------- comparison
def test_ratios_best_path_and_symm_mem_columns(tmp_path):
    times = {1024: {"nccl": 6.0, "nccl-symm": 3.9, "custom-oneshot": 3.5, "auto": 3.6, "symm_mem": 3.0,
                    "torch": None},
             4096: {"nccl": 7.0, "nccl-symm": 4.5, "custom-oneshot": 4.0, "auto": 4.0, "symm_mem": 9.0,
                    "torch": 30.0}}
    write_op(tmp_path, "all_reduce", nccl_tests_text([(1024, 512, 6.0, 0), (4096, 2048, 7.0, 0)], 2),
             nccl_tests_text([(1024, 512, 3.8, 0), (4096, 2048, 5.0, 0)], 2),
             symcomm_payload("all_reduce", times))
    [result] = compare.compare_folder(tmp_path)
    assert result.problems == [] and result.symm_mem_paths == ["symm_mem"] and result.world == 2
    small, large = result.rows
    assert (small.best_path, small.best_path_us) == ("custom-oneshot", 3.5)  # neither auto nor symm_mem
    assert small.auto_vs_nccl_tests == pytest.approx(3.6 / 3.8)
    assert small.auto_vs_best == pytest.approx(3.6 / 3.0)  # PyTorch's symmetric memory wins here
    assert large.auto_vs_nccl_tests == pytest.approx(4.0 / 5.0)
    assert large.auto_vs_best == pytest.approx(4.0 / 5.0)
    text = "\n".join(compare.markdown(result))
    assert "| 1 KiB | 6.00 | 3.80 | 3.60 | 3.50 (custom-oneshot) | 3.00 | 0.95 | **1.20!** |" in text
    assert "| 4 KiB | 7.00 | 5.00 | 4.00 | 4.00 (custom-oneshot) | 9.00 | 0.80 | 0.80 |" in text
    assert "auto slower than the best yardstick at 1 of 2 sizes; worst 1.20 at 1 KiB." in text
    assert compare.exit_status([result]) == 0


def test_without_symm_mem_the_second_ratio_says_so(tmp_path):
    write_op(tmp_path, "all_gather", nccl_tests_text([(1024, 256, 5.0, 0)], 2, redop="none"),
             nccl_tests_text([(1024, 256, 4.0, 0)], 2, redop="none"),
             symcomm_payload("all_gather", {1024: {"nccl": 5.1, "auto": 4.2}}))
    [result] = compare.compare_folder(tmp_path)
    assert result.symm_mem_paths == [] and result.rows[0].auto_vs_best == pytest.approx(4.2 / 4.0)
    assert "symm_mem: none ran" in "\n".join(compare.markdown(result))


VERIFIED = ROOT / "bench" / "results" / "2026-11-28_nvidia-h200-x2_w2_verify_4cee139" / "compare_w2"


def test_a_real_call_gets_auto_of_link_peak_from_the_link_record():
    """The 2x H200 comparison of 2026-11-28 (nccl-tests R0/R2 text, symcomm-bench JSON with its
    link copies), read as recorded: auto's wire bytes per second over the copy's peak."""
    results = {r.op: r for r in compare.compare_folder(VERIFIED)}
    assert compare.exit_status(results.values()) == 0
    gather = results["all_gather"]
    assert gather.link_peak_gbs == pytest.approx(369.48) and gather.link_refusal is None
    last = gather.rows[-1]  # 256 MiB: (W-1)/W of it crosses, in auto's 399.65 us
    assert last.nbytes == 256 << 20 and last.of_link_peak == pytest.approx((128 << 20) / 399.65e3 / 369.48, rel=1e-3)
    text = "\n".join(compare.markdown(results["all_reduce"]))
    assert "| auto of link peak |" in text and "| 0.81 |" in text
    assert "peaked at 380.8 GB/s" in text


def test_a_refused_link_copy_is_one_line_and_no_column(tmp_path):
    payload = symcomm_payload("all_gather", {1024: {"nccl": 5.1, "auto": 4.2}})
    payload["link"] = {"factor": 0.5, "copy_us": {}, "wrong": 0, "refusal": "rank 1 is on another host (b)",
                       "peak_gbs": None}
    write_op(tmp_path, "all_gather", nccl_tests_text([(1024, 256, 5.0, 0)], 2, redop="none"),
             nccl_tests_text([(1024, 256, 4.0, 0)], 2, redop="none"), payload)
    [result] = compare.compare_folder(tmp_path)
    text = "\n".join(compare.markdown(result))
    assert "Link: not measured: rank 1 is on another host (b)." in text and "auto of link peak" not in text
    assert result.rows[0].of_link_peak is None


@pytest.mark.parametrize("where", ["R0", "R2", "symcomm"])
def test_any_wrong_element_fails_with_1(tmp_path, where):
    rows = [(1024, 512, 6.0, 1 if where == "R0" else 0)]
    write_op(tmp_path, "all_reduce", nccl_tests_text(rows, 2),
             nccl_tests_text([(1024, 512, 6.0, 2 if where == "R2" else 0)], 2),
             symcomm_payload("all_reduce", {1024: {"nccl": 6.0, "auto": 5.0}}, wrong=4 if where == "symcomm" else 0))
    assert compare.main([str(tmp_path)]) == 1
    [result] = compare.compare_folder(tmp_path)
    assert result.wrong[where] in (1, 2, 4)


@pytest.mark.parametrize("case, problem", [
    ("world", "world differs: nccl-tests -R 0 4, symcomm 2"),
    ("dtype", "datatype differs: nccl-tests -R 0 float, symcomm bfloat16"),
    ("nccl", "NCCL differs: nccl-tests -R 0 ran 2.28.3, symcomm 2.28.9"),
    ("footer", "nccl-tests -R 0: no footer, the run did not finish"),
    ("missing", "nccl-tests -R 2: no output"),
    ("json", "symcomm-bench: no JSON"),
])
def test_what_makes_numbers_incomparable_exits_2(tmp_path, case, problem):
    r0 = nccl_tests_text([(1024, 512, 6.0, 0)], 4 if case == "world" else 2,
                         type_name="float" if case == "dtype" else "bfloat16",
                         footer=case != "footer", library=22803 if case == "nccl" else 22809)
    r2 = None if case == "missing" else nccl_tests_text([(1024, 512, 4.0, 0)], 2)
    payload = None if case == "json" else symcomm_payload("all_reduce", {1024: {"nccl": 6.0, "auto": 4.0}})
    write_op(tmp_path, "all_reduce", r0, r2, payload)
    [result] = compare.compare_folder(tmp_path)
    assert problem in result.problems
    assert compare.main([str(tmp_path)]) == 2


def test_an_empty_folder_exits_2(tmp_path, capsys):
    assert compare.main([str(tmp_path)]) == 2
    assert "PROBLEM: no inputs" in capsys.readouterr().out


# ------------------------------------------------ end to end, with the real symcomm-bench
def _bench_env() -> dict[str, str]:
    # Under torchrun the test process has RANK/WORLD_SIZE; symcomm-bench must start its own ranks.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory) -> Path:
    """symcomm-bench all_gather --algo all over gloo at world 2, 1 KiB to 4 KiB, as --json writes it."""
    folder = tmp_path_factory.mktemp("gloo")
    out = folder / "all_gather_symcomm.json"
    res = subprocess.run([sys.executable, "-m", "symcomm.bench", "all_gather", "-g", "2", "--device", "cpu",
                          "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "--algo", "all",
                          "--json", str(out)],
                         cwd=ROOT, env=_bench_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return folder


def test_the_real_cli_json_against_nccl_tests_text(gloo_run, tmp_path):
    payload = json.loads((gloo_run / "all_gather_symcomm.json").read_text())
    sizes = sorted({row["bytes"] for row in payload["rows"]})
    assert sizes == [1024, 4096] and payload["dtype"] == "float" and payload["world_size"] == 2
    auto = {row["bytes"]: row["time_us"] for row in payload["rows"] if row["algo"] == "auto" and not row["inplace"]}
    (tmp_path / "all_gather_symcomm.json").write_text(json.dumps(payload))
    # float, as symcomm-bench's CPU default; counts per rank, as both tools print them for gathers
    rows = [(size, size // 4 // 2, 1e9, 0) for size in sizes]  # a yardstick no CPU run can beat
    for mode in ("R0", "R2"):
        (tmp_path / f"all_gather_nccl_tests_{mode}.txt").write_text(
            nccl_tests_text(rows, 2, type_name="float", redop="none"))
    md, js = tmp_path / "compare.md", tmp_path / "compare.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), str(tmp_path), "--md", str(md),
                          "--json", str(js)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    table = md.read_text().split("### all_gather, world 2")[1].split("#wrong")[0]
    assert "| 1 KiB |" in table and "**" not in table  # no ratio above 1
    record = json.loads(js.read_text())["ops"]["all_gather"]
    assert [r["bytes"] for r in record["rows"]] == sizes
    assert [r["auto_us"] for r in record["rows"]] == [auto[s] for s in sizes]
    assert all(r["best_path"] for r in record["rows"]) and record["problems"] == []
    assert record["wrong"] == {"R0": 0, "R2": 0, "symcomm": 0}
