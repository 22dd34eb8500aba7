"""Runs the sweep on every rank: buffers, timing, correctness, rank averaging, rank-0 output.

Expects torch.distributed to be initialised already (the CLI does that).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from . import check, report
from .config import BenchConfig, BenchError, table_redop
from .sizes import FP4_OP, UNEVEN_OPS, Layout, layout, uneven_rule

_MIB = 1 << 20
_POOL_SLACK = 8 * _MIB
_POOL_ROUND = 2 * _MIB


def pool_bytes(buffer_bytes: int, buffers: int) -> int:
    """Symmetric pool to reserve up front: every rank must register the same amount, and growing
    it later is a collective that must not happen between timed calls. ``buffers`` buffers of
    ``buffer_bytes`` in all; the slack covers the allocator's 2 MiB rounding of each."""
    need = buffer_bytes + buffers * _POOL_ROUND + _POOL_SLACK
    return -(-need // _POOL_ROUND) * _POOL_ROUND


@dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor
    symmetric: bool
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-op buffers (fp4 outputs)


@dataclass
class Case:
    """One timed column: the call, how to load its input (and poison its output) before a
    checked call, and how to count wrong elements after it."""

    call: Callable[[], object]
    load: Callable[[], None]
    count: Callable[[], int] | None   # None when the check is off
    corrupt: Callable[[], None]       # test hook: spoil one output element


def views(lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) for one call. In-place aliases them the way nccl-tests does: the same
    tensor for all_reduce, the rank's slice of the output for gathers, the rank's slice of the
    input as the output for reduce-scatters."""
    op, row = lay.op, lay.row
    if op == "all_reduce":
        x = bufs.send[:lay.count]
        return x, (x if inplace else bufs.recv[:lay.count])
    lo, hi = lay.offset(rank), lay.offset(rank) + lay.parts[rank]
    if op in check.GATHERS:
        out = bufs.recv[:lay.total]
        x = out[lo:hi] if inplace else bufs.send[:lay.parts[rank]]
    else:
        x = bufs.send[:lay.total]
        out = x[lo:hi] if inplace else bufs.recv[:lay.parts[rank]]
    if op in UNEVEN_OPS:
        x, out = x.view(-1, row), out.view(-1, row)
    return x, out


def make_call(comm, lay: Layout, x: torch.Tensor, out: torch.Tensor, redop: str,
              algo: str) -> Callable[[], object]:
    """A zero-argument closure, so the timed loop costs one Python call on top of the API."""
    op = lay.op
    if op == "all_reduce":
        return lambda: comm.all_reduce(x, out=out, op=redop, algo=algo)
    if op == "all_gather":
        return lambda: comm.all_gather(x, out=out, algo=algo)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, out=out, op=redop, algo=algo)
    rows = [p // lay.row for p in lay.parts]
    if op in ("all_gatherv", FP4_OP):  # FP4_OP's unquantized baseline
        return lambda: comm.all_gatherv(x, rows, out=out, algo=algo)
    return lambda: comm.reduce_scatterv(x, rows, out=out, op=redop, algo=algo)


class Timer:
    """Per-rank time of one collective, in microseconds."""

    def __init__(self, device: torch.device, iters: int, warmup: int, graph_replays: int,
                 capture: Callable[[], ContextManager[object]] = nullcontext):
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.warmup = warmup
        self.graph_replays = graph_replays
        # Communicator.graph_capture where it exists: captured custom all-reduces then read
        # their inputs in place at replay, as a serving engine's graphs would, instead of
        # timing an extra staging copy per call.
        self.capture = capture

    def barrier(self) -> None:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, call: Callable[[], object]) -> float:
        # Graph mode always runs one eager call first: a path that refuses the call then says
        # so outside capture, and lazy setup never happens inside it.
        for _ in range(max(self.warmup, 1 if self.cuda and self.graph_replays > 0 else 0)):
            call()
        if not self.cuda:
            self.barrier()
            start = time.perf_counter()
            for _ in range(self.iters):
                call()
            return (time.perf_counter() - start) * 1e6 / self.iters
        if self.graph_replays > 0:
            return self._graph(call)
        return self._eager_cuda(call)

    def _eager_cuda(self, call: Callable[[], object]) -> float:
        start, end = _events()
        self.barrier()
        start.record()
        for _ in range(self.iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / self.iters

    def _graph(self, call: Callable[[], object]) -> float:
        # n collectives captured back to back, replayed G times with no barrier in between:
        # a barrier per replay would add the ranks' start skew to every sample.
        graph = torch.cuda.CUDAGraph()
        with self.capture(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(self.iters):
                call()
        graph.replay()  # untimed: the first launch also uploads the graph to the device
        start, end = _events()
        self.barrier()
        start.record()
        for _ in range(self.graph_replays):
            graph.replay()
        end.record()
        end.synchronize()
        elapsed_ms = start.elapsed_time(end)
        del graph
        return elapsed_ms * 1e3 / (self.iters * self.graph_replays)


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class Runner:
    """One communicator's sweep state: the paths to measure, buffers big enough for every op
    in ``ops`` (the symmetric pool is reserved once: growing it is a collective), the timer."""

    def __init__(self, cfg: BenchConfig, comm, ops: Sequence[str] | None = None):
        self.cfg = cfg
        self.comm = comm
        self.ops = tuple(ops or (cfg.op,))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(comm.device)
        self.dtype: torch.dtype = getattr(torch, cfg.torch_dtype_name)
        # The rank-average all_reduce goes over the torch group, whose NCCL backend (if any)
        # takes only CUDA tensors.
        self.stats_device = self.device if "nccl" in str(dist.get_backend()) else torch.device("cpu")
        self.notes: list[str] = list(cfg.notes)
        self.refused: dict[str, str] = {}  # algo -> first refusal, for --algo all
        import symcomm

        self._refusal = symcomm.ArgumentError
        self.algos = self._algos()
        self.bufs = self._buffers()
        self.timer = Timer(self.device, cfg.iters, cfg.warmup,
                           cfg.graph if self.device.type == "cuda" else 0,
                           getattr(comm, "graph_capture", nullcontext))

    # -- setup ---------------------------------------------------------------------------
    def _algos(self) -> list[str]:
        available = list(self.comm.algorithms())
        self.notes.append(f"Paths on this communicator: {', '.join(available) or 'none'}; "
                          f"auto follows the {self.comm.capabilities().get('tuning_table')} table")
        if self.ops == (FP4_OP,):
            from . import fp4_bench

            # Columns are the variants (unquantized, fp4, fp4 + dequantize); --algo picks the
            # path of the gather inside each.
            self.gather_algo = self._check_algo("auto" if self.cfg.algo == "all" else self.cfg.algo, available)
            return list(fp4_bench.VARIANTS)
        if self.cfg.algo == "all":
            # On GPUs the torch path is a last resort, not a contender: keep it out of "all".
            paths = [a for a in available if not (a == "torch" and self.device.type == "cuda")]
            return paths + (["auto"] if self.cfg.with_auto else [])
        return [self._check_algo(self.cfg.algo, available)]

    def _check_algo(self, algo: str, available: list[str]) -> str:
        if algo != "auto" and algo not in available:
            known = self.comm.capabilities().get("paths", {})
            why = (known.get(algo) or {}).get("reason")
            if why:
                raise BenchError(f"--algo {algo} is not available on this communicator: {why}")
            raise BenchError(f"--algo {algo} is not available on this communicator "
                             f"(available: {', '.join(['auto', 'all', *available])})")
        return algo

    def _buffers(self) -> Buffers:
        import symcomm

        itemsize = self.dtype.itemsize
        lays = [layout(op, n, self.world, itemsize, self.rank) for op in self.ops for n in self.cfg.sizes]
        n_send = max(max(lay.in_elems for lay in lays), 1)
        n_recv = max(max(lay.out_elems for lay in lays), 1)
        extra: dict[str, tuple[int, torch.dtype]] = {}
        if FP4_OP in self.ops:
            from . import fp4_bench

            extra = fp4_bench.buffer_specs(n_recv)
        total_bytes = (n_send + n_recv) * itemsize + sum(n * d.itemsize for n, d in extra.values())

        want = self.cfg.symmetric if self.cfg.symmetric is not None else self.device.type == "cuda"
        symmetric = False
        if want and self.device.type != "cuda":
            self.notes.append("Buffers: plain (symmetric memory needs --device cuda)")
        elif want:
            nbytes = pool_bytes(total_bytes, 2 + len(extra))
            try:
                self.comm.reserve_symmetric(nbytes)
                symmetric = True
                self.notes.append(f"Buffers: symmetric (pool of {nbytes // _MIB} MiB "
                                  f"reserved per rank)")
            except symcomm.SymcommError as exc:
                self.notes.append(f"Buffers: plain (symmetric memory unavailable: {exc})")
        else:
            self.notes.append("Buffers: plain" + (" (--no-symmetric)" if self.cfg.symmetric is False else ""))

        if not symmetric and "nccl-symm" in self.algos:
            if self.cfg.algo == "nccl-symm":
                raise BenchError("--algo nccl-symm needs symmetric buffers "
                                 "(drop --no-symmetric, or pick another algo)")
            self.algos.remove("nccl-symm")
            self.notes.append("Skipping nccl-symm: buffers are not symmetric")

        ctx = symcomm.use_symmetric_memory(self.comm) if symmetric else nullcontext()
        with ctx:
            send = torch.empty(n_send, dtype=self.dtype, device=self.device)
            recv = torch.empty(n_recv, dtype=self.dtype, device=self.device)
            more = {name: torch.empty(n, dtype=d, device=self.device) for name, (n, d) in extra.items()}
        return Buffers(send, recv, symmetric, more)

    def run_info(self, op: str | None = None) -> report.RunInfo:
        """The header's facts for ``op`` (default: the config's). Collective: every rank
        must call it, since it gathers the device list."""
        import symcomm

        cfg = self.cfg
        op = op or cfg.op
        cuda = self.device.type == "cuda"
        if cuda and cfg.graph > 0:
            timing = (f"Timing: {cfg.iters} ops captured in one CUDA graph, replayed {cfg.graph} "
                      f"times, CUDA events; time = elapsed/(iters*replays), averaged over ranks")
        elif cuda:
            timing = f"Timing: {cfg.iters} eager ops between CUDA events, averaged over ranks"
        else:
            timing = (f"Timing: {cfg.iters} eager ops after a barrier, perf_counter, "
                      f"averaged over ranks")
        if cfg.rounds > 1:
            timing += f"; median of {cfg.rounds} rounds, the paths interleaved"
        notes = [*self.notes, timing]
        if cfg.check:
            notes.append(f"Check: seeded random data (seed {cfg.seed}) against a float64 "
                         f"reference; #wrong summed over ranks")
        if op in UNEVEN_OPS:
            notes.append(f"Split: {uneven_rule(self.world, op)}")
        if op == FP4_OP:
            from . import fp4_bench

            notes += fp4_bench.notes(self)
        devices = self._gather_devices(_device_info(self.rank, self.device))
        return report.RunInfo(
            op=op, world=self.world, type_name=cfg.type_name, redop=table_redop(op, cfg.redop),
            minbytes=cfg.minbytes, maxbytes=cfg.maxbytes, stepfactor=cfg.stepfactor,
            warmup=cfg.warmup, iters=cfg.iters, check=cfg.check, rounds=cfg.rounds,
            graph=cfg.graph if cuda else 0, device=self.device.type,
            device_name=devices[0].name, backend=dist.get_backend(),
            torch_version=torch.__version__, nccl_version=_nccl_version(self.comm),
            notes=notes, devices=devices, version=symcomm.__version__)

    def _gather_devices(self, mine: report.DeviceInfo) -> list[report.DeviceInfo]:
        """Every rank's DeviceInfo, as JSON in fixed-size byte tensors: all_gather_object
        needs numpy, which a CPU-only machine may lack."""
        size = 1024
        raw = json.dumps(dataclasses.astuple(mine)).encode()[:size]
        local = torch.zeros(size, dtype=torch.uint8, device=self.stats_device)
        local[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.stats_device)
        rows = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(rows, local)
        infos = []
        for row in rows:
            fields = json.loads(bytes(row.tolist()).rstrip(b"\0"))
            fields[4] = tuple(fields[4]) if fields[4] is not None else None
            infos.append(report.DeviceInfo(*fields))
        return infos

    # -- one size ------------------------------------------------------------------------
    def measure_size(self, op: str, nbytes: int, progress: report.Progress) -> list[report.SizeRow]:
        cfg = self.cfg
        lay = layout(op, nbytes, self.world, self.dtype.itemsize, self.rank)
        data_redop = table_redop(op, cfg.redop)

        def gen(p: int) -> torch.Tensor:
            return check.make_input(check.input_elems(lay, p), self.dtype, self.device, cfg.seed,
                                    p, lay.nbytes, data_redop, self.world)

        if op == FP4_OP:
            from . import fp4_bench

            cases = fp4_bench.cases(self, lay, gen)
        else:
            cases = self._cases(lay, gen)
        stats = torch.zeros(len(self.algos), 4, dtype=torch.float64)
        # Rounds pass over every path in turn, so a slow spell of the machine (a host hiccup
        # delaying a replay) lands on one sample of each path rather than on all of one path;
        # the median then drops it. Results are checked in the first round only.
        samples: list[list[list[float]]] = [[[], []] for _ in self.algos]
        for round_ in range(cfg.rounds):
            last = round_ == cfg.rounds - 1
            for i, algo in enumerate(self.algos):
                for j, inplace in enumerate((False, True)):
                    if math.isnan(stats[i, 2 * j]):  # absent or refused: the same every round
                        continue
                    where = f"{algo} at {lay.nbytes} B {'in-place' if inplace else 'out-of-place'}"
                    case = cases(algo, inplace)
                    if case is None:  # the variant has no such column
                        stats[i, 2 * j] = math.nan
                        continue
                    case.load()
                    try:
                        samples[i][j].append(self.timer.measure(case.call))
                        if round_ == 0 and case.count is not None:
                            stats[i, 2 * j + 1] = self._check(case)
                    except self._refusal as exc:
                        # symcomm refuses a call before any communication, on every rank alike,
                        # so the sweep can go on without this path at this size.
                        if len(self.algos) == 1:
                            raise BenchError(f"{where}: {exc}") from exc
                        stats[i, 2 * j] = math.nan
                        self.refused.setdefault(algo, f"{where}: {exc}")
                    except Exception as exc:
                        raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
                    if last and not math.isnan(stats[i, 2 * j]):
                        stats[i, 2 * j] = statistics.median(samples[i][j])
                progress.advance(f"{op} {lay.nbytes} B {algo}")

        stats = stats.to(self.stats_device)
        dist.all_reduce(stats)
        stats = stats.cpu()
        rows = []
        for i, algo in enumerate(self.algos):
            t_oop, w_oop, t_ip, w_ip = (float(v) for v in stats[i])
            rows.append(report.SizeRow(algo, lay.nbytes, lay.count,
                                       self._timing(t_oop, w_oop, cfg.check),
                                       self._timing(t_ip, w_ip, cfg.check)))
        return rows

    def _cases(self, lay: Layout, gen: Callable[[int], torch.Tensor]) -> Callable[[str, bool], Case]:
        """The plain collectives: every path, out of place and in place, checked against a
        float64 reference computed from every rank's regenerated input."""
        cfg = self.cfg
        mine = gen(self.rank)
        exp = check.expected(lay, cfg.redop, self.dtype, self.rank, self.world, gen) if cfg.check else None

        def case(algo: str, inplace: bool) -> Case:
            x, out = views(lay, self.bufs, self.rank, inplace)
            return Case(call=make_call(self.comm, lay, x, out, cfg.redop, algo),
                        load=lambda: _load(x, out, mine),
                        count=None if exp is None else (lambda: check.count_wrong(out, exp)),
                        corrupt=lambda: check.corrupt(out))
        return case

    def _timing(self, time_sum: float, wrong_sum: float, checked: bool) -> report.Timing:
        if math.isnan(time_sum):
            return report.Timing(math.nan, None)
        return report.Timing(time_sum / self.world, int(wrong_sum) if checked else None)

    def _check(self, case: Case) -> int:
        case.load()
        case.call()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.cfg.corrupt_rank == self.rank:
            case.corrupt()
        return case.count()


