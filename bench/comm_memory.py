"""Device memory of NCCL communicators, of torch's NCCL group and of symcomm, one case per process.

    python bench/comm_memory.py [--nproc N] [--cases a,b] [--json FILE] [--nccl-debug]

Every case runs in a fresh process (under torchrun when N > 1), because NCCL keeps process-wide
state (its kernels, once loaded; its proxy; cuMem granularity) that would blur what a second
communicator costs. Memory is what ``cudaMemGetInfo`` says is free, read after
``torch.cuda.synchronize()``, before and after each step; the step's cost is the drop in free
memory less what torch's caching allocator reserved in the same step (``memory_reserved``), so
tensors the bench or symcomm allocate through torch are not charged to NCCL. The free-memory
reading is device-wide: nothing else may run on the GPU meanwhile.

Cases (``--cases`` picks some; the default is all):
- ``idle``: no communicator: the noise floor.
- ``nccl``, ``nccl_ctas{1,2,4,8,16,32,64}``: ncclCommInitRank (or ncclCommInitRankConfig with
  maxCTAs set), a 1 KiB all_reduce, a 64 MiB one, destroy. ``nccl_x2``: two of them.
- ``split_share{1,0}``, ``split_share1_child_ctas4``: a parent created with splitShare 1 or 0, then
  ncclCommSplit of it (its config copied, or maxCTAs 4), each running one all_reduce (NCCL reads
  splitShare from the parent).
- ``window``, ``window_ctas4``, ``window_on_split``: a communicator (default; maxCTAs 4; a split
  sharing the parent's resources) with ncclMemAlloc(256 MiB) registered as a symmetric window,
  and in-place symmetric all_reduces of 1 KiB and 64 MiB on it.
- ``torch_pg``: torch's ProcessGroupNCCL: new_group("nccl"), one all_reduce, a 64 MiB one.
- ``graph_usage_one``: ``nccl`` with graphUsageMode=1, where the loaded NCCL has it (>= 2.29.2).
- ``symcomm``, ``symcomm_no_custom``, ``symcomm_nccl_only``, ``symcomm_graph_comms``:
  ``Communicator()`` (default; with custom_ar_capacity=0; with symmetric=False too; with
  graph_communicators=True), one eager all_reduce, the first
  ``graph_capture()`` of one all_reduce and its replay, close. capabilities() is kept.
- ``graph_capture_nccl``: two graphs of one raw ncclAllReduce each; ``graph_capture_torch_only``: a
  graph of one torch kernel: what capture costs, and whether NCCL is why.
- ``design_plain_default``, ``design_plain_ctas16``, ``design_split``: layouts symcomm could adopt,
  in raw NCCL: a plain communicator (default; maxCTAs 16; splitShare 1), a symmetric one with
  maxCTAs 4 (its own, or split from the plain one) holding the 256 MiB window, both captured.
- ``pg_then_*``: the same cases after torch's own NCCL group has run a collective (before the
  first sample), as in a serving engine: what symcomm adds to a process that already uses NCCL.
- ``timing_ctas{2,4,8,16}``, ``timing_default``: a graph of 20 captured bf16 all_reduces per size
  (1 KiB..256 MiB), replayed 5 times back to back, each replay timed alone; the median / 20 is
  the time per call. At world 1 NCCL runs a local copy, whatever its channels: only world >= 2
  says what fewer CTAs cost in bandwidth.

Prints a table per case and writes every sample, per rank, to ``--json``.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
WINDOW_BYTES = 256 * MiB
LARGE_CALL_BYTES = 64 * MiB
TIMING_ITERS, TIMING_REPLAYS = 20, 5
TIMING_SIZES = [1024 << i for i in range(19)]  # 1 KiB .. 256 MiB


# ------------------------------------------------------------------ one case, in its own process


class Case:
    """One process's run of a case: its samples, and what else it found out."""

    def __init__(self, warm_pg: bool = False) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.local)
        self.device = torch.device("cuda", self.local)
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from symcomm import _nccl

        self.nccl = _nccl.load()
        self.samples: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        # Buffers the steps use, allocated before the first sample so that no step pays for them.
        self.small = torch.randn(512, dtype=torch.bfloat16, device=self.device)  # 1 KiB
        self.large = torch.randn(LARGE_CALL_BYTES // 2, dtype=torch.bfloat16, device=self.device)
        if warm_pg:
            # A serving engine's own NCCL group, used before symcomm arrives: what NCCL costs a
            # process once (its kernels, its proxy) is then paid before the first sample.
            self.pg = dist.new_group(backend="nccl")
            dist.all_reduce(self.small, group=self.pg)
        torch.cuda.synchronize()
        self.record("start")

    def record(self, label: str) -> None:
        torch = self.torch
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        self.samples.append({"label": label, "free": free, "total": total,
                             "torch_reserved": torch.cuda.memory_reserved(self.device),
                             "t": time.perf_counter()})

    # ---- raw NCCL, no symcomm on the call path
    def comm(self, config=None) -> int:
        """Collective: a fresh NCCL communicator over the world, its id sent over gloo."""
        from symcomm import _nccl

        payload = [self.nccl.get_unique_id().to_bytes() if self.rank == 0 else None]
        self.dist.broadcast_object_list(payload, src=0)
        start = time.perf_counter()
        handle = self.nccl.comm_init_rank(self.world, _nccl.UniqueId.from_bytes(payload[0]), self.rank, config)
        self.extra.setdefault("init_s", []).append(time.perf_counter() - start)
        return handle

    def all_reduce(self, comm: int, ptr: int, nbytes: int, out: int | None = None) -> None:
        from symcomm import _nccl

        code = self.nccl.lib.ncclAllReduce(ptr, ptr if out is None else out, nbytes // 2, _nccl.BFLOAT16,
                                           _nccl.REDUCE_OPS["sum"], comm,
                                           self.torch.cuda.current_stream().cuda_stream)
        self.nccl.check("ncclAllReduce", code, comm)

    def mem_stats(self, name: str, comm: int) -> None:
        stats = self.nccl.comm_mem_stats(comm)
        if stats is not None:
            self.extra.setdefault("nccl_mem_stats", {})[name] = stats

    def result(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "samples": self.samples, "extra": self.extra}


def case_idle(c: Case) -> None:
    time.sleep(0.2)
    c.record("nothing")


def _plain(config=None) -> Callable[[Case], None]:
    def run(c: Case) -> None:
        comm = c.comm(config)
        c.record("init")
        c.all_reduce(comm, c.small.data_ptr(), c.small.nbytes)
        c.record("all_reduce 1 KiB")
        c.all_reduce(comm, c.large.data_ptr(), c.large.nbytes)
        c.record("all_reduce 64 MiB")
        c.mem_stats("comm", comm)
        c.nccl.comm_destroy(comm)
        c.record("destroy")
    return run


def case_nccl_x2(c: Case) -> None:
    comms = []
    for label in ("first", "second"):
        comms.append(c.comm())
        c.all_reduce(comms[-1], c.small.data_ptr(), c.small.nbytes)
        c.record(f"{label} communicator + all_reduce 1 KiB")
    for comm in comms:
        c.nccl.comm_destroy(comm)
    c.record("destroy both")


def _split(share: bool, child_config=None) -> Callable[[Case], None]:
    from symcomm._nccl_config import CommConfig

    def run(c: Case) -> None:
        parent = c.comm(CommConfig(split_share=share))
        c.record("parent init")
        c.all_reduce(parent, c.small.data_ptr(), c.small.nbytes)
        c.record("parent all_reduce 1 KiB")
        child = c.nccl.comm_split(parent, 0, c.rank, child_config)
        c.record("split")
        c.all_reduce(child, c.small.data_ptr(), c.small.nbytes)
        c.record("child all_reduce 1 KiB")
        c.all_reduce(child, c.large.data_ptr(), c.large.nbytes)
        c.record("child all_reduce 64 MiB")
        for name, comm in (("child", child), ("parent", parent)):
            c.mem_stats(name, comm)
            c.nccl.comm_destroy(comm)
        c.record("destroy both")
    return run


def _window(config=None, on_split: bool = False) -> Callable[[Case], None]:
    from symcomm._nccl_config import CommConfig

    def run(c: Case) -> None:
        parent = 0
        if on_split:
            parent = c.comm(CommConfig(split_share=True))
            c.all_reduce(parent, c.small.data_ptr(), c.small.nbytes)
            c.record("parent init + all_reduce 1 KiB")
            comm = c.nccl.comm_split(parent, 0, c.rank, config)
            c.record("split")
        else:
            comm = c.comm(config)
            c.record("init")
        c.all_reduce(comm, c.small.data_ptr(), c.small.nbytes)
        c.record("all_reduce 1 KiB (plain buffer)")
        ptr = c.nccl.mem_alloc(WINDOW_BYTES)
        c.record("ncclMemAlloc 256 MiB")
        win = c.nccl.window_register(comm, ptr, WINDOW_BYTES)
        c.record("window register")
        c.all_reduce(comm, ptr, 1024)
        c.record("symmetric all_reduce 1 KiB")
        c.all_reduce(comm, ptr, LARGE_CALL_BYTES)
        c.record("symmetric all_reduce 64 MiB")
        c.mem_stats("comm", comm)
        c.nccl.window_deregister(comm, win)
        c.nccl.mem_free(ptr)
        c.record("deregister + free")
        c.nccl.comm_destroy(comm)
        if parent:
            c.nccl.comm_destroy(parent)
        c.record("destroy")
    return run


def case_graph_capture_nccl(c: Case) -> None:
    """Two graphs of one raw ncclAllReduce each: what capture itself costs, once or per graph."""
    torch = c.torch
    comm = c.comm()
    c.all_reduce(comm, c.small.data_ptr(), c.small.nbytes)
    c.record("init + all_reduce 1 KiB")
    graphs = []
    for label in ("A", "B"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.all_reduce(comm, c.small.data_ptr(), c.small.nbytes)
        c.record(f"capture graph {label}")
        graph.replay()
        c.record(f"replay graph {label}")
        graphs.append(graph)
    del graphs, graph
    gc.collect()
    c.record("graphs freed")
    c.nccl.comm_destroy(comm)
    c.record("destroy")


def case_graph_capture_torch_only(c: Case) -> None:
    """A graph of one torch kernel and no NCCL: what CUDA graphs cost without NCCL."""
    torch = c.torch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.small.mul_(2)
    c.record("capture graph (1 torch kernel)")
    graph.replay()
    c.record("replay")


def _design(plain_config=None, symm_config=None, split: bool = False) -> Callable[[Case], None]:
    """A layout symcomm could adopt, in raw NCCL: a plain communicator, a symmetric one (own, or
    split from the plain one) with the 256 MiB pool registered, both captured in one graph."""
    def run(c: Case) -> None:
        torch = c.torch
        plain = c.comm(plain_config)
        c.all_reduce(plain, c.small.data_ptr(), c.small.nbytes)
        c.record("plain communicator + all_reduce")
        symm = c.nccl.comm_split(plain, 0, c.rank, symm_config) if split else c.comm(symm_config)
        c.all_reduce(symm, c.small.data_ptr(), c.small.nbytes)
        c.record("symmetric communicator + all_reduce")
        ptr = c.nccl.mem_alloc(WINDOW_BYTES)
        win = c.nccl.window_register(symm, ptr, WINDOW_BYTES)
        c.all_reduce(symm, ptr, 1024)
        c.record("256 MiB window + symmetric all_reduce")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.all_reduce(plain, c.large.data_ptr(), c.large.nbytes)
            c.all_reduce(symm, ptr, 1024)
        graph.replay()
        c.record("first capture (both) + replay")
        for name, comm in (("plain", plain), ("symmetric", symm)):
            c.mem_stats(name, comm)
        del graph
        c.nccl.window_deregister(symm, win)
        c.nccl.mem_free(ptr)
        c.nccl.comm_destroy(symm)
        c.nccl.comm_destroy(plain)
        c.record("teardown")
    return run


def case_torch_pg(c: Case) -> None:
    group = c.dist.new_group(backend="nccl")
    c.record("new_group(nccl)")
    c.dist.all_reduce(c.small, group=group)
    c.record("all_reduce 1 KiB")
    c.dist.all_reduce(c.large, group=group)
    c.record("all_reduce 64 MiB")
    c.dist.destroy_process_group(group)
    c.record("destroy group")


def case_graph_usage_one(c: Case) -> None:
    from symcomm._nccl_config import CommConfig, GraphUsage

    if not c.nccl.features["graph_usage_mode"]:
        c.extra["skipped"] = f"NCCL {c.nccl.version_string} has no graphUsageMode (needs >= 2.29.2)"
        return
    _plain(CommConfig(graph_usage_mode=GraphUsage.ONE_GRAPH))(c)


def _symcomm(**kwargs: Any) -> Callable[[Case], None]:
    def run(c: Case) -> None:
        import symcomm

        torch = c.torch
        start = time.perf_counter()
        comm = symcomm.Communicator(device=c.device, **kwargs)
        c.extra["communicator_s"] = time.perf_counter() - start
        c.record("Communicator()")
        comm.all_reduce(c.small)
        c.record("eager all_reduce 1 KiB")
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with comm.graph_capture(), torch.cuda.graph(graph):
            comm.all_reduce(c.small)
        c.extra["first_capture_s"] = time.perf_counter() - start
        graph.replay()
        c.record("first graph_capture() + replay")
        c.extra["capabilities"] = json.loads(json.dumps(comm.capabilities(), default=str))
        comm.close()
        c.record("close")
        del graph
        gc.collect()
        torch.cuda.empty_cache()
        c.record("graph freed, torch cache emptied")
    return run


def _timing(config=None) -> Callable[[Case], None]:
    def run(c: Case) -> None:
        torch = c.torch
        comm = c.comm(config)
        c.record("init")
        rows = []
        big = torch.randn(max(TIMING_SIZES) // 2, dtype=torch.bfloat16, device=c.device)
        out = torch.empty_like(big)
        for nbytes in TIMING_SIZES:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(TIMING_ITERS):
                    c.all_reduce(comm, big.data_ptr(), nbytes, out.data_ptr())
            graph.replay()
            torch.cuda.synchronize()
            c.dist.barrier()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(TIMING_REPLAYS + 1)]
            events[0].record()
            for i in range(TIMING_REPLAYS):
                graph.replay()
                events[i + 1].record()
            events[-1].synchronize()
            per_call = [events[i].elapsed_time(events[i + 1]) * 1e3 / TIMING_ITERS for i in range(TIMING_REPLAYS)]
            rows.append({"bytes": nbytes, "us_per_call": per_call, "median_us": statistics.median(per_call)})
            del graph
        c.extra["timing"] = rows
        c.record("after timing")
        c.nccl.comm_destroy(comm)
    return run


def cases() -> dict[str, Callable[[Case], None]]:
    from symcomm._nccl_config import CommConfig

    table: dict[str, Callable[[Case], None]] = {"idle": case_idle, "nccl": _plain()}
    for n in (1, 2, 4, 8, 16, 32, 64):
        table[f"nccl_ctas{n}"] = _plain(CommConfig(max_ctas=n))
    ctas4 = CommConfig(max_ctas=4)
    table |= {"nccl_x2": case_nccl_x2, "split_share1": _split(True), "split_share0": _split(False),
              "split_share1_child_ctas4": _split(True, ctas4),
              "window": _window(), "window_ctas4": _window(CommConfig(max_ctas=4)),
              "window_on_split": _window(on_split=True),
              "torch_pg": case_torch_pg, "graph_usage_one": case_graph_usage_one,
              "symcomm": _symcomm(), "symcomm_no_custom": _symcomm(custom_ar_capacity=0),
              "symcomm_graph_comms": _symcomm(graph_communicators=True),
              "symcomm_nccl_only": _symcomm(custom_ar_capacity=0, symmetric=False),
              "graph_capture_nccl": case_graph_capture_nccl,
              "graph_capture_torch_only": case_graph_capture_torch_only,
              "design_plain_default": _design(None, ctas4),
              "design_plain_ctas16": _design(CommConfig(max_ctas=16), ctas4),
              "design_split": _design(CommConfig(split_share=True), ctas4, split=True),
              "pg_then_nccl": _plain(), "pg_then_symcomm": _symcomm(),
              "pg_then_symcomm_graph_comms": _symcomm(graph_communicators=True),
              "pg_then_design_plain_default": _design(None, ctas4)}
    for n in (2, 4, 8, 16):
        table[f"timing_ctas{n}"] = _timing(CommConfig(max_ctas=n))
    table["timing_default"] = _timing()
    return table


def run_case(name: str, out: str) -> None:
    case = Case(warm_pg=name.startswith("pg_then_"))
    try:
        cases()[name](case)
    finally:
        Path(f"{out}.rank{case.rank}.json").write_text(json.dumps(case.result()))
        case.dist.destroy_process_group()


# ------------------------------------------------------------------ the driver


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(name: str, nproc: int, out: str, timeout_s: float, nccl_debug: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if nccl_debug:
        env |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ALLOC,GRAPH"}
    port = str(_free_port())
    if nproc == 1:
        env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, __file__, "--case", name, "--out", out]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={port}", __file__, "--case", name, "--out", out]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or b""
        rc, log = "timeout", raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    ranks = []
    for r in range(nproc):
        path = Path(f"{out}.rank{r}.json")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    result: dict[str, Any] = {"rc": rc, "wall_s": time.perf_counter() - start, "ranks": ranks}
    if rc != 0 or nccl_debug:
        result["log_tail"] = log.splitlines()[-600:]  # stdout and stderr: NCCL logs to stdout
    return result


def steps(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: device bytes taken outside torch's cache, and the running total since start."""
    rows, first = [], samples[0] if samples else None
    for prev, cur in itertools.pairwise(samples):
        device = prev["free"] - cur["free"]
        torch_cache = cur["torch_reserved"] - prev["torch_reserved"]
        rows.append({"label": cur["label"], "device_bytes": device, "torch_cache_bytes": torch_cache,
                     "outside_torch_bytes": device - torch_cache,
                     "total_outside_torch_bytes": (first["free"] - cur["free"])
                     - (cur["torch_reserved"] - first["torch_reserved"]),
                     "seconds": cur["t"] - prev["t"]})
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:9.1f}"


def report(results: dict[str, dict[str, Any]]) -> None:
    print(f"{'case':<20} {'step':<34} {'step MiB':>9} {'total MiB':>9} {'seconds':>8}   (rank 0; outside torch's cache)")
    for name, res in results.items():
        ranks = res["ranks"]
        if not ranks:
            print(f"{name:<20} FAILED rc={res['rc']}: " + " | ".join(res.get("log_tail", [])[-3:]))
            continue
        rank0 = ranks[0]
        if skipped := rank0["extra"].get("skipped"):
            print(f"{name:<20} skipped: {skipped}")
            continue
        for row in steps(rank0["samples"]):
            print(f"{name:<20} {row['label']:<34} {_mib(row['outside_torch_bytes'])} "
                  f"{_mib(row['total_outside_torch_bytes'])} {row['seconds']:8.3f}")
        if res["rc"] != 0:
            print(f"{name:<20} FAILED rc={res['rc']}: " + " | ".join(res.get("log_tail", [])[-3:]))
        caps = rank0["extra"].get("capabilities")
        if caps:
            graph = {k: v.get("device_bytes") for k, v in caps.items()
                     if k.endswith("_graph_communicator") and isinstance(v, dict)}
            print(f"{'':<20} capabilities(): graph communicator bytes {graph}; symmetric capacity "
                  f"{caps.get('symmetric_memory', {}).get('capacity')}")
            if memory := caps.get("memory"):
                print(f"{'':<20} capabilities()['memory']: {_mib(memory['total_bytes']).strip()} MiB in all, "
                      f"{_mib(memory['beyond_pool_bytes']).strip()} beyond the pool: "
                      + ", ".join(f"{k} {_mib(v).strip()}" for k, v in memory["components"].items()))
    timing = {name: res["ranks"][0]["extra"]["timing"] for name, res in results.items()
              if res["ranks"] and "timing" in res["ranks"][0]["extra"]}
    if timing:
        names = list(timing)
        print("\ngraph-captured bf16 all_reduce, us per call (median of "
              f"{TIMING_REPLAYS} replays of {TIMING_ITERS}), rank 0")
        print(f"{'bytes':>10} " + " ".join(f"{n:>15}" for n in names))
        for i, row in enumerate(timing[names[0]]):
            print(f"{row['bytes']:>10} " + " ".join(f"{timing[n][i]['median_us']:15.2f}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per case (GPUs on this host)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--case-timeout", type=float, default=120.0)
    parser.add_argument("--nccl-debug", action="store_true",
                        help="NCCL_DEBUG=INFO (INIT,ALLOC) in each case; its log tail goes to the JSON")
    args = parser.parse_args()
    if args.case:
        run_case(args.case, args.out)
        return
    import torch

    from symcomm import _nccl

    names = args.cases.split(",") if args.cases else list(cases())
    unknown = sorted(set(names) - set(cases()))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(cases())}")
    nccl = _nccl.load()
    meta = {"torch": torch.__version__, "nccl": nccl.version_string, "nccl_path": nccl.path,
            "nccl_features": nccl.features, "device": torch.cuda.get_device_name(0),
            "cuda_runtime": torch.version.cuda, "nproc": args.nproc,
            "driver": _driver_version(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_", "CUDA_", "SYMCOMM_"))},
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps({k: meta[k] for k in ("torch", "nccl", "device", "cuda_runtime", "driver", "nproc", "env")}))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = _launch(name, args.nproc, str(Path(tmp) / name), args.case_timeout, args.nccl_debug)
            print(f"# {name}: rc={results[name]['rc']} in {results[name]['wall_s']:.1f} s", flush=True)
    for res in results.values():
        for rank in res["ranks"]:
            rank["steps"] = steps(rank["samples"])
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "cases": results}, indent=1))


def _driver_version() -> str:
    version = ctypes.c_int()
    ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


if __name__ == "__main__":
    main()
