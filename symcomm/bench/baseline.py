"""``symcomm-bench baseline OP``: NCCL at its best, to hold symcomm's numbers against.

In symcomm's process NCCL shares the process with other communicators (torch's, symcomm's
plain and symmetric ones), and its graph-mixing support then costs it microseconds per captured
collective (docs/measuring.md, "Honest ratios"). Here every rank holds exactly one NCCL
communicator, made straight from libnccl: torch's group is gloo and no symcomm.Communicator
exists. It times the op's own NCCL call the way the main sweep times a path, through the same
Runner: the spec's sizes, layouts, in-place aliasing, data and check, the same Timer (n calls
captured in one CUDA graph, replayed G times, after eager warm-up calls as nccl-tests makes),
the same rank average. Two buffer modes, named after nccl-tests' ``-R``, each on a communicator
of its own, the first closed before the second opens:

- R0: plain torch buffers;
- R2: ncclMemAlloc buffers registered with ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC),
  which lets NCCL pick its symmetric kernels (skipped where the NCCL has no windows).

The JSON it writes is what ``symcomm-bench OP --algo all --baseline FILE`` compares with
(:func:`load`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import _nccl, settings
from ..backends.nccl import new_comm
from ..peers import Peers
from ..errors import DtypeError
from . import ops, report
from .config import BaselineConfig, BenchConfig, BenchError
from .runner import Runner, progress_mode, sweep
from .spec import Buffers, OpSpec

SCHEMA = "symcomm-bench-baseline/1"


@dataclass(frozen=True)
class Mode:
    name: str
    windows: bool  # buffers in ncclMemAlloc memory, registered as symmetric windows
    what: str


MODES: tuple[Mode, ...] = (
    Mode("R0", False, "plain torch buffers"),
    Mode("R2", True, "ncclMemAlloc buffers registered with "
                     "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)"),
)


def device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr``, memory torch did not allocate and never frees.
    The storage constructor is torch's own (its CUDA-graph trees use it); the public routes
    need numpy (__cuda_array_interface__) or a hand-built DLPack capsule."""
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _current_stream() -> int:
    return torch.cuda.current_stream().cuda_stream


