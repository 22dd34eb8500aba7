"""symcomm-bench baseline (NCCL alone in its process) and --baseline, on CPU.

The CUDA run itself needs GPUs; here its pieces run against a stand-in libnccl: the raw
communicator's calls (which NCCL function, which pointers and counts), both buffer modes
through the main sweep's Runner at world 1 (where every collective is a copy), the file it
writes and --baseline reading it back, the summary's clean columns, and the usage errors.
"""
from __future__ import annotations

import ctypes
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from symcomm import _nccl
from symcomm.bench import baseline, cli, ops
from symcomm.bench import report as rp
from symcomm.bench.spec import Buffers

SIZES = [1024, 2048, 4096]
_ITEMSIZE = {code: dtype.itemsize for dtype, code in _nccl.DTYPES.items()}


class FakeLib:
    """libnccl's collectives, recorded; at world 1 each one is a copy of its input."""

    def __init__(self, copy: bool):
        self.copy = copy
        self.calls: list[tuple] = []

    def _collective(self, name: str):
        def call(send: int, recv: int, count: int, dtype: int, *rest) -> int:
            self.calls.append((name, send, recv, count, dtype, *rest))
            if self.copy and send != recv:
                ctypes.memmove(recv, send, count * _ITEMSIZE[dtype])
            return 0
        return call

    def __getattr__(self, name: str):
        if name in ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter"):
            return self._collective(name)
        raise AttributeError(name)


