"""``symcomm-bench OP [options]``: argument parsing, validation and process launch.

Flags keep nccl-tests' names and meanings. Under torchrun (RANK/WORLD_SIZE set) every process
is one rank; otherwise ``-g N`` starts N local ranks as subprocesses and only rank 0 prints.
Subcommands, launched the same way: ``tune`` writes a dispatch table, ``baseline OP`` times the
op's own NCCL call alone in its process (baseline.py), which ``OP --baseline FILE`` compares with.
"""
from __future__ import annotations

import argparse
import inspect
import os
import shlex
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import symcomm
from symcomm import settings
from symcomm.backends import PATHS
from symcomm.operations import OPERATIONS

from . import baseline, ops, plot, report, runner, tune
from . import device as devices
from .config import (ALGO_NAME, DATATYPES, FLOAT_TYPES, REDOPS, TUNE_OPS, BaselineConfig, BenchConfig,
                     BenchError, TuneConfig)
from .sizes import parse_size, sweep

PROG = "symcomm-bench"
EXIT_USAGE = 2
TUNE = "tune"
# CPU ranks beyond the cores take turns and still give checked results, but every rank is a
# process holding torch (about 300 MB): past a few per core the machine pages, not computes.
RANKS_PER_CORE = 4
BASELINE = "baseline"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage dump
        raise BenchError(message)


def _common(p: argparse.ArgumentParser, minbytes: str, maxbytes: str, graph_default: str) -> None:
    """The flags a sweep and a tuning run share, with nccl-tests' names and meanings."""
    p.add_argument("-b", "--minbytes", default=minbytes, help=f"smallest size (K/M/G suffixes; default {minbytes})")
    p.add_argument("-e", "--maxbytes", default=maxbytes, help=f"largest size (default {maxbytes})")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warmup iterations (default 5)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check results (default 1)")
    p.add_argument("-G", "--cudagraph", type=int, default=None,
                   help=f"CUDA-graph replays of the n captured ops ({graph_default})")
    p.add_argument("-R", "--rounds", type=int, default=1,
                   help="measure every path this many times per size, the paths interleaved, and "
                        "report each one's median (default 1). Not nccl-tests' -R, which registers "
                        "buffers: symmetric buffers are --symmetric here")
    p.add_argument("-g", "--ngpus", type=int, default=None, help="local processes to start (default 1)")
    p.add_argument("--device", choices=devices.CHOICES, default="auto",
                   help="default auto: cuda when every local rank gets a GPU, else cpu over gloo")
    p.add_argument("--seed", type=int, default=0, help="seed of the check data (default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Bandwidth and latency of symcomm collectives, printed in "
                f"nccl-tests' table layout. '{PROG} {TUNE} -h' writes a dispatch table instead; "
                f"'{PROG} {BASELINE} -h' times NCCL alone in its process, for --baseline.")
    p.add_argument("collective", metavar="OP", choices=ops.names(), help=" | ".join(ops.names()))
    _common(p, "32M", "32M", "default 0: eager")
    p.add_argument("--with", dest="extensions", action="append", default=[], metavar="MODULE",
                   help="also benchmark the operations of MODULE (importable; it exports OPERATIONS "
                        "and PATHS, as an extension of symcomm does); repeatable")
    p.add_argument("-d", "--datatype", default=None,
                   help="float, half, bfloat16, double, int8, uint8, int32, int64, f8e4m3, f8e5m2 "
                        "(default float on cpu, bfloat16 on cuda; all_reduce_rmsnorm and moe take "
                        "bfloat16 everywhere)")
    p.add_argument("-o", "--op", dest="redop", choices=REDOPS, default="sum", help="reduction (default sum)")
    p.add_argument("--algo", default="auto",
                   help="auto, a path of this communicator (nccl, nccl-symm, torch, custom-...), a comparison "
                        "column (all_reduce: symm_mem-oneshot, symm_mem-twoshot, PyTorch's symmetric memory), "
                        "a comma-separated list of these, or 'all': every path, auto and the comparisons in "
                        "the same pass")
    p.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="allocate buffers inside symcomm.use_symmetric_memory (default: on for cuda)")
    p.add_argument("--graph-communicators", action="store_true",
                   help="Communicator(graph_communicators=True): captured NCCL calls on communicators of their "
                        "own (docs/memory.md); off by default, as in a default Communicator")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH.png",
                   help="write latency and busbw against size, one line per path (needs matplotlib)")
    p.add_argument("--baseline", default=None, metavar="PATH",
                   help=f"JSON of '{PROG} {BASELINE} OP' at this world size and dtype: the --algo all "
                        "summary gains NCCL-alone columns")
    shapes = p.add_argument_group("moe's shape (symcomm/bench/moe_spec.py)")
    shapes.add_argument("--tokens", default=None, metavar="N[,N...]",
                        help="tokens per rank, in place of -b/-e (a size is their dispatched bytes)")
    shapes.add_argument("--hidden", type=int, default=None, help="values per token (default 7168)")
    shapes.add_argument("--topk", type=int, default=None, help="experts per token (default 8)")
    shapes.add_argument("--experts", type=int, default=None, help="experts in all (default 256)")
    return p