def _load(x: torch.Tensor, out: torch.Tensor, mine: torch.Tensor) -> None:
    """Poison the output, then write this rank's input (in-place layouts overlap the two, so
    the order matters)."""
    check.poison_fill(out)
    if x.numel():
        x.reshape(-1).copy_(mine)


def _device_info(rank: int, device: torch.device) -> report.DeviceInfo:
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        pci = (getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", 0),
               getattr(props, "pci_device_id", 0))
        return report.DeviceInfo(rank, os.getpid(), host, index, pci, props.name)
    return report.DeviceInfo(rank, os.getpid(), host, None, None, _cpu_name())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _nccl_version(comm) -> str | None:
    try:
        nccl = comm.capabilities().get("nccl") or {}
        if nccl.get("version"):
            return str(nccl["version"])
    except Exception:  # noqa: BLE001 - capabilities() is informational; never stop a run for it
        pass
    if torch.cuda.is_available():
        try:
            return ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - CPU builds have no NCCL to report
            return None
    return None


def sweep(runner: Runner, op: str, progress: report.Progress,
          on_size: Callable[[list[report.SizeRow]], None] | None = None) -> list[report.SizeRow]:
    """Every size of the config for ``op``, every path of the runner; rows rank-averaged."""
    rows: list[report.SizeRow] = []
    for nbytes in runner.cfg.sizes:
        size_rows = runner.measure_size(op, nbytes, progress)
        rows += size_rows
        if on_size is not None:
            on_size(size_rows)
    return rows


