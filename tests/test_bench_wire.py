"""symcomm-bench's 'how close to the wire' (symcomm/bench/link.py): the wire bytes, the copy's
peak and auto's fraction of it, the summary's columns and JSON record, and a world whose ranks
cannot copy refusing alike on every rank without a hang. The copies themselves need two GPUs:
tests/gpu/test_bench_link.py. (This file's name differs from that one's: pytest imports both
folders' tests under their bare module names, and two files of one name cannot both load.)"""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from symcomm.bench import link
from symcomm.bench import report as rp

from _spawn import run_world


def test_wire_bytes_peak_and_fraction():
    wire = rp.LinkTimes(1.0, {1024: 10.0, 1 << 24: 50.0, 1 << 26: 190.0})
    assert wire.wire(1 << 24) == 1 << 24
    rate, at = wire.peak()
    assert at == 1 << 26 and rate == pytest.approx((1 << 26) / 190e3)
    assert wire.fraction(1 << 24, 100.0) == pytest.approx(0.5)
    assert wire.fraction(4096, 100.0) is None  # no copy at that size
    assert rp.LinkTimes(0.5).wire(1001) == 500  # whole bytes, rounded down


def test_summary_gets_wire_copy_and_fraction_columns_and_a_note():
    rows = [rp.SizeRow("nccl", 1 << 20, 1 << 19, rp.Timing(20.0, 0), rp.Timing(20.0, 0)),
            rp.SizeRow("auto", 1 << 20, 1 << 19, rp.Timing(8.0, 0), rp.Timing(8.0, 0))]
    wire = rp.LinkTimes(0.5, {1 << 20: 4.0}, wrong=0)
    out = io.StringIO()
    rp.print_summary(rows, ["nccl", "auto"], out, wire=wire)
    text = out.getvalue()
    assert "'auto of link' = link copy time / auto's time; copied bytes wrong: 0" in text
    line = next(l for l in text.splitlines() if l.strip("│┃| ").startswith("1048576"))
    cells = [c.strip() for c in line.strip("│┃| ").split("│")]
    assert cells[-3:] == ["524288", "4.00", "0.50"]


def test_a_refused_copy_is_one_line_and_no_columns():
    rows = [rp.SizeRow("auto", 1024, 256, rp.Timing(8.0, 0), rp.Timing(8.0, 0)),
            rp.SizeRow("nccl", 1024, 256, rp.Timing(9.0, 0), rp.Timing(9.0, 0))]
    out = io.StringIO()
    rp.print_summary(rows, ["nccl", "auto"], out, wire=rp.LinkTimes(1.0, refusal="rank 1 is on another host (b)"))
    text = out.getvalue()
    assert "# link: not measured: rank 1 is on another host (b)" in text
    assert "auto of link" not in text


def test_json_keeps_the_copies():
    wire = rp.LinkTimes(1.0, {4096: 5.0}, wrong=0)
    info = rp.RunInfo(op="all_reduce", world=2, type_name="float", redop="sum", minbytes=4096, maxbytes=4096,
                      stepfactor=2, warmup=1, iters=2, check=True, graph=0, device="cuda", device_name="H200",
                      backend="nccl", torch_version="2.11.0", nccl_version="2.28.9")
    payload = rp.json_payload(info, [], "2026-11-28T00:00:00+00:00", wire=wire)
    assert payload["link"] == {"factor": 1.0, "copy_us": {"4096": 5.0}, "wrong": 0, "refusal": None,
                               "peak_gbs": round(4096 / 5e3, 2)}
    json.dumps(payload)


def _cpu_world(rank, world):
    import torch.distributed as dist

    from symcomm.bench import exchange, runner
    device = torch.device("cpu")
    devices = runner.gather_devices(runner.device_info(rank, device), device)
    wire = link.measure([1024, 4096], 1.0, devices, rank, device, iters=2, rounds=1, seed=0,
                        gather=lambda v: exchange.gather_json(v, device))
    assert wire.refusal == "the ranks run on the CPU: no link to measure" and wire.times == {}
    # Every rank left measure() with its barriers paired: one more collective completes.
    dist.barrier()


def test_ranks_that_cannot_copy_refuse_alike_and_do_not_hang():
    run_world(_cpu_world, 2, timeout_s=120)


def _one_rank_refuses(rank, world):
    import torch.distributed as dist

    from symcomm.bench import exchange, runner
    device = torch.device("cpu")
    devices = runner.gather_devices(runner.device_info(rank, device), device)
    if rank == 0:  # rank 0 could copy; rank 1 refuses (CPU): rank 0 must not copy at all

        def copied(*args):
            raise AssertionError("rank 0 copied although rank 1 had refused")
        link.local_refusal = lambda *args: (None, 1)
        link._copy_one = copied
    wire = link.measure([1024, 4096], 1.0, devices, rank, device, iters=2, rounds=1, seed=0,
                        gather=lambda v: exchange.gather_json(v, device))
    assert wire.refusal == "the ranks run on the CPU: no link to measure", wire.refusal
    dist.barrier()


def test_a_refusal_on_one_rank_is_agreed_before_any_copy():
    run_world(_one_rank_refuses, 2, timeout_s=120)


def _fails_mid_copy(rank, world):
    import torch.distributed as dist

    from symcomm.bench import exchange, runner
    device = torch.device("cpu")
    devices = runner.gather_devices(runner.device_info(rank, device), device)
    link.local_refusal = lambda *args: (None, 1)
    if rank == 1:  # rank 1's copies "succeed"; rank 0's first one raises
        link._copy_one = lambda *args: (5.0, 0)
    link.torch.cuda.device = lambda index: contextlib.nullcontext()
    wire = link.measure([1024, 4096, 65536], 1.0, devices, rank, device, iters=2, rounds=1, seed=0,
                        gather=lambda v: exchange.gather_json(v, device))
    reasons = exchange.gather_json(wire.refusal, device)
    assert reasons[0] == reasons[1] and reasons[0].startswith("rank 0: "), reasons
    assert wire.times == {}
    dist.barrier()


def test_a_rank_failing_mid_copy_while_another_copies_ends_alike_without_a_hang():
    run_world(_fails_mid_copy, 2, timeout_s=120)


def _gather_world(rank, world):
    from symcomm.bench import exchange
    values = exchange.gather_json({"rank": rank, "pad": "x" * (3000 * rank)}, torch.device("cpu"))
    assert [v["rank"] for v in values] == list(range(world))
    assert [len(v["pad"]) for v in values] == [3000 * r for r in range(world)]


def test_gather_json_takes_values_of_any_length():
    run_world(_gather_world, 3, timeout_s=120)