SHAPE_FLAGS = ("hidden", "topk", "experts")


def shape_options(args: argparse.Namespace, op: str, datatype: str, fields: dict) -> dict[str, int]:
    """The op's shape flags, checked; --tokens replaces the sweep's sizes in ``fields``."""
    options = {name: getattr(args, name) for name in SHAPE_FLAGS if getattr(args, name, None) is not None}
    tokens = getattr(args, "tokens", None)
    spec = ops.spec(op)
    given = [f"--{name}" for name in options] + (["--tokens"] if tokens is not None else [])
    if given and not spec.shape_flags:
        takers = [name for name in ops.NAMES if ops.spec(name).shape_flags]
        raise BenchError(f"{', '.join(given)}: only {', '.join(takers)} take shape flags, not {op}")
    for name, value in options.items():
        if value < 1:
            raise BenchError(f"--{name} must be at least 1 (got {value})")
    spec = spec.configure(options)
    spec.validate(datatype)
    if tokens is not None:
        try:
            counts = sorted({int(t) for t in tokens.split(",")})
        except ValueError:
            raise BenchError(f"--tokens {tokens!r}: comma-separated token counts, e.g. 128,512") from None
        if counts[0] < 1:
            raise BenchError("--tokens: counts must be at least 1")
        step = spec.smallest_size(1, torch.empty((), dtype=getattr(torch, DATATYPES[datatype][1])).element_size())
        # stepfactor 0: the sizes are a list, not a sweep (the header line says so, not -f's default).
        fields.update(sizes=[t * step for t in counts], minbytes=counts[0] * step, maxbytes=counts[-1] * step,
                      stepfactor=0)
        fields["notes"] = [*fields["notes"], f"sizes: --tokens {','.join(map(str, counts))} per rank, "
                                             f"{step} dispatched bytes a token"]
    return options


def build_tune_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} {TUNE}", description="Measure every path of "
                f"{', '.join(TUNE_OPS)} (the even ops also in place, the v-variants with uneven splits) over a "
                "size sweep and write the "
                "dispatch table Communicator loads (SYMCOMM_TUNING_FILE, or ship it in symcomm/tuning/).")
    _common(p, "1K", "256M", "default 10 on cuda; 0 on cpu, which has no graphs")
    p.add_argument("-d", "--datatype", default="bfloat16", help="default bfloat16")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="where to write the table (default: <gpu>_w<world>.json here)")
    return p


