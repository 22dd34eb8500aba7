"""symcomm-bench's peer copy of each size's bytes on the wire (symcomm/bench/link.py) on real
GPUs: every rank copies from the next rank's GPU at once, the bytes arrive whole, every size
gets a time, and a whole --algo all run prints the summary's 'auto of link' column."""
from __future__ import annotations

import torch
import torch.distributed as dist

from symcomm.bench import cli, exchange, link, report, runner


def _devices(comm) -> list[report.DeviceInfo]:
    device = torch.device(comm.device)
    return runner.gather_devices(runner.device_info(dist.get_rank(), device), device)


def test_every_rank_copies_the_wire_bytes_of_every_size_and_they_arrive_whole(comm):
    device = torch.device(comm.device)
    world = dist.get_world_size()
    # Odd sizes: no count a multiple of 16 bytes; the last one large enough to be link-bound.
    sizes = [1000, 65539, 4 * (1 << 20) + 7]
    factor = 2 * (world - 1) / world
    wire = link.measure(sizes, factor, _devices(comm), dist.get_rank(), device, iters=5, rounds=2, seed=3,
                        gather=lambda v: exchange.gather_json(v, device))
    assert wire.refusal is None, wire.refusal  # torchrun shows every GPU to every rank
    assert wire.wrong == 0
    assert sorted(wire.times) == sizes and all(t > 0 for t in wire.times.values())
    rate, at = wire.peak()
    # GB/s. Above 2000 no NVLink generation reaches: a copy that moved nothing; below 1, one that
    # went through the host.
    assert at == wire.wire(sizes[-1]) and 1.0 < rate < 2000.0, rate


def test_a_whole_run_prints_auto_of_link(comm, capsys):
    args = cli.build_parser().parse_args(["all_gather", "-d", "bfloat16", "--algo", "all", "-b", "64K",
                                          "-e", "4M", "-f", "8", "-n", "3", "-w", "1", "-G", "2"])
    assert runner.run(cli.build_config(args, "cuda"), comm) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert "'auto of link' = link copy time / auto's time; copied bytes wrong: 0" in out, out
        assert "auto of link" in out.split("# Summary")[1]
