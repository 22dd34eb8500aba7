"""``symcomm-bench moe``: its sizes and shape flags, and a CPU run over gloo in which every column
is checked (and a corrupted output is counted)."""
from __future__ import annotations

import json

import pytest

from symcomm.bench import cli
from symcomm.bench.config import BenchError
from symcomm.bench.moe_spec import BASELINE, MOE_DISPATCH_COMBINE, MoeSpec
from test_bench_cli import bench, table_rows


def test_a_size_is_the_rows_one_rank_dispatches():
    spec = MoeSpec(hidden=256, topk=2, experts=8)
    lay = spec.layout(3 * 2 * 256 * 2 + 100, 2, 2, 0)
    assert (lay.nbytes, lay.count, lay.in_elems) == (3 * 1024, 3, 3 * 256)
    assert spec.smallest_size(2, 2) == 1024
    assert spec.bus_factor(4) == pytest.approx(1.5)
    # every buffer of the step fits in what the runner allocates for it
    assert lay.out_elems * 2 >= sum(spec._pieces(3, 2, 2).values())
    assert MOE_DISPATCH_COMBINE.configure({"hidden": 512, "topk": 4}) == MoeSpec(hidden=512, topk=4)


def test_shape_flags_are_checked_before_any_rank_starts():
    args = cli.build_parser().parse_args(["moe", "--tokens", "4,1", "--hidden", "256", "--topk", "3",
                                          "--experts", "8"])
    cfg = cli.build_config(args, "cpu")
    assert cfg.options == {"hidden": 256, "topk": 3, "experts": 8}
    assert cfg.sizes == [1 * 3 * 256 * 2, 4 * 3 * 256 * 2]
    # A list, not a sweep: the header must not quote -f's default step
    assert cfg.stepfactor == 0 and "sizes: --tokens 1,4 per rank, 1536 dispatched bytes a token" in cfg.notes
    for argv, pattern in [(["all_reduce", "--hidden", "64"], "only moe take shape flags, not all_reduce"),
                          (["moe", "--hidden", "100"], "multiple of 128"),
                          (["moe", "--topk", "9", "--experts", "8"], r"--topk \(9\) must be from 1"),
                          (["moe", "--topk", "0"], "--topk must be at least 1"),
                          (["moe", "--tokens", "4,x"], "comma-separated token counts"),
                          (["moe", "-d", "float"], "moves bfloat16 or half tokens")]:
        with pytest.raises(BenchError, match=pattern):
            cli.build_config(cli.build_parser().parse_args(argv), "cpu")


@pytest.mark.parametrize("corrupt", (False, True))
def test_cpu_run_checks_every_column(corrupt, tmp_path):
    extra = {"SYMCOMM_BENCH_CORRUPT": "1"} if corrupt else {}
    record = tmp_path / "moe.json"
    res = bench("moe", "-g", "2", "--device", "cpu", "--tokens", "1,3", "--hidden", "128", "--topk", "3",
                "--experts", "4", "-n", "2", "-w", "1", "--json", str(record), timeout=300, **extra)
    assert res.returncode == (1 if corrupt else 0), res.stdout + res.stderr
    rows = table_rows(res.stdout)
    blocks = [line.split(": ", 1)[1] for line in res.stdout.splitlines() if line.startswith("# Using algo: ")]
    assert blocks[0] == BASELINE and "peer-push" in blocks
    assert len(rows) == 2 * len(blocks)
    measured = [r for r in rows if r[2] != "N/A"]
    # all_to_all_single, a2a-buckets, a2a, a2a+nvfp4 run on the CPU; peer-push needs CUDA
    assert len(measured) == 2 * 4
    wrong = [int(r[2]) for r in measured]
    # Every column's check must see rank 1's spoiled element, each column counting its own output.
    assert all((w > 0) == corrupt for w in wrong), res.stdout
    assert all(r[3] == "N/A" for r in rows)  # no in-place form
    # Each N/A says why: the in-place form in the preamble, each peer-push column under its block.
    assert "in place is N/A: dispatch and combine write buffers of their own" in res.stdout
    why = [line for line in res.stdout.splitlines() if "refused some calls" in line]
    assert len(why) == len([b for b in blocks if b.startswith("peer-push")]), why
    assert all("CUDA" in line for line in why), why
    payload = json.loads(record.read_text())  # the record says what the table's preamble and N/A lines say
    assert set(payload["refused"]) == {b for b in blocks if b.startswith("peer-push")}, payload["refused"]
    assert any(note.startswith("MoE: hidden 128, top-3 of 4 experts") for note in payload["notes"]), payload["notes"]