class RawNccl:
    """One NCCL communicator straight from libnccl. all_reduce, all_gather and reduce_scatter
    take the Communicator's arguments, so an op's spec drives it (OpSpec.run) as it drives
    symcomm, and each makes exactly one NCCL call: the one the spec names (OpSpec.nccl)."""

    def __init__(self, nccl: _nccl.Library, handle: int, device: torch.device,
                 stream: Callable[[], int] = _current_stream):
        self.nccl = nccl
        self.handle = handle
        self.device = device
        self._stream = stream  # read per call: under capture it is the capturing stream
        self._windows: list[int] = []
        self._memory: list[int] = []

    @classmethod
    def open(cls, nccl: _nccl.Library, device: torch.device) -> "RawNccl":
        """Collective over torch's (gloo) group, which carries rank 0's unique id to the others."""
        timeout_s = settings.timeout_s()
        peers = Peers(dist.group.WORLD, timeout_s)
        return cls(nccl, new_comm(nccl, peers, timeout_s, device), device)

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor, op: str, algo: str) -> None:
        self._call("ncclAllReduce", x, out, x.numel(), _nccl.REDUCE_OPS[op])

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor, algo: str) -> None:
        self._call("ncclAllGather", x, out, x.numel())  # sendcount

    def reduce_scatter(self, x: torch.Tensor, *, out: torch.Tensor, op: str, algo: str) -> None:
        self._call("ncclReduceScatter", x, out, out.numel(), _nccl.REDUCE_OPS[op])  # recvcount

    def _call(self, name: str, x: torch.Tensor, out: torch.Tensor, count: int, *op: int) -> None:
        # (sendbuff, recvbuff, count, datatype[, op], comm, stream): _nccl's signatures.
        code = getattr(self.nccl.lib, name)(x.data_ptr(), out.data_ptr(), count,
                                            _nccl.DTYPES[x.dtype], *op, self.handle, self._stream())
        self.nccl.check(name, code, self.handle)

    def window(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ncclMemAlloc memory registered as a symmetric window, as uint8.
        Collective: every rank asks for the same sizes in the same order."""
        ptr = self.nccl.mem_alloc(nbytes)
        self._memory.append(ptr)
        self._windows.append(self.nccl.window_register(self.handle, ptr, nbytes))
        return device_bytes(ptr, nbytes, self.device)

    def close(self) -> None:
        """Collective: the windows in reverse order, their memory, then the communicator."""
        torch.cuda.synchronize(self.device)
        for win in reversed(self._windows):
            self.nccl.window_deregister(self.handle, win)
        for ptr in self._memory:
            self.nccl.mem_free(ptr)
        self.nccl.comm_destroy(self.handle)


class ModeRunner(Runner):
    """The main sweep's Runner over a RawNccl: one column, the mode, and the mode's buffers."""

    def __init__(self, cfg: BaselineConfig, comm: RawNccl, mode: Mode):
        self.mode = mode
        super().__init__(cfg, comm)

    def _columns(self) -> tuple[str, list[str]]:
        return self.mode.name, [self.mode.name]

    def _buffers(self) -> Buffers:
        itemsize = self.dtype.itemsize
        # The largest over every rank's layout, so that each window has the same size on every
        # rank, as NCCL requires of a symmetric registration.
        lays = [self.spec.layout(n, self.world, itemsize, r)
                for n in self.cfg.sizes for r in range(self.world)]
        n_send = max(max(lay.in_elems for lay in lays), 1)
        n_recv = max(max(lay.out_elems for lay in lays), 1)
        if self.mode.windows:
            send = self.comm.window(n_send * itemsize).view(self.dtype)
            recv = self.comm.window(n_recv * itemsize).view(self.dtype)
        else:
            send = torch.empty(n_send, dtype=self.dtype, device=self.device)
            recv = torch.empty(n_recv, dtype=self.dtype, device=self.device)
        return Buffers(send, recv, symmetric=self.mode.windows)

    def nccl_version(self) -> str:
        return self.comm.nccl.version_string


def notes(spec: OpSpec, nccl: _nccl.Library, skipped: dict[str, str]) -> list[str]:
    """The preamble's account of what was timed."""
    return [f"Baseline: {spec.nccl} on a raw NCCL communicator (libnccl {nccl.version_string}, "
            f"{nccl.source}), the only NCCL communicator in this process: torch's group is gloo "
            f"and no symcomm.Communicator exists",
            "Modes, each on a communicator of its own, one after the other: "
            + "; ".join(f"{m.name} {m.what}" for m in MODES),
            *(f"{name} skipped: {why}" for name, why in skipped.items())]


def _measure(runner: ModeRunner, emit: report.Emitter, progress: report.Progress,
             header: bool) -> tuple[report.RunInfo, list[report.SizeRow]]:
    """One mode's block, streamed a size at a time. The runner, and with it the mode's buffers,
    lives no longer than this call, so the caller can free the memory under them."""
    info = runner.run_info()
    if header:
        emit(report.header_lines(info))
    emit(report.block_header(runner.mode.name))
    rows = sweep(runner, runner.cfg.op, progress,
                 lambda size_rows: emit([report.format_row(r, info) for r in size_rows]))
    emit(report.footer_lines(rows, info))
    return info, rows


def run(cfg: BaselineConfig) -> int:
    """One rank, with torch's gloo group up and its GPU current. Returns 1 if any element was
    wrong, else 0."""
    nccl = _nccl.load()
    spec = ops.spec(cfg.op)
    if spec.reduces:
        try:
            _nccl.reduce_dtype(getattr(torch, cfg.torch_dtype_name), nccl.version)
        except DtypeError as exc:
            raise BenchError(str(exc)) from None
    modes = [m for m in MODES if nccl.has_windows or not m.windows]
    skipped = {m.name: f"NCCL {nccl.version_string} has no symmetric windows (they need "
                       f"{'.'.join(map(str, _nccl.SYMMETRIC_MIN_VERSION))})"
               for m in MODES if m not in modes}
    cfg = dataclasses.replace(cfg, notes=[*cfg.notes, *notes(spec, nccl, skipped)])
    device = torch.device("cuda", torch.cuda.current_device())
    emit = report.Emitter(dist.get_rank() == 0)
    results: dict[str, list[report.SizeRow]] = {}
    info: report.RunInfo | None = None
    total = len(cfg.sizes) * len(modes) * cfg.rounds
    with report.Progress(total, progress_mode(emit.lead, emit.out.isatty())) as progress:
        for mode in modes:
            comm = RawNccl.open(nccl, device)
            info, results[mode.name] = _measure(ModeRunner(cfg, comm, mode), emit, progress, info is None)
            # Not in a finally: closing is collective, and a rank that failed leaves through the
            # CLI's exit instead of waiting on peers that may never get here.
            comm.close()
    assert info is not None  # R0 needs nothing the NCCL may lack
    emit(report.conclusion_lines(info))
    if emit.lead and cfg.json_path:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        report.write_json(cfg.json_path, payload(cfg, info, results, skipped, date))
    return 1 if any(report.total_wrong(rows) for rows in results.values()) else 0


def payload(cfg: BenchConfig, info: report.RunInfo, results: dict[str, list[report.SizeRow]],
            skipped: dict[str, str], date: str) -> dict:
    factor = report.bus_factor(info.op, info.world)
    return {
        "schema": SCHEMA,
        "op": info.op,
        "world": info.world,
        "dtype": info.type_name,
        "redop": info.redop,
        "sizes": list(cfg.sizes),
        "modes": {mode: report.flat_rows(rows, factor) for mode, rows in results.items()},
        "skipped": dict(skipped),
        "device": info.device_name,
        "nccl": info.nccl_version,
        "torch": info.torch_version,
        "date": date,
        "command": cfg.command,
        "timing": timing(cfg),
    }


def timing(cfg: BenchConfig) -> dict[str, int]:
    return {"iters": cfg.iters, "warmup_iters": cfg.warmup, "graph_replays": cfg.graph,
            "rounds": cfg.rounds}


def best_times(modes: dict[str, Sequence[dict]]) -> dict[int, tuple[float, str]]:
    """bytes -> (time, mode) of the faster mode out of place; sizes no mode timed are absent."""
    best: dict[int, tuple[float, str]] = {}
    for mode, rows in modes.items():
        for row in rows:
            t = row["time_us"]
            if row["inplace"] or t is None:
                continue
            if row["bytes"] not in best or t < best[row["bytes"]][0]:
                best[row["bytes"]] = (float(t), mode)
    return best


def load(path: str, cfg: BenchConfig, world: int) -> report.Clean:
    """The --baseline file, as the summary compares with it. BenchError where it cannot be
    read, or was measured for another op, world size, dtype or reduction."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BenchError(f"--baseline {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise BenchError(f"--baseline {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise BenchError(f"--baseline {path}: not a file written by 'symcomm-bench baseline' "
                         f"(schema {SCHEMA})")
    here = {"op": cfg.op, "world": world, "dtype": cfg.type_name,
            "redop": ops.spec(cfg.op).redop_label(cfg.redop)}
    differ = [f"{key} {data.get(key)} there, {value} here" for key, value in here.items()
              if data.get(key) != value]
    if differ:
        raise BenchError(f"--baseline {path} was measured for another run ({'; '.join(differ)}): "
                         f"measure one with 'symcomm-bench baseline {cfg.op}' and this run's "
                         f"-g, -d and -o")
    try:
        best = best_times(data["modes"])
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise BenchError(f"--baseline {path}: malformed 'modes' ({type(exc).__name__}: {exc})") from None

    theirs, mine = data.get("timing") or {}, timing(cfg)
    unlike = [f"{key} {theirs.get(key)} there, {value} here" for key, value in mine.items()
              if theirs.get(key) != value]
    note = (f"Clean baseline: {path}: NCCL {data.get('nccl')} alone in its process on "
            f"{data.get('device')}, {data.get('date')}; the summary's 'nccl clean' is its faster "
            f"mode per size, out of place")
    if unlike:
        note += f"; timed differently ({', '.join(unlike)})"
    record = {"path": path, **{k: data.get(k) for k in ("date", "device", "nccl", "command", "timing")},
              "clean": [{"bytes": n, "time_us": t, "mode": m} for n, (t, m) in sorted(best.items())]}
    return report.Clean(path, {n: t for n, (t, _) in best.items()}, note, record)