class FakeNccl:
    """What RawNccl and ModeRunner use of _nccl.Library, with host memory for ncclMemAlloc."""
    version_string = "2.28.9"

    def __init__(self, copy: bool = True):
        self.lib = FakeLib(copy)
        self.memory: dict[int, ctypes.Array] = {}
        self.windows: list[tuple[int, int, int]] = []

    def check(self, call: str, code: int, comm: int | None = None) -> None:
        assert code == 0, call

    def mem_alloc(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        self.memory[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def window_register(self, comm: int, ptr: int, nbytes: int) -> int:
        self.windows.append((comm, ptr, nbytes))
        return len(self.windows)


HANDLE = 0x5EED


def raw(nccl: FakeNccl) -> baseline.RawNccl:
    return baseline.RawNccl(nccl, HANDLE, torch.device("cpu"), stream=lambda: 77)


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cli._free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def baseline_config(*args: str):
    parsed = cli.build_baseline_parser().parse_args([*args, "-b", "1K", "-e", "4K", "-n", "2", "-w", "1"])
    return cli.build_baseline_config(parsed, "cuda", "symcomm-bench baseline " + " ".join(args))


def sweep_config(*args: str):
    return cli.build_config(cli.build_parser().parse_args(list(args)), "cuda")


# -- the raw communicator ---------------------------------------------------------------------
def test_every_op_with_an_nccl_collective_is_one_the_raw_communicator_makes():
    assert ops.BASELINE_NAMES == ("all_reduce", "all_gather", "reduce_scatter")
    assert {n: ops.spec(n).nccl for n in ops.BASELINE_NAMES} == {
        "all_reduce": "ncclAllReduce", "all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter"}
    assert all(ops.spec(n).nccl is None for n in ops.NAMES if n not in ops.BASELINE_NAMES)


@pytest.mark.parametrize("name", ops.BASELINE_NAMES)
@pytest.mark.parametrize("inplace", [False, True])
def test_the_spec_drives_exactly_its_nccl_call_with_nccl_tests_pointers(name, inplace):
    """World 4, rank 2, bf16: the pointers and count each NCCL function gets, out of place and
    in place with nccl-tests' aliasing."""
    spec, world, rank, itemsize = ops.spec(name), 4, 2, 2
    lay = spec.layout(64 * 1024, world, itemsize, rank)
    bufs = Buffers(torch.zeros(lay.in_elems, dtype=torch.bfloat16),
                   torch.zeros(lay.out_elems, dtype=torch.bfloat16), False)
    x, out = spec.views(lay, bufs, rank, inplace)
    nccl = FakeNccl(copy=False)
    spec.run(raw(nccl), lay, x, out, "max", "R0")()
    (call,) = nccl.lib.calls
    fn, send, recv, count, dtype, *rest = call
    per_rank = lay.parts[rank]
    assert fn == spec.nccl and dtype == _nccl.BFLOAT16
    assert rest == ([_nccl.REDUCE_OPS["max"]] if spec.reduces else []) + [HANDLE, 77]
    send0, recv0 = bufs.send.data_ptr(), bufs.recv.data_ptr()
    expected = {  # (send, recv, count): nccl-tests' in-place layouts
        ("ncclAllReduce", False): (send0, recv0, lay.count),
        ("ncclAllReduce", True): (send0, send0, lay.count),
        ("ncclAllGather", False): (send0, recv0, per_rank),
        ("ncclAllGather", True): (recv0 + rank * per_rank * itemsize, recv0, per_rank),
        ("ncclReduceScatter", False): (send0, recv0, per_rank),
        ("ncclReduceScatter", True): (send0, send0 + rank * per_rank * itemsize, per_rank),
    }[(fn, inplace)]
    assert (send, recv, count) == expected


def test_device_bytes_views_memory_torch_did_not_allocate():
    buf = ctypes.create_string_buffer(bytes(range(8)), 8)
    t = baseline.device_bytes(ctypes.addressof(buf), 8, torch.device("cpu"))
    assert t.dtype == torch.uint8 and t.data_ptr() == ctypes.addressof(buf) and t.tolist() == list(range(8))
    t.view(torch.int16)[0] = -1
    assert buf.raw[:2] == b"\xff\xff"


# -- both modes through the main sweep's Runner, at world 1 ---------------------------------------
@pytest.mark.parametrize("name", ops.BASELINE_NAMES)
def test_both_modes_run_clean_through_the_runner(name, gloo_world_of_one):
    cfg = baseline_config(name, "-d", "float")
    results, info = {}, None
    for mode in baseline.MODES:
        nccl = FakeNccl()
        out = io.StringIO()
        with rp.Progress(0, False) as progress:
            info, results[mode.name] = baseline._measure(
                baseline.ModeRunner(cfg, raw(nccl), mode), rp.Emitter(True, out), progress, header=True)
        text = out.getvalue()
        assert f"# Using algo: {mode.name}" in text and "# Out of bounds values : 0 OK" in text
        assert info.nccl_version == "2.28.9" and info.backend == "gloo"
        assert len(nccl.lib.calls) > 0 and {c[0] for c in nccl.lib.calls} == {ops.spec(name).nccl}
        # R2: send and recv in two registered windows, every call inside them.
        assert len(nccl.windows) == (2 if mode.windows else 0)
        if mode.windows:
            inside = lambda p: any(base <= p < base + n for _, base, n in nccl.windows)  # noqa: E731
            assert all(inside(c[1]) and inside(c[2]) for c in nccl.lib.calls)
    for rows in results.values():
        assert [r.nbytes for r in rows] == SIZES
        assert all(t.wrong == 0 and t.time_us > 0 for r in rows for t in (r.out_of_place, r.in_place))


def test_buffers_are_sized_for_every_rank_so_windows_match():
    """A symmetric registration must be the same size on every rank: the buffers take the
    largest layout over all ranks, not just this one's."""
    cfg = baseline_config("reduce_scatter")
    runner = object.__new__(baseline.ModeRunner)  # only what _buffers reads
    nccl = FakeNccl()
    runner.mode, runner.cfg, runner.comm = baseline.MODES[1], cfg, raw(nccl)
    runner.spec, runner.world, runner.dtype, runner.device = ops.spec("reduce_scatter"), 3, torch.bfloat16, torch.device("cpu")
    bufs = runner._buffers()
    per_rank = 4096 // 2 // 3
    assert (bufs.send.numel(), bufs.recv.numel()) == (3 * per_rank, per_rank)
    assert [n for *_, n in nccl.windows] == [3 * per_rank * 2, per_rank * 2]
    assert bufs.symmetric and bufs.send.dtype == torch.bfloat16


# -- the file, and reading it back ------------------------------------------------------------------
def info(world: int = 4, **kw) -> rp.RunInfo:
    base = dict(op="all_reduce", world=world, type_name="bfloat16", redop="sum", minbytes=1024,
                maxbytes=4096, stepfactor=2, warmup=1, iters=2, check=True, graph=0, device="cuda",
                device_name="NVIDIA H200", backend="gloo", torch_version="2.11.0", nccl_version="2.28.9")
    base.update(kw)
    return rp.RunInfo(**base)


def mode_rows(mode: str, times: list[float | None]) -> list[rp.SizeRow]:
    nan = math.nan
    return [rp.SizeRow(mode, n, n // 2, rp.Timing(nan if t is None else t, 0), rp.Timing(1.0, 0))
            for n, t in zip(SIZES, times)]


def test_json_round_trip_gives_the_faster_mode_per_size_out_of_place(tmp_path):
    cfg = baseline_config("all_reduce")
    results = {"R0": mode_rows("R0", [9.0, 10.0, None]), "R2": mode_rows("R2", [4.0, 11.0, None])}
    payload = baseline.payload(cfg, info(world=1), results, {}, "2026-11-24T00:00:00+00:00")
    path = tmp_path / "baseline.json"
    rp.write_json(str(path), payload)
    data = json.loads(path.read_text())
    assert {k: data[k] for k in ("op", "world", "dtype", "redop", "sizes", "device", "nccl", "command")} == {
        "op": "all_reduce", "world": 1, "dtype": "bfloat16", "redop": "sum", "sizes": SIZES,
        "device": "NVIDIA H200", "nccl": "2.28.9",
        "command": "symcomm-bench baseline all_reduce"}
    assert set(data["modes"]) == {"R0", "R2"} and len(data["modes"]["R0"]) == 2 * len(SIZES)
    assert data["date"] and data["timing"] == {"iters": 2, "warmup_iters": 1, "graph_replays": 0, "rounds": 1}

    clean = baseline.load(str(path), sweep_config("all_reduce", "--algo", "all", "-n", "2", "-w", "1"), 1)
    assert clean.source == str(path)
    assert clean.times == {1024: 4.0, 2048: 10.0}  # in-place rows (1.0) never count; 4096 timed by none
    assert [c["mode"] for c in clean.record["clean"]] == ["R2", "R0"]
    assert clean.record["path"] == str(path) and clean.record["nccl"] == "2.28.9"
    assert "Clean baseline: " in clean.note and "timed differently" not in clean.note
    other = baseline.load(str(path), sweep_config("all_reduce", "--algo", "all", "-G", "10"), 1)
    assert "timed differently (iters 2 there, 20 here" in other.note


def write_baseline(tmp_path: Path, **fields) -> str:
    data = {"schema": baseline.SCHEMA, "op": "all_reduce", "world": 1, "dtype": "float", "redop": "sum",
            "sizes": [1024], "device": "NVIDIA H200", "nccl": "2.28.9", "date": "2026-11-24", "command": "x",
            "timing": {"iters": 1, "warmup_iters": 0, "graph_replays": 0, "rounds": 1}, "skipped": {},
            "modes": {"R0": [{"algo": "R0", "bytes": 1024, "count": 256, "time_us": 8.0, "algbw": 0.1,
                              "busbw": 0.0, "wrong": 0, "inplace": False}]}}
    data.update(fields)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    return str(path)


# -- usage errors -------------------------------------------------------------------------------------
def one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("symcomm-bench: error: "), captured.err
    assert captured.out == ""
    return lines[0]


@pytest.fixture
def no_launcher(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("args,needle", [
    (["baseline", "all_reduce", "--device", "cpu"], "baseline times NCCL, which needs CUDA (--device cpu)"),
    (["baseline", "all_gatherv"], "all_gatherv has no NCCL collective of its own; baseline times "
                                  "all_reduce, all_gather, reduce_scatter"),
    (["baseline", "all_gatherv_fp4", "--device", "cpu"], "has no NCCL collective of its own"),
    (["baseline", "broadcast"], "invalid choice"),
    (["baseline", "all_reduce", "--algo", "all"], "unrecognized"),
    (["all_reduce", "--baseline", "b.json"], "pass --algo all"),
])
def test_baseline_argument_errors(args, needle, capsys, no_launcher):
    assert cli.main(args) == 2
    assert needle in one_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_baseline_without_cuda_says_so(capsys, no_launcher):
    assert cli.main(["baseline", "all_reduce"]) == 2
    assert "needs CUDA (no CUDA device is visible)" in one_error(capsys)


@pytest.mark.parametrize("fields,args,needle", [
    ({"world": 4}, [], "was measured for another run (world 4 there, 1 here)"),
    ({"op": "all_gather", "redop": "none"}, [], "(op all_gather there, all_reduce here; redop none there, sum here)"),
    ({"dtype": "bfloat16"}, [], "(dtype bfloat16 there, float here)"),
    ({}, ["-o", "max"], "(redop sum there, max here)"),
    ({"world": 2}, ["-g", "2"], None),  # -g 2 matches: the error would be a launch one, not this
    ({"schema": "symcomm-bench/1"}, [], "not a file written by 'symcomm-bench baseline'"),
    ({"modes": {"R0": [{"bytes": 1024}]}}, [], "malformed 'modes'"),
])
def test_a_baseline_for_another_run_is_a_usage_error_naming_the_mismatch(fields, args, needle, tmp_path,
                                                                          capsys, no_launcher, monkeypatch):
    path = write_baseline(tmp_path, **fields)
    launched = []
    monkeypatch.setattr(cli, "launch_local", lambda world, argv: launched.append(world) or 0)
    monkeypatch.setattr(cli, "run_rank", lambda *a: launched.append(1) or 0)
    status = cli.main(["all_reduce", "--device", "cpu", "--algo", "all", *args, "--baseline", path])
    if needle is None:
        assert status == 0 and launched == [2]
        return
    assert status == 2 and launched == []  # refused before any rank starts
    line = one_error(capsys)
    assert f"--baseline {path}" in line and needle in line


def test_unreadable_baseline_files(tmp_path, capsys, no_launcher):
    missing = tmp_path / "none.json"
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "--baseline", str(missing)]) == 2
    assert "No such file" in one_error(capsys)
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{")
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "--baseline", str(garbled)]) == 2
    assert "not JSON" in one_error(capsys)


# -- the summary's clean columns --------------------------------------------------------------------
def summary_cells(text: str, nbytes: int) -> list[str]:
    line = next(l for l in text.splitlines() if re.match(rf"^│\s+{nbytes} ", l))
    return [c.strip() for c in line.strip("│ ").split("│")]


def fake_rows() -> list[rp.SizeRow]:
    times = {"nccl": (14.0, 20.0), "nccl-symm": (9.5, 18.0), "custom-flagfree": (4.0, math.nan),
             "auto": (4.2, 18.5)}
    return [rp.SizeRow(algo, n, n // 2, rp.Timing(t, 0), rp.Timing(t, 0))
            for algo, ts in times.items() for n, t in zip((1024, 65536), ts)]


def test_summary_gains_the_clean_columns_and_ratios():
    algos = ["nccl", "nccl-symm", "custom-flagfree", "auto"]
    clean = rp.Clean("b.json", {1024: 9.0, 65536: 18.0})
    out = io.StringIO()
    rp.print_summary(fake_rows(), algos, out, clean)
    text = out.getvalue()
    header = " ".join(l for l in text.splitlines() if l.startswith("┃"))
    for name in ("nccl", "clean", "vs", "auto"):
        assert name in header
    assert "# 'nccl clean' = NCCL alone in its process, its faster buffer mode (b.json); " \
           "'<path> vs clean' = clean time / path time" in text.splitlines()
    # size, 4 paths, winner, 3 x "vs nccl", auto vs best, then: nccl clean, nccl / nccl-symm / auto vs clean
    assert summary_cells(text, 1024) == ["1024", "14.00", "9.50", "4.00", "4.20", "custom-flagfree",
                                         "1.47x", "3.50x", "3.33x", "0.95x",
                                         "9.00", "0.64x", "0.95x", "2.14x"]
    assert summary_cells(text, 65536)[-4:] == ["18.00", "0.90x", "1.00x", "0.97x"]
    assert "…" not in text  # the clean columns bring their own width


def test_summary_without_auto_or_clean_size():
    rows = [r for r in fake_rows() if r.algo in ("nccl", "nccl-symm")]
    table = rp.summary_table(rows, ["nccl", "nccl-symm"], rp.Clean("b.json", {1024: 7.0}))
    assert [c.header for c in table.columns][-3:] == ["nccl clean", "nccl vs clean", "nccl-symm vs clean"]
    assert [c._cells[-1] for c in table.columns][-3:] == ["-", "-", "-"]  # 65536: not in the baseline
    assert rp.clean_compared(["torch", "auto"]) == ["auto"]


def test_without_a_baseline_the_summary_is_unchanged():
    a, b = io.StringIO(), io.StringIO()
    rp.print_summary(fake_rows(), ["nccl", "nccl-symm", "custom-flagfree", "auto"], a)
    rp.print_summary(fake_rows(), ["nccl", "nccl-symm", "custom-flagfree", "auto"], b, None)
    assert a.getvalue() == b.getvalue() and "clean" not in a.getvalue()
    assert "baseline" not in rp.json_payload(info(), fake_rows(), "2026-11-24")


def test_a_cpu_sweep_with_a_baseline_shows_and_records_it(tmp_path, capsys, monkeypatch):
    """The --baseline wiring end to end in one process (world 1, gloo): preamble, summary, JSON."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(cli._free_port()))):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SYMCOMM_BENCH_CORRUPT", raising=False)
    path, out = write_baseline(tmp_path), tmp_path / "run.json"
    assert cli.main(["all_reduce", "--device", "cpu", "--algo", "all", "-b", "1K", "-e", "2K", "-n", "1",
                     "-w", "0", "--baseline", path, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"# Clean baseline: {path}: NCCL 2.28.9 alone in its process on NVIDIA H200" in text
    cells = summary_cells(text, 1024)
    assert cells[-2] == "8.00" and cells[-1].endswith("x")  # nccl clean, auto vs clean
    assert summary_cells(text, 2048)[-2:] == ["-", "-"]
    record = json.loads(out.read_text())["baseline"]
    assert record["path"] == path and record["clean"] == [{"bytes": 1024, "time_us": 8.0, "mode": "R0"}]
    assert not dist.is_initialized()
