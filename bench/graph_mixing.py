"""Where does NCCL's cost inside CUDA graphs come from in symcomm's process? One variable at a time.

    torchrun --nproc-per-node=N bench/graph_mixing.py [--sizes 1K,64K,1M] [--json FILE]

Every case times the same thing, nccl-tests' way: 20 ncclAllReduce (bf16, out of place, on
raw ctypes communicators, no symcomm on the call path) captured in one CUDA graph, replayed 10
times back to back, time per collective. What changes between cases is the process around it:

- ``clean``: one communicator that never runs eagerly (nccl-tests' situation after warm-up);
- ``eager_first``: the same communicator also ran eager calls before the capture;
- ``eager_between``: eager calls on it between replays (each replay timed alone is not what is
  measured: the eager calls happen before the timed block);
- ``three_comms``: two more communicators exist (as in symcomm: plain, symmetric, and torch's own
  NCCL group), used eagerly, while a fourth one that never runs eagerly is timed;
- ``three_comms_same``: as symcomm does today: the timed communicator is one that also serves
  eager calls, with two others alive.

Ratios against ``clean`` in the same run are what count; absolute times vary per machine.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from symcomm import _nccl, settings
from symcomm.backends.nccl import new_comm
from symcomm.peers import Peers

ITERS, REPLAYS = 20, 10


def _launcher(nccl: _nccl.Library, comm: int, x: torch.Tensor, y: torch.Tensor):
    lib, n = nccl.lib, x.numel()

    def call() -> None:
        code = lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), n, _nccl.BFLOAT16, 0, comm,
                                 torch.cuda.current_stream().cuda_stream)
        nccl.check("ncclAllReduce", code)
    return call


def _time_graph(call, before_replays=None) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ITERS):
            call()
    graph.replay()
    torch.cuda.synchronize()
    if before_replays is not None:
        before_replays()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (ITERS * REPLAYS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1K,64K,1M")
    parser.add_argument("--json")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nccl = _nccl.load()
    # Fresh communicators made as symcomm's paths make theirs; the id travels over the gloo group.
    device = torch.device("cuda", local)
    peers = Peers(dist.group.WORLD, settings.timeout_s())
    timed, other1, other2, clean = (new_comm(nccl, peers, settings.timeout_s(), device) for _ in range(4))
    rows = []
    for text in args.sizes.split(","):
        nbytes = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        fresh = _launcher(nccl, clean, x, y)
        shared = _launcher(nccl, timed, x, y)
        others = [_launcher(nccl, c, x, y) for c in (other1, other2)]

        def eager(*calls):
            def run() -> None:
                for c in calls:
                    for _ in range(3):
                        c()
                torch.cuda.synchronize()
            return run

        # "clean" first, while the clean communicator has never run anything eagerly
        cases = {"clean": _time_graph(fresh)}
        eager(shared)()
        cases["eager_first"] = _time_graph(shared)
        cases["eager_between"] = _time_graph(shared, eager(shared))
        cases["three_comms"] = _time_graph(fresh, eager(*others))
        cases["three_comms_same"] = _time_graph(shared, eager(shared, *others))
        stats = torch.tensor(list(cases.values()), dtype=torch.float64)
        dist.all_reduce(stats)
        mean = dict(zip(cases, (stats / world).tolist()))
        rows.append({"bytes": nbytes, "us": mean})
        if rank == 0:
            print(f"{nbytes:>10} B  " + "  ".join(f"{k} {v:7.2f} us ({v / mean['clean']:.2f}x)"
                                                   for k, v in mean.items()), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump({"world": world, "nccl": nccl.version_string, "device": torch.cuda.get_device_name(),
                       "rows": rows}, fh, indent=1)
    for c in (timed, other1, other2, clean):
        nccl.comm_destroy(c)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
