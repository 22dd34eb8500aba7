"""PyTorch's symmetric-memory comparison columns (symcomm/bench/torch_symm.py) without a GPU:
which calls torch would refuse, decided before any communication, and where the columns are."""
import io
import math

import pytest
import torch

from symcomm.bench import cli, ops, torch_symm
from symcomm.bench import report as rp
from symcomm.bench.spec import Buffers, Refusal, Setup

from test_bench_cli import table_rows, world_of_one  # noqa: F401 - world_of_one is a fixture

CUDA = torch.device("cuda")  # only a name here: no refusal below needs a device to exist
CPU = torch.device("cpu")
ONE, TWO, LOW = torch_symm.ONE_SHOT, torch_symm.TWO_SHOT, torch_symm.LOW_CONTENTION


@pytest.mark.parametrize("column", [ONE, TWO])
@pytest.mark.parametrize("dtype, nbytes, redop, needle", [
    (torch.bfloat16, 1024, "sum", None),
    (torch.float32, 12, "sum", None),           # 3 floats: an odd count of 4-byte elements is whole words
    (torch.bfloat16, 2004, "sum", None),         # 1002 elements: not a multiple of 16 bytes, still taken
    (torch.bfloat16, 6, "sum", "whole 4-byte words"),  # 3 bfloat16s: half a word over
    (torch.bfloat16, 1024, "max", "only sums (-o max)"),
    (torch.bfloat16, 1024, "avg", "only sums (-o avg)"),
    (torch.float16, 1024, "sum", "bfloat16 or float, not float16"),
    (torch.int32, 1024, "sum", "bfloat16 or float, not int32"),
    (torch.float64, 1024, "sum", "bfloat16 or float, not float64"),
])
def test_all_reduce_refusals_follow_torchs_kernels(column, dtype, nbytes, redop, needle):
    why = torch_symm.all_reduce_refusal(column, dtype, nbytes, redop, CUDA)
    assert why is None if needle is None else needle in why, why


@pytest.mark.parametrize("column", [ONE, TWO])
def test_the_cpu_is_refused_first_whatever_else(column):
    assert torch_symm.all_reduce_refusal(column, torch.int8, 3, "prod", CPU) == "torch's symmetric memory needs CUDA"


def test_a_torch_without_the_op_is_refused_with_the_reason():
    why = torch_symm.unavailable(CUDA, ("no_such_op",))
    assert why.startswith("this torch lacks it (AttributeError") and "no_such_op" in why


def test_the_low_contention_column_is_refused_everywhere_with_a_reason_per_timing():
    assert torch_symm.low_contention_refusal(CPU, True) == "torch's symmetric memory needs CUDA"
    captured = torch_symm.low_contention_refusal(CUDA, True)
    assert "do not capture into a CUDA graph" in captured and "hung" in captured
    eager = torch_symm.low_contention_refusal(CUDA, False)
    assert "not timed eagerly" in eager and "poison" in eager


def test_the_columns_belong_to_the_even_collectives_only():
    compared = {name: ops.spec(name).comparisons for name in ops.NAMES if ops.spec(name).comparisons}
    assert compared == {"all_reduce": (ONE, TWO), "all_gather": (LOW,), "reduce_scatter": (LOW,)}


def make_setup(dtype: torch.dtype, redop: str = "sum", device: torch.device = CUDA, graphs: bool = True) -> Setup:
    bufs = Buffers(torch.zeros(64, dtype=dtype), torch.zeros(64, dtype=dtype), symmetric=False)
    return Setup(None, bufs, 0, 2, device, dtype, redop, 0, True, "auto", graphs=graphs)


@pytest.mark.parametrize("dtype, redop, nbytes", [(torch.float16, "sum", 128), (torch.bfloat16, "min", 128),
                                                  (torch.bfloat16, "sum", 6)])
def test_a_refused_case_makes_no_buffer(monkeypatch, dtype, redop, nbytes):
    """The rendezvous is collective: a refusal must come before it, on every rank alike."""
    def rendezvous(*args):
        raise AssertionError("rendezvous before the refusal")

    monkeypatch.setattr(torch_symm, "rendezvous_empty", rendezvous)
    run = make_setup(dtype, redop)
    count = nbytes // dtype.itemsize
    cases = ops.spec("all_reduce").comparison_cases(run, ops.spec("all_reduce").layout(nbytes, 2, dtype.itemsize, 0),
                                                    torch.zeros(count, dtype=dtype), None)
    for column in (ONE, TWO):
        for inplace in (False, True):
            assert isinstance(cases(column, inplace), Refusal)


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_low_contention_cases_are_refusals(name, graphs):
    run = make_setup(torch.bfloat16, graphs=graphs)
    spec = ops.spec(name)
    lay = spec.layout(1024, 2, 2, 0)
    case = spec.comparison_cases(run, lay, torch.zeros(lay.in_elems, dtype=torch.bfloat16), None)(LOW, False)
    assert case == Refusal(torch_symm.low_contention_refusal(CUDA, graphs))