def bar_enabled(lead: bool, streaming_to_terminal: bool) -> bool:
    # The bar shares the terminal with the table only when rows are not streaming to it.
    return lead and sys.stderr.isatty() and not streaming_to_terminal


def run(cfg: BenchConfig, comm) -> int:
    """The whole sweep. Returns the exit status: 1 if any element was wrong, else 0."""
    runner = Runner(cfg, comm)
    info = runner.run_info()
    emit = report.Emitter(runner.rank == 0)
    streaming = len(runner.algos) == 1

    emit(report.header_lines(info))
    if streaming:
        emit(report.block_header(runner.algos[0]))
    show_bar = bar_enabled(emit.lead, streaming and emit.out.isatty())
    with report.Progress(len(cfg.sizes) * len(runner.algos) * cfg.rounds, show_bar) as progress:
        on_size = (lambda size_rows: emit([report.format_row(r, info) for r in size_rows])) \
            if streaming else None
        rows = sweep(runner, cfg.op, progress, on_size)
    if streaming:
        emit([*report.footer_lines(rows, info), *report.conclusion_lines(info)])
    else:
        report.emit_blocks(emit, info, rows, runner.algos, runner.refused)
        emit.summary(rows, runner.algos)

    if emit.lead and cfg.json_path:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        report.write_json(cfg.json_path, report.json_payload(info, rows, date))
    if emit.lead and cfg.plot_path:
        from . import plot

        plot.write_plot(cfg.plot_path, info, rows, runner.algos)
    return 1 if report.total_wrong(rows) else 0
