"""--device auto | cpu | cuda on CPU, with the visible GPUs faked: the resolution rule, what the
launcher and its ranks decide, and the errors and notes a user sees."""
import pytest
import torch

from symcomm.bench import cli, device
from symcomm.bench.config import BenchError

from test_bench_cli import LAUNCHER_VARS, _one_error_line, table_rows

NOTE = "Device: cpu (gloo): 2 ranks need 2 GPUs, 1 visible; pass --device cuda to insist"


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this process sees n CUDA devices."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


@pytest.fixture
def no_launcher(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("visible,ranks,expected", [
    (0, 1, ("cpu", None)),
    (0, 4, ("cpu", None)),                     # no GPU at all: nothing to insist on
    (1, 1, ("cuda", None)),
    (1, 2, ("cpu", "2 ranks need 2 GPUs, 1 visible")),
    (2, 2, ("cuda", None)),
    (8, 4, ("cuda", None)),
    (3, 4, ("cpu", "4 ranks need 4 GPUs, 3 visible")),
    (1, None, ("cuda", None)),                 # a launcher that does not say how many ranks are local
])
def test_auto_takes_cuda_only_when_every_local_rank_gets_a_gpu(gpus, visible, ranks, expected):
    gpus(visible)
    choice = device.resolve("auto", ranks)
    assert (choice.device, choice.fallback) == expected
    # Every run on the CPU says why in its preamble; only a fallback says how to insist.
    assert (choice.note is None) == (expected[0] == "cuda")
    if choice.device == "cpu":
        assert choice.note.startswith("Device: cpu (gloo): ")
        assert ("--device cuda to insist" in choice.note) == (expected[1] is not None)
    if visible == 0:
        assert "no CUDA device visible" in choice.note


def test_the_fallback_note_says_how_to_insist(gpus):
    gpus(1)
    assert device.resolve("auto", 2).note == NOTE


@pytest.mark.parametrize("visible", [0, 1, 8])
def test_explicit_devices_never_fall_back(gpus, visible):
    gpus(visible)
    assert device.resolve("cpu", 2) == device.DeviceChoice("cpu", why="--device cpu")
    assert device.resolve("cpu", 2).note == "Device: cpu (gloo): --device cpu"
    if visible:
        assert device.resolve("cuda", 16) == device.DeviceChoice("cuda")
    else:
        with pytest.raises(BenchError, match="no CUDA device"):
            device.resolve("cuda", 1)


def test_explicit_cuda_with_too_few_gpus_says_what_to_run(gpus, capsys, no_launcher):
    gpus(1)
    assert cli.main(["all_reduce", "-g", "2", "--device", "cuda"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "-g 2 needs 2 GPUs" in line and "run -g 1" in line and "--device cpu" in line


def test_auto_launches_cpu_ranks_where_gpus_are_short(gpus, monkeypatch, no_launcher):
    gpus(1)
    launched = []
    monkeypatch.setattr(cli, "launch_local", lambda world, argv: launched.append((world, argv)) or 0)
    argv = ["all_reduce", "-g", "2", "-b", "1K", "-e", "1M"]
    assert cli.main(argv) == 0
    assert launched == [(2, argv)]


@pytest.mark.parametrize("visible,device_type,graph,note", [(1, "cpu", 0, [NOTE]), (2, "cuda", 10, [])])
def test_each_rank_resolves_as_its_launcher_did(gpus, monkeypatch, visible, device_type, graph, note):
    """A rank of `-g 2` re-parses the same command line: it must reach the same device, with
    the note for rank 0's preamble, and tune's graph default must follow the device chosen."""
    gpus(visible)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    seen = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, launched: seen.append(cfg) or 0)
    assert cli.main(["all_reduce", "-g", "2"]) == 0
    assert cli.main(["tune", "-g", "2"]) == 0
    bench, tune = seen
    assert (bench.device, bench.notes, bench.type_name) == (device_type, note,
                                                            "float" if device_type == "cpu" else "bfloat16")
    assert (tune.device, tune.graph, tune.notes) == (device_type, graph, note)


def test_cudagraph_under_auto_fallback_says_why(gpus, capsys, no_launcher):
    gpus(1)
    assert cli.main(["all_reduce", "-g", "2", "-G", "5"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "-G/--cudagraph needs --device cuda (--device auto chose cpu: 2 ranks need 2 GPUs, 1 visible)" in line


def test_the_note_is_in_the_printed_preamble(gpus, monkeypatch, capsys):
    """End to end in this process: a world of one over gloo whose launcher claims two local
    ranks, so that auto falls back with one GPU visible."""
    gpus(1)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(cli._free_port()))):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SYMCOMM_BENCH_CORRUPT", raising=False)
    assert cli.main(["all_reduce", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"# {NOTE}" in lines
    assert lines.index(f"# {NOTE}") < lines.index("# Using algo: auto")
    assert len(table_rows("\n".join(lines))) == 2
    assert not torch.distributed.is_initialized()