def test_both_columns_share_one_buffer_made_when_first_asked(monkeypatch):
    """One rendezvous per size, on the first column that runs; each mode times the same call."""
    made = []

    def rendezvous(shape, dtype, device):
        made.append(shape)
        return torch_symm.SymmBuffer(torch.zeros(shape, dtype=dtype), "0")

    monkeypatch.setattr(torch_symm, "rendezvous_empty", rendezvous)
    monkeypatch.setattr(torch_symm, "unavailable", lambda device, ops: None)
    run = make_setup(torch.float32)
    spec = ops.spec("all_reduce")
    lay = spec.layout(48, 2, 4, 0)
    cases = spec.comparison_cases(run, lay, torch.ones(lay.count), None)
    assert made == []
    one, two = cases(ONE, False), cases(TWO, True)
    assert made == [(12,)]
    cases(ONE, True)
    assert made == [(12,)]
    one.load()
    assert run.bufs.recv[:12].isnan().all()  # one-shot's output is poisoned before the call
    assert one.count is None and two.count is None  # the check is off (exp None)


def test_compared_label_names_the_columns_together():
    assert rp.compared_label([ONE, TWO]) == "symm_mem"
    assert rp.compared_label([LOW]) == LOW
    assert rp.compared_label(["a-x", "b-y"]) == "a-x/b-y"


def test_summary_compares_auto_with_the_fastest_comparison_and_never_crowns_it():
    rows = [rp.SizeRow("nccl", 1024, 256, rp.Timing(10.0, 0), rp.Timing(10.0, 0)),
            rp.SizeRow("auto", 1024, 256, rp.Timing(5.0, 0), rp.Timing(5.0, 0)),
            rp.SizeRow(ONE, 1024, 256, rp.Timing(4.0, 0), rp.Timing(4.0, 0)),
            rp.SizeRow(TWO, 1024, 256, rp.Timing(8.0, 0), rp.Timing(8.0, 0)),
            rp.SizeRow("nccl", 2048, 512, rp.Timing(10.0, 0), rp.Timing(10.0, 0)),
            rp.SizeRow("auto", 2048, 512, rp.Timing(5.0, 0), rp.Timing(5.0, 0)),
            rp.SizeRow(ONE, 2048, 512, rp.Timing(math.nan, None), rp.Timing(math.nan, None)),
            rp.SizeRow(TWO, 2048, 512, rp.Timing(math.nan, None), rp.Timing(math.nan, None))]
    out = io.StringIO()
    rp.print_summary(rows, ["nccl", "auto", ONE, TWO], out, comparisons=[ONE, TWO])
    text = out.getvalue()
    assert "'auto vs symm_mem' = the fastest of symm_mem-oneshot, symm_mem-twoshot's times / auto's time" in text
    cells = {line.split("│")[1].strip(): [c.strip() for c in line.strip("│ ").split("│")]
             for line in text.splitlines() if line.startswith("│")}
    # size, nccl, auto, oneshot, twoshot, winner, auto/oneshot/twoshot vs nccl, auto vs best, auto vs symm_mem
    assert cells["1024"] == ["1024", "10.00", "5.00", "4.00", "8.00", "nccl", "2.00x", "2.50x", "1.25x", "2.00x",
                             "0.80x"]
    assert cells["2048"] == ["2048", "10.00", "5.00", "-", "-", "nccl", "2.00x", "-", "-", "2.00x", "-"]


def fake_torch(monkeypatch, one_shot_writes: bool = True) -> None:
    """torch's symmetric memory at world 1 on the CPU: the sum of one rank is its input."""
    monkeypatch.setattr(torch_symm, "unavailable", lambda device, ops: None)
    monkeypatch.setattr(torch_symm, "rendezvous_empty",
                        lambda shape, dtype, device: torch_symm.SymmBuffer(torch.empty(shape, dtype=dtype), "0"))
    monkeypatch.setattr(torch_symm, "one_shot_all_reduce",
                        lambda buf, out: out.copy_(buf.tensor) if one_shot_writes else out)
    monkeypatch.setattr(torch_symm, "two_shot_all_reduce_", lambda buf: buf.tensor)


ARGS = ["all_reduce", "--device", "cpu", "--algo", f"{ONE},{TWO}", "-b", "4", "-e", "4K", "-f", "32", "-n", "1",
        "-w", "0"]


@pytest.mark.usefixtures("world_of_one")
def test_the_columns_are_checked_like_every_other(capsys, monkeypatch):
    """Against the all_reduce reference, with the corruption hook counted, through the CLI."""
    fake_torch(monkeypatch)
    assert cli.main(ARGS) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [(size, w_oop, w_ip) for size, _, w_oop, w_ip in rows] == [(n, "0", "0") for n in (4, 128, 4096)] * 2
    monkeypatch.setenv("SYMCOMM_BENCH_CORRUPT", "0")
    monkeypatch.setenv("MASTER_PORT", str(cli._free_port()))
    assert cli.main(ARGS) == 1
    assert {(w_oop, w_ip) for *_, w_oop, w_ip in table_rows(capsys.readouterr().out)} == {("1", "1")}


@pytest.mark.usefixtures("world_of_one")
def test_a_one_shot_that_writes_nothing_counts_wrong(capsys, monkeypatch):
    """One-shot's output is poisoned before the checked call: nothing written is all wrong."""
    fake_torch(monkeypatch, one_shot_writes=False)
    assert cli.main(ARGS) == 1
    rows = table_rows(capsys.readouterr().out)
    assert [(w_oop, w_ip) for _, count, w_oop, w_ip in rows[:3]] == [(str(c), str(c)) for c in (1, 32, 1024)]
