"""Runs the sweep on every rank: buffers, timing, correctness, rank averaging, rank-0 output.

What each op allocates, calls and checks is its spec's (ops.py); this module runs any of them.
Expects torch.distributed to be initialised already (the CLI does that).
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import socket
import statistics
import sys
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import symcomm
from symcomm import about
from symcomm.pool import segment_bytes

from . import exchange, link, ops, plot, report
from .config import BenchConfig, BenchError
from .spec import Buffers, Case, OpSpec, Refusal, Setup
from .timing import Timer

_MIB = 1 << 20
_POOL_SLACK = 8 * _MIB


def pool_bytes(buffer_sizes: Sequence[int]) -> int:
    """Symmetric pool to reserve up front for tensors of ``buffer_sizes`` bytes: every rank must
    register the same amount, and growing it later is a collective that must not happen between
    timed calls."""
    return sum(segment_bytes(n) for n in buffer_sizes) + _POOL_SLACK


def buffer_elems(specs: Sequence[OpSpec], sizes: Sequence[int], world: int, itemsize: int) -> tuple[int, int]:
    """Elements of the send and recv buffers that every size of every spec fits, the same on
    every rank. Uneven ops (all_gatherv, reduce_scatterv) give ranks different inputs, so the
    largest over all ranks is taken: reserve_symmetric is a collective that takes one size, and
    equal buffers sit at the same pool offset on every rank, as the symmetric kernels need."""
    lays = [s.layout(n, world, itemsize, rank) for s in specs for n in sizes for rank in range(world)]
    return max([lay.in_elems for lay in lays] + [1]), max([lay.out_elems for lay in lays] + [1])


class Runner:
    """One communicator's sweep state: the columns to measure (the paths, or the config op's
    variants), buffers big enough for every op in ``op_names`` (the symmetric pool is reserved
    once: growing it is a collective), the timer. baseline.ModeRunner keeps all of it but the
    columns and buffers (_columns, _buffers), so NCCL alone is measured by this same code."""

    def __init__(self, cfg: BenchConfig, comm, op_names: Sequence[str] | None = None):
        self.cfg = cfg
        self.comm = comm
        self.spec = self.spec_of(cfg.op)
        self.specs: tuple[OpSpec, ...] = tuple(self.spec_of(n) for n in (op_names or (cfg.op,)))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if cfg.corrupt_rank is not None and cfg.corrupt_rank >= self.world:
            # A test hook that spoils nothing would pass a run that was meant to fail.
            raise BenchError(f"SYMCOMM_BENCH_CORRUPT={cfg.corrupt_rank} names no rank of this world "
                             f"(ranks 0 to {self.world - 1})")
        self.device = torch.device(comm.device)
        self.dtype: torch.dtype = getattr(torch, cfg.torch_dtype_name)
        # The rank-average all_reduce goes over the torch group, whose NCCL backend (if any)
        # takes only CUDA tensors.
        self.stats_device = self.device if "nccl" in str(dist.get_backend()) else torch.device("cpu")
        self.notes: list[str] = list(cfg.notes)
        self.refused: dict[str, str] = {}  # algo -> first refusal, for --algo all
        self._round_up_sizes()
        self.path, self.algos = self._columns()
        self.bufs = self._buffers()
        graph_replays = cfg.graph if self.device.type == "cuda" else 0
        self.setup = Setup(comm, self.bufs, self.rank, self.world, self.device, self.dtype, cfg.redop,
                           cfg.seed, cfg.check, self.path, graphs=graph_replays > 0)
        self.timer = Timer(self.device, cfg.iters, cfg.warmup, graph_replays,
                           getattr(comm, "graph_capture", nullcontext))

    def spec_of(self, op: str) -> OpSpec:
        """``op``'s spec with the run's shape flags applied."""
        return ops.spec(op).configure(self.cfg.options)

    # -- setup ---------------------------------------------------------------------------
    def _round_up_sizes(self) -> None:
        """Sizes too small for one element (or one per rank, or one row) would make empty
        calls and print rows of zeros: they run at the smallest size that is not empty."""
        itemsize = getattr(torch, self.cfg.torch_dtype_name).itemsize
        smallest = self.spec.smallest_size(self.world, itemsize)
        if smallest is None or min(self.cfg.sizes) >= smallest:
            return
        self.cfg.sizes = sorted({max(n, smallest) for n in self.cfg.sizes})
        self.notes.append(f"Sizes: {self.cfg.op} of {self.cfg.type_name} at world {self.world} is empty below "
                          f"{smallest} B, so smaller sizes run as {smallest} B")

    def _columns(self) -> tuple[str, list[str]]:
        """(path, columns): a spec's variants are the columns, each running --algo's path
        ("all": auto); otherwise every column is a path of its own or a comparison column
        (--algo all: every path, auto and the comparisons; else the comma-separated names)."""
        # A spec with variants runs its op on --algo's collective path; any other spec's
        # columns are the paths of its own operation.
        available = list(self.comm.algorithms() if self.spec.variants else self.comm.algorithms(self.cfg.op))
        native = about.native_line()
        self.notes.append(native[:1].upper() + native[1:])
        self.notes.append(f"Paths on this communicator: {', '.join(available) or 'none'}; "
                          f"auto follows the {self.comm.capabilities().get('tuning_table')} table")
        if self.spec.variants:
            path = "auto" if self.cfg.algo == "all" else self._check_algo(self.cfg.algo, available)
            return path, list(self.spec.variants)
        theirs = list(self.spec.comparisons)
        if self.cfg.algo == "all":
            # On GPUs the torch path is a last resort, not a contender: keep it out of "all".
            paths = [a for a in available if not (a == "torch" and self.device.type == "cuda")]
            return "auto", (paths + (["auto"] if self.cfg.with_auto else [])
                            + (theirs if self.cfg.with_comparisons else []))
        columns = [a if a in theirs else self._check_algo(a, available) for a in self.cfg.algo.split(",")]
        return next((a for a in columns if a not in theirs), "auto"), columns

    def probe(self) -> None:
        """One call of every column at the first size, before the header: a call symcomm
        refuses (a dtype no path of this communicator takes, say) is then one line, not an
        error after the header. Collective, like the sweep: every rank calls it."""
        spec, nbytes = self.spec, self.cfg.sizes[0]
        lay = spec.layout(nbytes, self.world, self.dtype.itemsize, self.rank)
        cases = spec.cases(self.setup, lay, spec.inputs(self.setup, lay))
        refusals = []
        for algo in self.algos:
            case = cases(algo, False)
            if case is None:
                continue
            if isinstance(case, Refusal):
                refusals.append(f"{algo}: {case.reason}")
                continue
            case.load()
            try:
                case.call()
            except symcomm.ArgumentError as exc:
                known = self.comm.capabilities().get("paths", {})
                refusals.append(short_refusal(str(exc), list(known), self.comm.algorithms()))
                continue
            return  # one column runs: --algo all reports the others in its summary
        if refusals:
            raise BenchError(f"{self.cfg.op} of {self.cfg.datatype} at {lay.nbytes} B on this "
                             f"{self.device.type} communicator: {refusals[0]}")

    def _check_algo(self, algo: str, available: list[str]) -> str:
        if algo != "auto" and algo not in available:
            known = self.comm.capabilities().get("paths", {})
            why = (known.get(algo) or {}).get("reason")
            if why:
                raise BenchError(f"--algo {algo} is not available on this communicator: {why}")
            raise BenchError(f"--algo {algo} is not available on this communicator "
                             f"(available: {', '.join(['auto', 'all', *available, *self.spec.comparisons])})")
        return algo

    def _buffers(self) -> Buffers:
        itemsize = self.dtype.itemsize
        n_send, n_recv = buffer_elems(self.specs, self.cfg.sizes, self.world, itemsize)
        extra: dict[str, tuple[int, torch.dtype]] = {}
        for s in self.specs:
            extra.update(s.buffers(n_recv))
        sizes = [n_send * itemsize, n_recv * itemsize, *(n * d.itemsize for n, d in extra.values())]

        want = self.cfg.symmetric if self.cfg.symmetric is not None else self.device.type == "cuda"
        symmetric = False
        if want and self.device.type != "cuda":
            self.notes.append("Buffers: plain (symmetric memory needs --device cuda)")
        elif want:
            nbytes = pool_bytes(sizes)
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

    def run_info(self) -> report.RunInfo:
        """The header's facts for the config's op. Collective: every rank must call it, since
        it gathers the device list."""
        cfg = self.cfg
        cuda = self.device.type == "cuda"
        if cuda and cfg.graph > 0:
            timing = (f"Timing: {cfg.iters} ops captured in one CUDA graph, replayed {cfg.graph} "
                      f"times, CUDA events; time = elapsed/(iters*replays), averaged over ranks")
        elif cuda:
            timing = f"Timing: {cfg.iters} eager ops between CUDA events, averaged over ranks"
        else:
            timing = (f"Timing: {cfg.iters} eager ops after a barrier, perf_counter, averaged over "
                      f"ranks; on the CPU they time gloo on this host, not symcomm's GPU paths: "
                      f"check #wrong here, quote times only from GPUs")
        if cfg.rounds > 1:
            timing += f"; median of {cfg.rounds} rounds, the paths interleaved"
        notes = [*self.notes, timing]
        if cfg.check:
            notes.append(f"Check: seeded random data (seed {cfg.seed}) against a float64 "
                         f"reference; #wrong summed over ranks")
        notes += self.spec.notes(self.world, self.dtype.itemsize, self.path)
        if set(self.algos) & set(self.spec.comparisons):
            notes += self.spec.comparison_notes()
        devices = gather_devices(device_info(self.rank, self.device), self.stats_device)
        return report.RunInfo(
            op=cfg.op, world=self.world, **self.spec.labels(cfg.type_name, cfg.redop)._asdict(),
            minbytes=cfg.minbytes, maxbytes=cfg.maxbytes, stepfactor=cfg.stepfactor,
            warmup=cfg.warmup, iters=cfg.iters, check=cfg.check, rounds=cfg.rounds,
            graph=cfg.graph if cuda else 0, device=self.device.type,
            device_name=devices[0].name, backend=dist.get_backend(),
            torch_version=torch.__version__, nccl_version=self.nccl_version(),
            notes=notes, devices=devices, version=symcomm.__version__)

    def measure_link(self, rows: Sequence[report.SizeRow], info: report.RunInfo) -> report.LinkTimes | None:
        """A peer copy of each size's bytes on the wire, for the summary's 'auto of link'
        (link.py), where it means something: an even collective on GPUs, auto in the columns.
        Collective."""
        if not (self.spec.times_link and self.device.type == "cuda" and "auto" in self.algos):
            return None
        sizes = sorted({r.nbytes for r in rows})
        return link.measure(sizes, self.spec.bus_factor(self.world), info.devices, self.rank, self.device,
                            self.cfg.iters, self.cfg.rounds, self.cfg.seed,
                            lambda value: exchange.gather_json(value, self.stats_device))

    def nccl_version(self) -> str | None:
        return _nccl_version(self.comm)

    # -- one size ------------------------------------------------------------------------
    def measure_size(self, op: str, nbytes: int, progress: report.Progress) -> list[report.SizeRow]:
        """One size of ``op``, every column, rank-averaged."""
        cfg = self.cfg
        algos = self.algos
        spec = self.spec_of(op)
        lay = spec.layout(nbytes, self.world, self.dtype.itemsize, self.rank)
        cases = spec.cases(self.setup, lay, spec.inputs(self.setup, lay))
        stats = torch.zeros(len(algos), 4, dtype=torch.float64)
        # Rounds pass over every path in turn, so a slow spell of the machine (a host hiccup
        # delaying a replay) lands on one sample of each path rather than on all of one path;
        # the median then drops it. Results are checked in the first round only.
        samples: list[list[list[float]]] = [[[], []] for _ in algos]
        for round_ in range(cfg.rounds):
            last = round_ == cfg.rounds - 1
            for i, algo in enumerate(algos):
                progress.starting(f"{op} {lay.nbytes} B {algo}, round {round_ + 1} of {cfg.rounds}")
                for j, inplace in enumerate((False, True)):
                    if math.isnan(stats[i, 2 * j]):  # absent or refused: the same every round
                        continue
                    where = f"{algo} at {lay.nbytes} B {'in-place' if inplace else 'out-of-place'}"
                    case = cases(algo, inplace)
                    if case is None:  # the variant has no such column
                        stats[i, 2 * j] = math.nan
                        continue
                    if isinstance(case, Refusal):  # decided by the spec, on every rank alike
                        self._refuse(stats, i, j, algo, where, case.reason, len(algos))
                        continue
                    case.load()
                    try:
                        samples[i][j].append(self.timer.measure(case.call))
                        if round_ == 0 and case.count is not None:
                            stats[i, 2 * j + 1] = self._check(case)
                    except symcomm.ArgumentError as exc:
                        # symcomm refuses a call before any communication, on every rank alike,
                        # so the sweep can go on without this path at this size.
                        self._refuse(stats, i, j, algo, where, str(exc), len(algos), exc)
                    except Exception as exc:
                        raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
                    if last and not math.isnan(stats[i, 2 * j]):
                        stats[i, 2 * j] = statistics.median(samples[i][j])
                progress.advance(f"{op} {lay.nbytes} B {algo}")

        stats = stats.to(self.stats_device)
        dist.all_reduce(stats)
        stats = stats.cpu()
        rows = []
        for i, algo in enumerate(algos):
            t_oop, w_oop, t_ip, w_ip = (float(v) for v in stats[i])
            rows.append(report.SizeRow(algo, lay.nbytes, lay.count,
                                       self._timing(t_oop, w_oop, cfg.check),
                                       self._timing(t_ip, w_ip, cfg.check)))
        return rows

    def _refuse(self, stats: torch.Tensor, i: int, j: int, algo: str, where: str, reason: str,
                columns: int, cause: Exception | None = None) -> None:
        """N/A for column ``i``'s side ``j`` at this size, and its reason for the line under the
        block; with no other column to show, the run stops with the reason instead."""
        if columns == 1:
            raise BenchError(f"{where}: {reason}") from cause
        stats[i, 2 * j] = math.nan
        self.refused.setdefault(algo, f"{where}: {reason}")

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


def short_refusal(message: str, paths: Sequence[str], open_paths: Sequence[str]) -> str:
    """symcomm's "no path can serve this OP: p1: why; p2: why; ..." cut to the reasons of the
    paths this communicator has open: the others' are why they are closed (no NCCL on the CPU,
    say), which the preamble's path list already shows. ``paths``: every path name the message
    may list. Any other message comes back whole."""
    head, sep, rest = message.partition(": ")
    if not sep or not head.startswith("no path can serve"):
        return message
    rest = re.sub(r" \(off on this communicator: .*\)$", "", rest)  # dispatch.no_path's list of closed paths
    names = "|".join(re.escape(p) for p in sorted(set(paths) | set(open_paths), key=len, reverse=True))
    parts = re.split(rf"(?:^|; )({names}): ", rest)
    kept = [f"{parts[i]}: {parts[i + 1]}" for i in range(1, len(parts) - 1, 2) if parts[i] in open_paths]
    return "; ".join(kept) if kept else message


def gather_devices(mine: report.DeviceInfo, stats_device: torch.device) -> list[report.DeviceInfo]:
    """Every rank's DeviceInfo, in rank order. Collective."""
    infos = []
    for fields in exchange.gather_json(dataclasses.astuple(mine), stats_device):
        fields[4] = tuple(fields[4]) if fields[4] is not None else None
        infos.append(report.DeviceInfo(*fields))
    return infos


