"""symcomm-bench end to end on CPU over gloo, plus argument handling and bad-input exits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from symcomm.bench import cli, ops

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SYMCOMM_BENCH_CORRUPT")


def clean_env(**extra):
    # Under torchrun the test process itself has RANK/WORLD_SIZE; the CLI must not inherit them.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def bench(*args, timeout=120, **env):
    return subprocess.run([sys.executable, "-m", "symcomm.bench", *args], cwd=ROOT,
                          env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def table_rows(stdout):
    """Data rows of every nccl-tests block: (bytes, count, wrong out-of-place, wrong in-place)."""
    rows = []
    for line in stdout.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) != 13 or not fields[0].isdigit():
            continue  # comments, and the rich summary's rows
        rows.append((int(fields[0]), int(fields[1]), fields[8], fields[12]))
    return rows


@pytest.fixture
def no_launcher_env(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)


def test_all_reduce_two_ranks_table_and_json(tmp_path):
    out = tmp_path / "run.json"
    res = bench("all_reduce", "-g", "2", "--device", "cpu", "-b", "1K", "-e", "64K", "-n", "2",
                "-w", "1", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("# symcomm-bench version ")
    assert lines[1] == "# Collective test starting: symcomm-bench all_reduce"
    assert lines[2].startswith("# nThread 1 nGpus 1 minBytes 1024 maxBytes 65536 step: 2(factor)")
    assert lines[-2:] == ["# Collective test concluded: symcomm-bench all_reduce", "#"]
    assert "# Using algo: auto" in lines
    assert sum(l.startswith("#  Rank ") for l in lines) == 2   # one device line per rank
    rows = table_rows(res.stdout)
    assert [(b, c) for b, c, _, _ in rows] == [(1024 << i, 256 << i) for i in range(7)]
    assert all(w_oop == "0" and w_ip == "0" for _, _, w_oop, w_ip in rows)
    assert "# Out of bounds values : 0 OK" in lines

    payload = json.loads(out.read_text())
    assert payload["schema"] == "symcomm-bench/1"
    assert (payload["op"], payload["dtype"], payload["world_size"]) == ("all_reduce", "float", 2)
    assert payload["iters"] == 2 and payload["graph_replays"] == 0
    assert payload["torch"] == torch.__version__ and payload["date"]
    assert payload["root"] == -1 and payload["refused"] == {}
    assert any(note.startswith("Check: seeded random data (seed 0)") for note in payload["notes"]), payload["notes"]
    assert len(payload["rows"]) == 14
    for row in payload["rows"]:
        assert row["algo"] == "auto" and row["wrong"] == 0 and row["time_us"] > 0
        assert row["busbw"] == pytest.approx(row["algbw"])  # 2(n-1)/n = 1 at world 2
    assert sorted({r["bytes"] for r in payload["rows"]}) == [1024 << i for i in range(7)]
    assert {r["inplace"] for r in payload["rows"]} == {True, False}


def test_injected_error_is_counted_in_every_block():
    res = bench("reduce_scatterv", "-g", "2", "--device", "cpu", "-b", "1K", "-e", "4K", "-n", "1",
                "-w", "0", "--algo", "all", SYMCOMM_BENCH_CORRUPT="1")
    assert res.returncode == 1, res.stderr
    rows = table_rows(res.stdout)
    assert len(rows) == 3 * 2  # 3 sizes, blocks for "torch" and "auto"
    assert all(w_oop == "1" and w_ip == "1" for _, _, w_oop, w_ip in rows)
    assert res.stdout.count("# Out of bounds values : 6 FAILED") == 2
    assert "rank r gets floor(R*(r+1)/3)" in res.stdout
    assert "winner" in res.stdout  # the rich summary after the blocks


def test_injected_error_naming_no_rank_is_refused():
    # A hook that spoils nothing would let a run meant to fail pass.
    res = bench("all_gather", "-g", "2", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                SYMCOMM_BENCH_CORRUPT="2")
    assert res.returncode == 2, res.stderr
    assert "SYMCOMM_BENCH_CORRUPT=2 names no rank of this world (ranks 0 to 1)" in res.stderr


def _one_error_line(stderr):
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert "Traceback" not in stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("symcomm-bench: error: ")
    return lines[0]


SUBPROCESS_BAD_INPUT = [
    (["all_reduce", "-b", "2M", "-e", "1M"], "larger than"),
    (["all_to_all"], "invalid choice"),
    (["all_reduce", "-f", "1"], "stepfactor"),
    (["all_gather", "--device", "cpu", "-g", "4096"], "4096"),
]


def test_bad_input_exits_2_with_one_line():
    # Started together: each process spends most of its time importing torch.
    procs = [subprocess.Popen([sys.executable, "-m", "symcomm.bench", *args], cwd=ROOT,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args, _ in SUBPROCESS_BAD_INPUT]
    for proc, (args, needle) in zip(procs, SUBPROCESS_BAD_INPUT):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, stderr)
        assert needle in _one_error_line(stderr), args
        assert stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["all_reduce", "-b", "1X"], "-b/--minbytes"),
    (["all_reduce", "-n", "0"], "iters"),
    (["all_reduce", "-R", "0"], "-R/--rounds"),
    (["all_reduce", "-d", "float7"], "datatype"),
    (["all_reduce", "-d", "int32", "-o", "avg"], "floating-point"),
    (["all_reduce", "--device", "cpu", "-G", "4"], "--cudagraph"),
    (["all_reduce", "--device", "cpu", "-g", "0"], "at least 1"),
    (["all_reduce", "--unknown-flag"], "unrecognized"),
    (["all_reduce", "--device", "cpu", "--algo", "fastest"], "--algo fastest is not available on this communicator"),
    (["all_reduce", "--algo", "no such"], "not a path name"),
    (["all_reduce", "--algo", "torch,no such"], "not a path name"),
    (["all_reduce", "--algo", "all,torch"], "'all' stands alone"),
    (["all_reduce", "--algo", "torch,torch"], "names each column once"),
    (["all_reduce_rmsnorm", "--algo", "auto,unfused"], "columns are fixed"),
    # a MoE column by name: the message lists the columns rather than calling it a bad name
    (["moe", "--algo", "peer-push,peer-push:dispatch"], "every run measures all of them"),
    (["moe", "--algo", "peer-push:dispatch"], "moe's columns are fixed (all_to_all_single, a2a-buckets, a2a,"),
    (["all_reduce", "--device", "cpu", "--algo", "torch,fastest", "-b", "1K", "-e", "1K"],
     "(available: auto, all, torch, symm_mem-oneshot, symm_mem-twoshot)"),
    (["all_gatherv", "--device", "cpu", "--algo", "symm_mem-lowcontention", "-b", "1K", "-e", "1K"],
     "--algo symm_mem-lowcontention is not available"),
    # a comparison column alone that cannot run: one line with torch's reason, before the header
    (["all_reduce", "--device", "cpu", "--algo", "symm_mem-oneshot", "-b", "1K", "-e", "1K"],
     "on this cpu communicator: symm_mem-oneshot: torch's symmetric memory needs CUDA"),
    (["reduce_scatter", "--device", "cpu", "--algo", "symm_mem-lowcontention", "-b", "1K", "-e", "1K"],
     "symm_mem-lowcontention: torch's symmetric memory needs CUDA"),
    (["all_reduce", "--plot", "out.jpg"], "ending in .png"),
    (["all_gatherv_fp4", "--device", "cpu", "-d", "int32"], "quantizes bfloat16, half or float rows"),
    (["all_reduce_rmsnorm", "--device", "cpu", "-d", "float"], "normalises bfloat16 or half rows"),
    (["all_reduce_rmsnorm", "--device", "cpu", "-o", "max"], "-o takes only sum, not max"),  # it always sums
    (["tune", "-b", "2M", "-e", "1M"], "larger than"),
    (["tune", "--device", "cpu", "-G", "2"], "--cudagraph"),
    (["tune", "--algo", "nccl"], "unrecognized"),
    (["reduce_scatter", "--device", "cpu", "-g", "100000"], "CPU cores"),
])
def test_bad_input_in_process(args, needle, capsys, no_launcher_env):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert needle in _one_error_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_usage_error(capsys, no_launcher_env):
    assert cli.main(["all_reduce", "--device", "cuda"]) == 2
    assert "no CUDA device" in _one_error_line(capsys.readouterr().err)


def test_algo_missing_on_the_communicator_is_a_usage_error(capsys, monkeypatch):
    # The torchrun path, in process, as a world of one: the CPU communicator has no NCCL path.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(cli._free_port()))
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "nccl", "-b", "1K", "-e", "1K"]) == 2
    captured = capsys.readouterr()
    assert "not available on this communicator" in _one_error_line(captured.err)
    assert captured.out == ""
    assert not torch.distributed.is_initialized()  # torn down, so the process can init again


def test_algo_takes_a_list_of_paths_and_comparison_columns_and_tune_takes_none():
    args = cli.build_parser().parse_args(["all_reduce", "--algo", "auto,symm_mem-oneshot,symm_mem-twoshot"])
    assert cli.build_config(args, "cpu").algo == "auto,symm_mem-oneshot,symm_mem-twoshot"
    assert cli.build_config(cli.build_parser().parse_args(["all_reduce", "--algo", "all"]), "cpu").with_comparisons
    tuned = cli.build_tune_config(cli.build_tune_parser().parse_args([]), "cpu")
    assert (tuned.algo, tuned.with_auto, tuned.with_comparisons) == ("all", False, False)


def test_flags_map_to_config():
    args = cli.build_parser().parse_args(
        ["reduce_scatter", "-b", "1K", "-e", "1M", "-f", "4", "-n", "7", "-w", "3", "-c", "0",
         "-d", "half", "-o", "max", "--algo", "all", "--no-symmetric"])
    cfg = cli.build_config(args, "cpu")
    assert cfg.sizes == [1024, 4096, 16384, 65536, 262144, 1 << 20]
    assert (cfg.iters, cfg.warmup, cfg.check, cfg.type_name, cfg.redop) == (7, 3, False, "half", "max")
    assert (cfg.algo, cfg.symmetric, cfg.graph, cfg.graph_communicators) == ("all", False, 0, False)
    gathered = cli.build_config(cli.build_parser().parse_args(["all_gather"]), "cuda")
    redop_column = ops.spec(gathered.op).redop_label(gathered.redop)
    assert (gathered.type_name, redop_column, gathered.sizes) == ("bfloat16", "none", [32 << 20])


@pytest.fixture
def world_of_one(monkeypatch):
    """The torchrun path in this process, as a world of one over gloo."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(cli._free_port()))):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SYMCOMM_BENCH_CORRUPT", raising=False)
    yield
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("args", [
    ["all_reduce", "-o", "max", "-d", "int32"],
    ["all_gather", "-d", "bfloat16"],
    ["all_gatherv", "-d", "half"],
    ["reduce_scatter", "-o", "prod", "-d", "double"],
    ["reduce_scatterv", "-o", "avg", "-d", "float"],
    ["all_gatherv_fp4", "-d", "bfloat16", "--algo", "all"],
])
def test_every_op_runs_clean_in_one_process(args, world_of_one, capsys):
    assert cli.main([*args, "--device", "cpu", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0"]) == 0
    rows = table_rows(capsys.readouterr().out)
    blocks = 3 if args[0] == "all_gatherv_fp4" else 1  # unquantized, fp4, fp4+dequant
    assert len(rows) == 3 * blocks
    assert all(w_oop == "0" and w_ip in ("0", "N/A") for _, _, w_oop, w_ip in rows)


def test_rmsnorm_columns_run_clean_and_count_an_injected_wrong_element(world_of_one, capsys, monkeypatch):
    args = ["all_reduce_rmsnorm", "--device", "cpu", "-d", "bfloat16", "-b", "16K", "-e", "32K", "-n", "1", "-w", "0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(size, count) for size, count, *_ in rows] == [(16384, 8192), (32768, 16384)] * 6
    # On the CPU, torch's symmetric memory (the second block) cannot run: N/A, and it says why
    blocks = [rows[i:i + 2] for i in range(0, len(rows), 2)]
    absent = {1}
    assert all(w_oop == "N/A" and w_ip == "N/A" for i in absent for *_, w_oop, w_ip in blocks[i])
    assert all(w_oop == "0" and w_ip == "0"
               for i, block in enumerate(blocks) if i not in absent for *_, w_oop, w_ip in block)
    assert "Using algo: auto+nvfp4" in out and "Using algo: unfused" in out and "x is [tokens, 8192]" in out
    assert ("# symm_mem+torch refused some calls (N/A above), first: symm_mem+torch at 16384 B out-of-place: "
            "torch's symmetric memory needs CUDA") in out
    monkeypatch.setenv("SYMCOMM_BENCH_CORRUPT", "0")
    monkeypatch.setenv("MASTER_PORT", str(cli._free_port()))
    assert cli.main(args[:-6] + ["-b", "16K", "-e", "16K", "-n", "1", "-w", "0"]) == 1
    wrong = [(w_oop, w_ip) for *_, w_oop, w_ip in table_rows(capsys.readouterr().out)]
    assert wrong == [("1", "1"), ("N/A", "N/A")] + [("1", "1")] * 4


def test_torchs_symmetric_memory_columns_are_na_with_the_reason_on_the_cpu(world_of_one, capsys, tmp_path):
    """--algo all times PyTorch's symmetric memory beside the paths; on the CPU it cannot run:
    N/A in both modes, one reason line, null in the JSON, '-' in the summary, exit 0."""
    out = tmp_path / "ar.json"
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert [line for line in text.splitlines() if line.startswith("# Using algo:")] == [
        "# Using algo: torch", "# Using algo: auto", "# Using algo: symm_mem-oneshot", "# Using algo: symm_mem-twoshot"]
    rows = table_rows(text)  # 2 sizes of torch, auto, then the two N/A blocks
    assert all(w_oop == "0" and w_ip == "0" for *_, w_oop, w_ip in rows[:4])
    assert [line for line in text.splitlines() if line.split()[5:] == ["N/A"] * 8] == [
        line for line in text.splitlines() if not line.startswith("#")][4:8]
    for column in ("symm_mem-oneshot", "symm_mem-twoshot"):
        assert (f"# {column} refused some calls (N/A above), first: {column} at 1024 B out-of-place: "
                "torch's symmetric memory needs CUDA") in text
    assert "out-of-place and in-place time the same call" in text  # the header's note on the columns
    assert "'auto vs symm_mem' = the fastest of symm_mem-oneshot, symm_mem-twoshot's times" in text
    summary = [line for line in text.splitlines() if line.startswith("│")]
    assert len(summary) == 2 and all(line.rstrip("│ ").endswith("-") for line in summary)
    payload = json.loads(out.read_text())["rows"]
    theirs = [r for r in payload if r["algo"].startswith("symm_mem-")]
    assert len(theirs) == 8 and all(r["time_us"] is None and r["wrong"] is None for r in theirs)


def test_all_gather_lists_the_low_contention_column_and_the_v_ops_none(world_of_one, capsys):
    assert cli.main(["all_gather", "--device", "cpu", "--algo", "all", "-b", "1K", "-e", "1K", "-n", "1",
                     "-w", "0"]) == 0
    text = capsys.readouterr().out
    assert "# Using algo: symm_mem-lowcontention" in text
    assert "# symm_mem-lowcontention refused some calls (N/A above)" in text


def test_fp4_gather_counts_an_injected_wrong_byte(world_of_one, capsys, monkeypatch):
    monkeypatch.setenv("SYMCOMM_BENCH_CORRUPT", "0")
    assert cli.main(["all_gatherv_fp4", "--device", "cpu", "-d", "bfloat16", "-b", "2K", "-e", "2K",
                     "-n", "1", "-w", "0"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(w_oop, w_ip) for *_, w_oop, w_ip in rows] == [("1", "1"), ("1", "N/A"), ("1", "N/A")]
    assert "R 512-element rows" in out and "fp4 vs unquantized" in out


@pytest.mark.parametrize("algo", ["auto", "all", "torch"])
def test_a_dtype_no_path_takes_is_one_line_before_the_header(world_of_one, capsys, algo):
    """gloo cannot reduce fp8: the first size's probe says so in one line naming the open
    path's reason, not the closed paths' (no NCCL on the CPU), and nothing is printed before."""
    assert cli.main(["all_reduce", "--device", "cpu", "-d", "f8e4m3", "--algo", algo, "-b", "1K",
                     "-e", "2K", "-n", "1", "-w", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _one_error_line(captured.err)
    assert line.startswith("symcomm-bench: error: all_reduce of f8e4m3 at 1024 B on this cpu communicator: ")
    assert "torch.distributed cannot reduce torch.float8_e4m3fn" in line
    assert "needs NCCL" not in line and len(line) < 200


def test_short_refusal_keeps_the_open_paths_reasons():
    from symcomm.bench.runner import short_refusal

    message = ("no path can serve this all_reduce: custom-oneshot: symcomm's peer-memory kernels are off: needs NCCL; "
               "nccl: the device is the CPU; torch: cannot reduce fp8; a; b; custom-push: off")
    paths = ["custom-oneshot", "nccl", "torch", "custom-push"]
    assert short_refusal(message, paths, ["torch"]) == "torch: cannot reduce fp8; a; b"
    assert short_refusal(message, paths, ["torch", "nccl"]) == "nccl: the device is the CPU; torch: cannot reduce fp8; a; b"
    assert short_refusal("algo='torch' cannot serve this all_reduce: x", paths, ["torch"]) == (
        "algo='torch' cannot serve this all_reduce: x")


def test_refused_path_prints_na_and_null_json(world_of_one, capsys, tmp_path, monkeypatch):
    # A path that refuses calls in the middle of a sweep: its rows say N/A and the run goes
    # on. fp8 stands in for such a refusal here (gloo cannot reduce it), with the probe that
    # would refuse the whole run up front switched off.
    from symcomm.bench import runner

    monkeypatch.setattr(runner.Runner, "probe", lambda self: None)
    out = tmp_path / "fp8.json"
    assert cli.main(["all_reduce", "--device", "cpu", "-d", "f8e4m3", "--algo", "all", "-b", "1K",
                     "-e", "2K", "-n", "1", "-w", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    na_rows = [l for l in text.splitlines() if not l.startswith("#") and l.split()[5:] == ["N/A"] * 8]
    assert len(na_rows) == 8  # 2 sizes x blocks "torch", "auto" and torch's symm_mem-oneshot and -twoshot
    assert "# torch refused some calls (N/A above), first: torch at 1024 B out-of-place" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 16 and all(r["time_us"] is None and r["busbw"] is None for r in rows)


def test_rounds_report_each_paths_median_and_check_once(world_of_one, capsys, tmp_path, monkeypatch):
    """-R 3: three interleaved passes over (torch, auto) x (out of place, in place); the middle
    pass is a slow spell, and the median drops it for every cell. Results are checked once."""
    from symcomm.bench import runner

    passes = [[5.0, 6.0, 7.0, 8.0], [500.0, 600.0, 700.0, 800.0], [4.0, 5.0, 6.0, 7.0]]
    samples = iter(t for one_pass in passes for t in one_pass)
    monkeypatch.setattr(runner.Timer, "measure", lambda self, call: next(samples))
    checked = []
    real_check = runner.Runner._check
    monkeypatch.setattr(runner.Runner, "_check", lambda self, case: checked.append(1) or real_check(self, case))
    out = tmp_path / "rounds.json"
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "-b", "1K", "-e", "1K", "-n", "1",
                     "-w", "0", "-R", "3", "--json", str(out)]) == 0
    assert "median of 3 rounds" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    times = {(r["algo"], r["inplace"]): r["time_us"] for r in payload["rows"]}
    # torch's symmetric-memory columns are refused on the CPU: no sample, no time
    refused = {(column, inplace): None for column in ("symm_mem-oneshot", "symm_mem-twoshot") for inplace in (False, True)}
    assert times == {("torch", False): 5.0, ("torch", True): 6.0, ("auto", False): 7.0, ("auto", True): 8.0, **refused}
    assert payload["rounds"] == 3 and len(checked) == 4
    assert next(samples, None) is None  # exactly three passes


def test_missing_matplotlib_is_one_line_before_any_rank_starts(capsys, no_launcher_env, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["all_reduce", "--device", "cpu", "--plot", "x.png"]) == 2
    assert "needs matplotlib" in _one_error_line(capsys.readouterr().err)


def test_bad_tuning_file_is_a_usage_error_naming_the_file(world_of_one, capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "gpu": "cpu", "world_size": 1,
                               "rules": {"all_reduce": [[2048, ["torch"]], [1024, ["torch"]], [None, ["torch"]]]}}))
    monkeypatch.setenv("SYMCOMM_TUNING_FILE", str(bad))
    assert cli.main(["all_reduce", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert f"tuning file {bad}: " in line and "ascending" in line
    assert captured.out == ""


def test_plot_is_a_png_with_both_panels(world_of_one, capsys, tmp_path):
    if os.environ.get("SYMCOMM_REQUIRE_MATPLOTLIB") == "1":  # set by .ci/run, which installs it
        import matplotlib.image as image
    else:
        image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "ar.png"
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "-b", "1K", "-e", "16K", "-n", "1",
                     "-w", "0", "--plot", str(out)]) == 0
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert width > 2 * height > 0  # two panels side by side
    pixels = image.imread(str(out))
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # lines drawn, not a blank canvas


# ----------------------------------------------------------------------------- issue 24's frictions
@pytest.mark.parametrize("flag,path,needle", [
    ("--json", "NO_SUCH_FOLDER/run.json", "does not exist"),
    ("--json", ".", "is a folder"),
    ("--plot", "NO_SUCH_FOLDER/run.png", "does not exist"),
])
def test_output_paths_are_checked_before_the_run(flag, path, needle, capsys, no_launcher_env, monkeypatch):
    monkeypatch.chdir(ROOT)
    started = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, launched: started.append(cfg) or 0)
    assert cli.main(["all_reduce", "--device", "cpu", flag, path]) == 2
    captured = capsys.readouterr()
    assert needle in _one_error_line(captured.err) and flag in captured.err
    assert started == [] and captured.out == ""


def test_tune_output_is_checked_before_the_run(capsys, no_launcher_env, monkeypatch):
    monkeypatch.setattr(cli, "run_rank", lambda cfg, launched: pytest.fail("the run started"))
    assert cli.main(["tune", "--device", "cpu", "-o", "/no/such/folder/t.json"]) == 2
    assert "-o/--output /no/such/folder/t.json: the folder /no/such/folder does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("op", sorted(ops.NAMES))
@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
def test_every_ops_default_dtype_is_one_it_takes(op, device_name):
    spec = ops.spec(op)
    datatype = spec.default_datatype(device_name)
    spec.validate(datatype)  # raises BenchError where the op refuses it


def test_the_norm_runs_with_its_default_dtype(world_of_one, capsys):
    assert cli.main(["all_reduce_rmsnorm", "--device", "cpu", "-b", "16K", "-e", "16K", "-n", "1", "-w", "0"]) == 0
    out = capsys.readouterr().out
    assert " bfloat16 " in out
    # Columns the CPU has no kernel for print N/A; every column that ran is right.
    rows = table_rows(out)
    assert any(w == "0" for _, _, w, _ in rows) and all(w in ("0", "N/A") for _, _, w, _ in rows)


def test_sizes_below_one_element_run_as_one_with_a_note(world_of_one, capsys):
    assert cli.main(["all_reduce", "--device", "cpu", "-b", "1", "-e", "8", "-n", "1", "-w", "0"]) == 0
    out = capsys.readouterr().out
    assert "# Sizes: all_reduce of float at world 1 is empty below 4 B, so smaller sizes run as 4 B" in out
    assert [(b, c) for b, c, _, _ in table_rows(out)] == [(4, 1), (8, 2)]


def test_smallest_sizes_follow_each_ops_split():
    assert ops.spec("all_reduce").smallest_size(3, 4) == 4
    assert ops.spec("all_gather").smallest_size(3, 4) == 12        # one element per rank
    assert ops.spec("reduce_scatter").smallest_size(2, 2) == 4
    assert ops.spec("all_gatherv").smallest_size(2, 4) == 16        # one 16-byte row
    norm = ops.spec("all_reduce_rmsnorm")
    assert norm.smallest_size(2, 2) == norm.layout(1 << 20, 2, 2, 0).row * 2  # one token


def test_the_preamble_says_why_the_cpu_and_what_native_library(world_of_one, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("# Device: cpu (gloo): no CUDA device visible") for line in lines)
    native = [line for line in lines if line.startswith("# Native library: ")]
    assert len(native) == 1
    assert lines.index(native[0]) < lines.index("# Using algo: auto")
    timing = [line for line in lines if line.startswith("# Timing: ")]
    assert len(timing) == 1 and "not symcomm's GPU paths" in timing[0], timing


def test_more_cpu_ranks_than_cores_run_with_a_warning(no_launcher_env, monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    launched = []
    monkeypatch.setattr(cli, "launch_local", lambda world, argv: launched.append(world) or 0)
    assert cli.main(["all_reduce", "--device", "cpu", "-g", "3"]) == 0
    assert launched == [3]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["symcomm-bench: warning: 3 ranks share 2 CPU cores: they take turns, so the times include "
                   "the waiting (the results are checked all the same)"]
    assert cli.main(["all_reduce", "--device", "cpu", "-g", "9"]) == 2
    assert "at most 8 ranks" in _one_error_line(capsys.readouterr().err)


def test_an_oversubscribed_run_says_so_in_its_preamble(monkeypatch):
    res = bench("all_reduce", "-g", "3", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0")
    assert res.returncode == 0, res.stderr
    crowded = (os.cpu_count() or 1) < 3
    assert ("# Oversubscribed: 3 ranks share" in res.stdout) == crowded
    assert ("warning: 3 ranks share" in res.stderr) == crowded
    assert all(w == "0" for *_, w, _ in table_rows(res.stdout))


def test_an_extension_operation_is_benchmarked_with_its_own_paths(world_of_one, capsys, monkeypatch, tmp_path):
    """--with adds a module's operations (tests/toy_scaled_all_reduce.py): its OP is accepted,
    its paths are the columns, its results are checked (the sum times 2), and a spoiled
    element is counted."""
    monkeypatch.setattr(ops, "SPECS", dict(ops.SPECS))  # the registration ends with the test
    args = ["scaled_all_reduce", "--with", "toy_scaled_all_reduce", "--device", "cpu", "-b", "1K", "-e", "4K",
            "-n", "1", "-w", "0", "--algo", "all", "--json", str(tmp_path / "run.json")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "Paths on this communicator: torch;" in out, out
    rows = table_rows(out)
    assert len(rows) == 3 * 2 and all(r[2] == r[3] == "0" for r in rows), rows  # torch and auto, 3 sizes
    assert {r["algo"] for r in json.loads((tmp_path / "run.json").read_text())["rows"]} == {"torch", "auto"}
    monkeypatch.setenv("SYMCOMM_BENCH_CORRUPT", "0")
    monkeypatch.setenv("MASTER_PORT", str(cli._free_port()))
    assert cli.main(args) == 1
    assert any(r[2] != "0" for r in table_rows(capsys.readouterr().out))


@pytest.mark.parametrize("module,needle", [("no_such_module_here", "cannot import it"),
                                           ("json", "must export OPERATIONS")])
def test_a_bad_extension_is_one_line(module, needle, capsys, no_launcher_env, monkeypatch):
    monkeypatch.setattr(ops, "SPECS", dict(ops.SPECS))
    assert cli.main(["all_reduce", "--with", module]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


def test_graph_communicators_reach_the_communicator(world_of_one, capsys, monkeypatch):
    made = []
    real = cli.symcomm.Communicator

    def recording(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(cli.symcomm, "Communicator", recording)
    assert cli.main(["all_reduce", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                     "--graph-communicators"]) == 0
    assert made and made[0].get("graph_communicators") is True, made