def build_baseline_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} {BASELINE}", description="Time the op's own NCCL collective on a raw "
                "NCCL communicator, the only one in each rank's process, with plain buffers (R0) and "
                f"with symmetric windows (R2), as '{PROG} OP' times its paths; '{PROG} OP --algo all "
                "--baseline FILE' then compares with it.")
    p.add_argument("collective", metavar="OP", choices=ops.names(), help=" | ".join(ops.BASELINE_NAMES))
    _common(p, "32M", "32M", "default 0: eager")
    p.add_argument("-d", "--datatype", default="bfloat16", help="default bfloat16, as the sweep on cuda")
    p.add_argument("-o", "--op", dest="redop", choices=REDOPS, default="sum", help="reduction (default sum)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="write the times as JSON, the file --baseline reads")
    return p


def _size(flag: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise BenchError(f"{flag}: {exc}") from None


def check_output(flag: str, path: str) -> None:
    """A file the run will write: refused now, before the run, if it cannot be written then."""
    target = Path(path)
    if target.is_dir():
        raise BenchError(f"{flag} {path}: that is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise BenchError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise BenchError(f"{flag} {path}: cannot write in {folder}")


def _fields(args: argparse.Namespace, device: str, op: str, redop: str, datatype: str,
            fallback: str | None, note: str | None = None) -> dict:
    """Checks the shared flags; returns them as BenchConfig fields. ``note``: the preamble's
    line on the device, where it needs explaining."""
    minbytes = _size("-b/--minbytes", args.minbytes)
    maxbytes = _size("-e/--maxbytes", args.maxbytes)
    if minbytes < 1:
        raise BenchError("-b/--minbytes must be at least 1 byte")
    if minbytes > maxbytes:
        raise BenchError(f"-b/--minbytes ({minbytes}) is larger than -e/--maxbytes ({maxbytes})")
    if args.stepfactor < 2:
        raise BenchError(f"-f/--stepfactor must be at least 2 (got {args.stepfactor})")
    if args.iters < 1:
        raise BenchError(f"-n/--iters must be at least 1 (got {args.iters})")
    if args.rounds < 1:
        raise BenchError(f"-R/--rounds must be at least 1 (got {args.rounds})")
    if args.warmup_iters < 0 or (args.cudagraph or 0) < 0:
        raise BenchError("-w/--warmup_iters and -G/--cudagraph cannot be negative")
    if args.cudagraph and device != "cuda":
        why = f" (--device auto chose cpu: {fallback})" if fallback else ""
        raise BenchError(f"-G/--cudagraph needs --device cuda{why}")
    if datatype not in DATATYPES:
        raise BenchError(f"unknown datatype {datatype!r} (choose from {', '.join(DATATYPES)})")
    if ops.spec(op).redop_label(redop) == "avg" and DATATYPES[datatype][0] not in FLOAT_TYPES:
        raise BenchError(f"-o avg needs a floating-point datatype, not {datatype}")
    corrupt = settings.bench_corrupt_rank()
    try:
        corrupt_rank = int(corrupt) if corrupt is not None else None
    except ValueError:
        raise BenchError(f"SYMCOMM_BENCH_CORRUPT must be a rank number, not {corrupt!r}") from None
    if corrupt_rank is not None and corrupt_rank < 0:
        raise BenchError(f"SYMCOMM_BENCH_CORRUPT must be a rank number (0 or more), not {corrupt!r}")
    if getattr(args, "json_path", None) is not None:
        check_output("--json", args.json_path)
    notes = [note] if note else []
    return dict(op=op, sizes=sweep(minbytes, maxbytes, args.stepfactor), minbytes=minbytes,
                maxbytes=maxbytes, stepfactor=args.stepfactor, iters=args.iters,
                warmup=args.warmup_iters, check=bool(args.check), datatype=datatype, redop=redop,
                device=device, seed=args.seed, corrupt_rank=corrupt_rank, rounds=args.rounds,
                notes=notes)


def build_config(args: argparse.Namespace, device: str, command: str = "", *,
                 fallback: str | None = None, note: str | None = None) -> BenchConfig:
    """``device``: the resolved one; ``fallback``: why --device auto took the cpu, if it did."""
    datatype = args.datatype or ops.spec(args.collective).default_datatype(device)
    fields = _fields(args, device, args.collective, args.redop, datatype, fallback, note)
    check_algo(args.algo, args.collective)
    if args.baseline is not None and args.algo != "all":
        raise BenchError("--baseline adds columns to the --algo all summary: pass --algo all")
    if args.plot_path is not None:
        plot.check_path(args.plot_path)
        check_output("--plot", args.plot_path)
        plot.require_matplotlib()
    options = shape_options(args, args.collective, datatype, fields)
    return BenchConfig(**fields, graph=args.cudagraph or 0, algo=args.algo, symmetric=args.symmetric,
                       json_path=args.json_path, plot_path=args.plot_path, command=command,
                       baseline=args.baseline, extension=getattr(args, "extension", None),
                       graph_communicators=args.graph_communicators, options=options)


def check_algo(algo: str, op: str) -> None:
    """--algo: one name, or a comma-separated list of columns for an op whose columns are paths
    (each is checked against the communicator later, by the runner)."""
    names = algo.split(",")
    variants = ops.spec(op).variants
    fixed = (f"--algo {algo}: {op}'s columns are fixed ({', '.join(variants)}) and every run measures all "
             f"of them; --algo names the one path they run")
    bad = [n for n in names if not ALGO_NAME.match(n)]
    if bad and bad[0] in variants:  # a column asked for by name ("peer-push:dispatch")
        raise BenchError(fixed)
    if bad:
        raise BenchError(f"--algo {bad[0]!r} is not a path name (auto, all, nccl, nccl-symm, ...)")
    if len(names) == 1:
        return
    if variants:
        raise BenchError(fixed)
    if "all" in names or len(set(names)) < len(names):
        raise BenchError(f"--algo {algo}: 'all' stands alone, and a list names each column once")


def build_tune_config(args: argparse.Namespace, device: str, command: str = "", *,
                      fallback: str | None = None, note: str | None = None) -> TuneConfig:
    fields = _fields(args, device, TUNE_OPS[0], "sum", args.datatype, fallback, note)
    if args.output is not None:
        check_output("-o/--output", args.output)
    # Graph replay is the default only where graphs exist: on the device actually chosen.
    graph = args.cudagraph if args.cudagraph is not None else (10 if device == "cuda" else 0)
    # tune ranks the paths auto can pick: neither auto itself nor the comparison columns.
    return TuneConfig(**fields, graph=graph, algo="all", with_auto=False, with_comparisons=False, symmetric=None,
                      json_path=None, command=command, output=args.output)


def build_baseline_config(args: argparse.Namespace, device: str, command: str = "", *,
                          fallback: str | None = None, note: str | None = None) -> BaselineConfig:
    if ops.spec(args.collective).nccl is None:
        raise BenchError(f"{BASELINE}: {args.collective} has no NCCL collective of its own; "
                         f"{BASELINE} times {', '.join(ops.BASELINE_NAMES)}")
    if device != "cuda":
        why = (f"--device auto chose cpu: {fallback}" if fallback else
               "--device cpu" if args.device == "cpu" else "no CUDA device is visible")
        raise BenchError(f"{BASELINE} times NCCL, which needs CUDA ({why})")
    fields = _fields(args, device, args.collective, args.redop, args.datatype, fallback, note)
    # algo and symmetric mean nothing here: each mode is a column with buffers of its own.
    return BaselineConfig(**fields, graph=args.cudagraph or 0, algo="nccl", symmetric=None,
                          json_path=args.json_path, command=command)


# First word -> (parser, config builder); any other first word is an OP of the main sweep.
Builder = Callable[..., BenchConfig]
SUBCOMMANDS: dict[str, tuple[Callable[[], argparse.ArgumentParser], Builder]] = {
    TUNE: (build_tune_parser, build_tune_config),
    BASELINE: (build_baseline_parser, build_baseline_config),
}


def _check_world(device: str, ngpus: int) -> None:
    if ngpus < 1:
        raise BenchError(f"-g/--ngpus must be at least 1 (got {ngpus})")
    if device == "cuda":
        devices.require_gpus(ngpus)
        return
    cores = os.cpu_count() or 1
    if ngpus > RANKS_PER_CORE * cores:
        raise BenchError(f"-g {ngpus}: this machine's {cores} CPU cores take at most {RANKS_PER_CORE * cores} "
                         f"ranks ({RANKS_PER_CORE} per core); spread more over machines with torchrun")
    if (note := oversubscribed(ngpus)) is not None:
        print(f"{PROG}: warning: {note}", file=sys.stderr)


def oversubscribed(local_ranks: int) -> str | None:
    """Where more CPU ranks than cores run here: they take turns on the cores, so the times
    include the waiting (correctness is unaffected). The run goes on, saying so."""
    cores = os.cpu_count() or 1
    if local_ranks <= cores:
        return None
    return (f"{local_ranks} ranks share {cores} CPU cores: they take turns, so the times include "
            "the waiting (the results are checked all the same)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch_local(world: int, argv: Sequence[str]) -> int:
    """Starts ``world`` ranks of this same command line and waits for them. If one fails, the
    others are stopped, since they would otherwise wait forever in a collective."""
    # This process holds the rendezvous store and every rank joins it as a client (torch's
    # agent-store mode, as under torchrun). A port found free and handed to rank 0 can be taken
    # before rank 0 listens on it: two benchmarks side by side on one host hit that
    # (DistNetworkError, "failed to listen", 2026-11-28).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = str(Path(__file__).resolve().parents[2])  # so children import this same symcomm
    path = os.pathsep.join(p for p in (root, settings.python_path()) if p)
    procs = []
    for rank in range(world):
        env = settings.child_environment({"PYTHONPATH": path, "TORCHELASTIC_USE_AGENT_STORE": "True",
                                          **_rank_env(rank, world, store.port)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "symcomm.bench", *argv], env=env,
            stdout=None if rank == 0 else subprocess.DEVNULL))
    stopped: set[int] = set()
    status: int | None = None
    try:
        while any(p.poll() is None for p in procs):
            if status is None:
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed:
                    status = failed[0]
                    for p in procs:
                        if p.poll() is None:
                            stopped.add(p.pid)
                            p.terminate()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        status = 130
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    del store  # after every rank has exited: none is left waiting on it
    if status is None:
        # Rank order, so rank 0's verdict wins when several ranks fail together.
        codes = [p.returncode for p in procs if p.pid not in stopped and p.returncode]
        status = codes[0] if codes else 0
    return 1 if status < 0 else status  # killed by a signal


def run_rank(cfg: BenchConfig, launched: settings.Launcher) -> int:
    """One rank: join the process group, build the communicator, run the sweep (or the
    baseline, which builds no Communicator)."""
    rank, local_rank = launched.rank, launched.local_rank
    cuda = cfg.device == "cuda"
    raw = isinstance(cfg, BaselineConfig)
    try:
        clean = _clean(cfg, launched.world_size)
        if cuda:
            if local_rank >= torch.cuda.device_count():
                raise BenchError(f"rank {rank}: LOCAL_RANK {local_rank}, but only "
                                 f"{torch.cuda.device_count()} GPUs are visible", every_rank=True)
            torch.cuda.set_device(local_rank)
        if cuda and not raw:
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            # The baseline's process holds no NCCL communicator but the one it times.
            dist.init_process_group("gloo")
        if raw:
            status = baseline.run(cfg)
        else:
            comm = _communicator(cfg, torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
            if isinstance(cfg, TuneConfig):
                status = tune.run(cfg, comm)
            else:
                status = runner.run(cfg, comm, clean)
            comm.close()
        dist.destroy_process_group()
        return status
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit status
        status = _report_failure(exc, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        if cuda and launched.world_size > 1:
            # Tearing down NCCL while a peer may still sit in a collective can hang; leave.
            os._exit(status)
        if dist.is_initialized():
            dist.destroy_process_group()  # gloo tears down locally; callers may init again
        return status


def _clean(cfg: BenchConfig, world: int) -> report.Clean | None:
    """The --baseline file, read and checked against this run; None without --baseline."""
    return baseline.load(cfg.baseline, cfg, world) if cfg.baseline is not None else None


def _communicator(cfg: BenchConfig, device: torch.device) -> symcomm.Communicator:
    """Communicator for the run. On cuda the runner reserves exactly the pool the sweep needs,
    so the constructor's default reservation is skipped where the core offers that knob."""
    params = inspect.signature(symcomm.Communicator).parameters
    kwargs = {}
    if device.type == "cuda":
        want = cfg.symmetric is not False
        if "symmetric" in params:
            kwargs["symmetric"] = want
        if want and "symmetric_capacity" in params:
            kwargs["symmetric_capacity"] = 0
    if cfg.graph_communicators:
        kwargs["graph_communicators"] = True
    if cfg.extension is not None:
        kwargs["paths"] = (*PATHS, *cfg.extension.paths)
        kwargs["operations"] = (*OPERATIONS, *cfg.extension.operations)
    return symcomm.Communicator(device=device, **kwargs)


def _report_failure(exc: Exception, rank: int) -> int:
    usage = isinstance(exc, BenchError) or _is_argument_error(exc)
    if usage:
        # Most usage problems hit every rank alike; one line is enough.
        if rank == 0 or getattr(exc, "every_rank", False):
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        debug = settings.bench_debug()
    except symcomm.ArgumentError as misspelt:  # said beside the failure, never in its place
        print(f"{PROG}: {misspelt}", file=sys.stderr)
        debug = False
    if debug:
        traceback.print_exc()
    print(f"{PROG}: error: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def _is_argument_error(exc: Exception) -> bool:
    return isinstance(exc, symcomm.ArgumentError)


def _register_extensions(argv: Sequence[str]) -> ops.Extension | None:
    """--with modules, registered before parsing so OP may name their operations."""
    modules = [a.split("=", 1)[1] for a in argv if a.startswith("--with=")]
    modules += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--with"]
    if not modules:
        return None
    try:
        return ops.extend(modules)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launched = settings.launcher()
    try:
        command = shlex.join([PROG, *argv])
        sub = SUBCOMMANDS.get(argv[0]) if argv else None
        parser, build = sub or (build_parser, build_config)
        extension = None if sub else _register_extensions(argv)
        args = parser().parse_args(argv[1:] if sub else argv)
        args.extension = extension
        # The ranks this machine runs: what the launcher started here, or what -g will start.
        if launched is not None:
            local_ranks = settings.local_world_size()
        else:
            local_ranks = args.ngpus if args.ngpus is not None else 1
        choice = devices.resolve(args.device, local_ranks)
        cfg = build(args, choice.device, command, fallback=choice.fallback, note=choice.note)
        if choice.device == "cpu" and (crowded := oversubscribed(local_ranks or 1)) is not None:
            cfg.notes.append(f"Oversubscribed: {crowded}")
        if launched is not None:
            if args.ngpus is not None and args.ngpus != launched.world_size:
                raise BenchError(f"-g {args.ngpus} conflicts with WORLD_SIZE={launched.world_size} "
                                 f"set by the launcher")
            return run_rank(cfg, launched)
        world = args.ngpus if args.ngpus is not None else 1
        _check_world(choice.device, world)
        # Read here too, before any rank starts, so that a file for another run is one usage
        # error rather than one per rank.
        _clean(cfg, world)
        if world == 1:
            settings.export(_rank_env(0, 1, _free_port()))
            return run_rank(cfg, settings.launcher())
        return launch_local(world, argv)
    except BenchError as exc:
        if launched is None or launched.rank == 0:  # under torchrun every rank would say the same
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