def device_info(rank: int, device: torch.device) -> report.DeviceInfo:
    """This rank's line of the header's device list."""
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return report.DeviceInfo(rank, os.getpid(), host, index, report.pci_address(index),
                                 torch.cuda.get_device_name(index))
    return report.DeviceInfo(rank, os.getpid(), host, None, None, _cpu_name())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
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


def progress_mode(lead: bool, streaming_to_terminal: bool) -> str | None:
    """What report.Progress shows on the lead rank: a bar on a terminal (only when rows are not
    streaming to it: they would share it), a line per measurement where stderr is a file or pipe."""
    if not lead:
        return None
    if sys.stderr.isatty():
        return None if streaming_to_terminal else "bar"
    return "lines"


def run(cfg: BenchConfig, comm, clean: report.Clean | None = None) -> int:
    """The whole sweep. Returns the exit status: 1 if any element was wrong, else 0.
    ``clean``: the --baseline file's times, which the summary compares with."""
    runner = Runner(cfg, comm)
    if clean is not None:
        runner.notes.append(clean.note)
    info = runner.run_info()
    emit = report.Emitter(runner.rank == 0)
    streaming = len(runner.algos) == 1

    runner.probe()
    emit(report.header_lines(info))
    if streaming:
        emit(report.block_header(runner.algos[0]))
    mode = progress_mode(emit.lead, streaming and emit.out.isatty())
    with report.Progress(len(cfg.sizes) * len(runner.algos) * cfg.rounds, mode) as progress:
        on_size = (lambda size_rows: emit([report.format_row(r, info) for r in size_rows])) \
            if streaming else None
        rows = sweep(runner, cfg.op, progress, on_size)
    wire = None
    if streaming:
        emit([*report.footer_lines(rows, info), *report.conclusion_lines(info)])
    else:
        wire = runner.measure_link(rows, info)
        report.emit_blocks(emit, info, rows, runner.algos, runner.refused)
        emit.summary(rows, runner.algos, clean, [a for a in runner.algos if a in runner.spec.comparisons], wire)

    if emit.lead and cfg.json_path:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        record = clean.record if clean is not None else None
        report.write_json(cfg.json_path, report.json_payload(info, rows, date, record, wire, runner.refused))
    if emit.lead and cfg.plot_path:
        plot.write_plot(cfg.plot_path, info, rows, runner.algos)
    return 1 if report.total_wrong(rows) or (wire is not None and wire.wrong) else 0
