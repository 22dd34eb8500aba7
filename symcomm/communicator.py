"""Communicator: opens the paths, keeps the order, and runs validate -> choose -> run per call."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import capture, checks, fp4_gather, fused_norm, ops, registry, settings, validate
from .backends import PATHS
from .backends.custom import DEFAULT_STAGING_BYTES
from .base import NCCL_SYMM, Call, Path, PathFactory, Setup
from .bounded import BOUNDED_WAITS, UNBOUNDED_WAITS
from .lifecycle import close_paths, open_paths
from .dispatch import Choice, DispatchTable, choose, load_table
from .errors import (ArgumentError, CommClosedError, CommTimeoutError, PeerMismatchError, SymcommError,
                     SymmetricMemoryError)
from .fp4_gather import Fp4Gathered, all_gatherv_fp4 as _all_gatherv_fp4
from .peers import Peers
from .pool import SymmetricPool

# Enough for the activations of a typical TP layer at serving batch sizes; grow it with
# reserve_symmetric() or the constructor argument.
DEFAULT_SYMMETRIC_CAPACITY = 256 << 20
_is_compiling = torch.compiler.is_compiling
_capturing = torch.cuda.is_current_stream_capturing
_SETUP = "setup"  # the kind of every constructor vote (peers.Peers frames each exchange with one)


class Communicator:
    """Collectives over one torch.distributed group, each on the fastest correct path.

    Construction is collective over ``group`` (default: the world): every rank builds its
    Communicator in the same order with the same arguments. ``device`` follows the group
    (docs/architecture.md, "The device rule") unless given. ``symmetric_capacity`` bytes are reserved and
    registered as NCCL symmetric windows up front; ``reserve_symmetric`` adds more, also
    collectively. ``custom_ar_capacity`` bounds the messages symcomm's own all-reduce kernels
    take (0 turns them off, as does SYMCOMM_DISABLE_CUSTOM_AR=1). ``check`` overrides
    SYMCOMM_CHECK, ``timeout_s`` SYMCOMM_TIMEOUT_S (default: the group's own timeout). ``paths`` replaces the shipped list of
    paths (symcomm.backends.PATHS), for extensions and tests.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | int | None = None,
                 *, symmetric: bool = True, symmetric_capacity: int = DEFAULT_SYMMETRIC_CAPACITY,
                 check: bool | None = None, timeout_s: float | None = None,
                 custom_ar_capacity: int = DEFAULT_STAGING_BYTES,
                 paths: Sequence[PathFactory] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError("torch.distributed is not initialized: call init_process_group first")
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ArgumentError("this process is not a member of the given group")
        self.group: dist.ProcessGroup | None = group
        self.device: torch.device | None = None  # until validated: close() then bounds no device
        self.closed = False
        self.key: int | None = None
        self._opened: list[Path] = []  # every path tried, in order: closed in reverse
        self._paths: dict[str, Path] = {}  # the open ones
        self._off: dict[str, str] = {}  # the others, with the reason
        self._pool: SymmetricPool | None = None
        self._find = None
        self._capturing = False
        self._alarm = None
        # Local checks first. A rank that fails one still joins the first vote (as a refusal), so
        # its peers raise with its reason instead of waiting for it in the next step.
        self.peers = Peers(group, validate.timeout(None, group)[0])
        self.timeout_s = self.peers.timeout_s
        try:
            options = {"symmetric": bool(symmetric),
                       "symmetric_capacity": validate.capacity("symmetric_capacity", symmetric_capacity, 1),
                       "custom_ar_capacity": validate.capacity("custom_ar_capacity", custom_ar_capacity, 16)}
            self.timeout_s, self.timeout_source = validate.timeout(timeout_s, group)
            self.peers.timeout_s = self.timeout_s
            self.check = settings.check_mode() if check is None else bool(check)
            self.device = validate.resolve_device(device, group)
            # Before any NCCL setup, so a bad tuning file fails without leaving communicators behind.
            self.table: DispatchTable = load_table(self.peers.world_size, self.device)
            # The first vote: every rank is here, and agrees on what must be equal everywhere.
            self.peers.agree(_SETUP, "Communicator(): every rank must pass the same arguments and settings",
                             {"check mode": int(self.check), "symmetric": int(options["symmetric"]),
                              "symmetric_capacity": options["symmetric_capacity"],
                              "custom_ar_capacity": options["custom_ar_capacity"]})
            setup = Setup(self.peers, self.device, self.timeout_s, options)
            setup.opened, setup.off = self._paths, self._off
            open_paths(PATHS if paths is None else paths, setup, self._opened)
        except BaseException as exc:
            if not isinstance(exc, (PeerMismatchError, CommTimeoutError)):
                # A failure of this rank alone: peers waiting in the next vote learn why from it.
                self.peers.refuse(_SETUP, f"{type(exc).__name__}: {exc}")
            self.close()  # release what the paths opened so far
            raise
        self.rank: int = self.peers.rank
        self.world_size: int = self.peers.world_size
        self._names = [path.name for path in self._opened]  # check mode's path codes
        self._pool = getattr(self._paths.get(NCCL_SYMM), "pool", None)
        self._find = None if self._pool is None else self._pool.index.find
        self._alarm = next((path.alarm for path in self._paths.values() if path.alarm is not None), None)
        self.key = registry.register(self)

    # ------------------------------------------------------------ symmetric memory
    @property
    def symmetric_pool(self) -> SymmetricPool | None:
        """The pool behind use_symmetric_memory, or None where symmetric memory is off."""
        return self._pool

    def is_symmetric(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in a registered symmetric window. O(1): one dict lookup."""
        find = self._find
        return find is not None and find(t.data_ptr()) >= 0

    def reserve_symmetric(self, nbytes: int) -> None:
        """Collective: add ``nbytes`` (rounded up to 2 MiB) of registered symmetric memory.

        Every rank must call it with the same ``nbytes`` at the same point; ranks that disagree
        all raise PeerMismatchError. Not allowed during CUDA-graph capture.
        """
        self._require_open()
        if self._pool is None:
            raise SymmetricMemoryError(self._off.get(NCCL_SYMM, "symmetric memory is off"))
        region = self._pool.reserve(nbytes)
        for path in self._paths.values():
            path.add_region(region)

    # --------------------------------------------------------------- dispatch
    def algorithms(self) -> list[str]:
        """The paths this communicator can use, for ``algo=``."""
        return list(self._paths)

    def path(self, name: str) -> Path:
        """The open path called ``name`` (for benchmarks that drive NCCL directly)."""
        if name not in self._paths:
            raise ArgumentError(f"path {name!r} is not open here: {self._off.get(name, 'unknown path')}")
        return self._paths[name]

    def _require_open(self) -> None:
        if self.closed:
            raise CommClosedError("this Communicator is closed")
        self.check_health()

    def check_health(self) -> None:
        """Raise CommTimeoutError if symcomm's kernels gave up waiting for a peer, or one of its
        host-side waits on peers ran out. Every call checks this first (a host read, no
        synchronisation); graph replays cannot, so check after replaying where a rank may be
        late. Once raised, it raises for good."""
        if self.closed:
            return
        reason = self.peers.broken or (None if self._alarm is None else self._alarm.reason())
        if reason is not None:
            raise CommTimeoutError(reason)

    def select(self, op: str, x: torch.Tensor | Sequence[torch.Tensor], out: Any = None,
               sizes: Sequence[int] | None = None, reduce_op: str = "sum", **norm_args: Any) -> Choice:
        """The path ``algo='auto'`` would take for this call, and why the others were passed over."""
        self._require_open()
        if op == fused_norm.OP:
            return fused_norm.select(self, x, out=out, **norm_args)
        if op == fp4_gather.OP:
            return fp4_gather.select(self, x, sizes, out=out, **norm_args)
        if op not in validate.BUILDERS:
            known = (*validate.BUILDERS, fp4_gather.OP, fused_norm.OP)
            raise ArgumentError(f"op must be one of {', '.join(known)}; got {op!r}")
        call = validate.BUILDERS[op](self, x, out, sizes, reduce_op)
        return choose(self.table, self._paths, self._off, call, explain=True)[1]

    def _launch(self, call: Call, algo: str) -> None:
        try:
            if self.closed:  # inline: this is every eager call's path, a frame costs ~0.1 us
                raise CommClosedError("this Communicator is closed")
            if self.peers.broken is not None or (self._alarm is not None and self._alarm.word.value):
                self.check_health()
            path = choose(self.table, self._paths, self._off, call, algo)[0]
        except Exception as exc:
            self.refused(exc)
            raise
        if self.check:
            self._verify(call, path)
        if call.nbytes:
            path.run(call)

    def checking(self) -> bool:
        # Check mode's exchange synchronises with the host: never inside a capture, nor once
        # closed (every rank then raises CommClosedError on its own; close is collective).
        return self.check and not self.closed and not (self.peers.device.type == "cuda" and _capturing())

    def _verify(self, call: Call, path: Path) -> None:
        if self.checking():
            locate = self._pool.locate if self._pool is not None and path.needs_equal_offsets else None
            checks.verify(self.peers, call, path.name, self._names, locate, path.equal_offsets)

    def refused(self, error: BaseException) -> None:
        """Check mode: this rank's call failed before communicating (any exception: a broken
        rule, an allocation that failed). It still joins the exchange its peers wait in, so
        they raise too, with its reason, instead of waiting for it."""
        if self.checking():
            checks.refuse(self.peers, f"{type(error).__name__}: {error}")

    def _run(self, build, *args: Any, algo: str) -> Call:
        try:
            call = build(*args)
        except Exception as exc:
            self.refused(exc)
            raise
        self._launch(call, algo)
        return call

    # ------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                   algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over all ranks into ``out`` (a new tensor, or ``x`` itself for in place)."""
        if _is_compiling():
            return ops.compiled_all_reduce(self, x, out, op, algo)
        return self._run(validate.all_reduce, x, out, op, self.device, algo=algo).outputs[0]

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, in rank order."""
        if _is_compiling():
            return ops.compiled_all_gather(self, x, out, algo)
        return self._run(validate.all_gather, x, out, self.rank, self.world_size, self.device,
                         algo=algo).outputs[0]

    def all_gatherv(self, tensors: torch.Tensor | Sequence[torch.Tensor], sizes: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                    algo: str = "auto") -> torch.Tensor | list[torch.Tensor]:
        """Gather rows with per-rank counts ``sizes`` (zeros allowed); several tensors share one
        NCCL group. Returns a tensor for a tensor, a list for a list."""
        if _is_compiling():
            return ops.compiled_all_gatherv(self, tensors, sizes, out, algo)
        call = self._run(validate.all_gatherv, tensors, sizes, out, self.rank, self.world_size, self.device,
                         algo=algo)
        return call.outputs[0] if isinstance(tensors, torch.Tensor) else list(call.outputs)

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                       algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over ranks; rank r keeps rows [r*n, (r+1)*n) with n = x.shape[0] / world."""
        if _is_compiling():
            return ops.compiled_reduce_scatter(self, x, out, op, algo)
        return self._run(validate.reduce_scatter, x, out, op, self.rank, self.world_size, self.device,
                         algo=algo).outputs[0]

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None,
                        op: str = "sum", algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` (sum(sizes) rows) over ranks; rank r keeps its ``sizes[r]`` rows."""
        if _is_compiling():
            return ops.compiled_reduce_scatterv(self, x, sizes, out, op, algo)
        return self._run(validate.reduce_scatterv, x, sizes, out, op, self.rank, self.world_size, self.device,
                         algo=algo).outputs[0]

    def all_gatherv_fp4(self, x: torch.Tensor, sizes: Sequence[int], global_scale: float | torch.Tensor,
                        extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                        swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
        """NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] and gather every rank's payload,
        scales and ``extra`` tensors (dim 0 = this rank's rows), fused where it can: fp4_gather.py.

        ``global_scale`` must be the same on every rank (``symcomm.fp4.global_scale_for(x, comm)``).
        ``dequantize=True`` adds the decoded rows; ``swizzle=True`` returns the scales in the 128x4
        GEMM layout; ``out`` (an Fp4Gathered) supplies preallocated gathered buffers.
        """
        if _is_compiling():
            return ops.compiled_all_gatherv_fp4(self, x, sizes, global_scale, extra, dequantize, algo, swizzle, out)
        return _all_gatherv_fp4(self, x, sizes, global_scale, extra, dequantize, algo, swizzle=swizzle, out=out)

    def all_reduce_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                           eps: float = 1e-6, out: Any = None, residual_out: torch.Tensor | None = None,
                           quant: str | None = None, scale: float | torch.Tensor | None = None,
                           swizzle: bool = False, algo: str = "auto") -> fused_norm.NormedResult:
        """h = all_reduce(x) + residual, y = rmsnorm(h) * weight (+ FP8/NVFP4): see fused_norm.all_reduce_rmsnorm."""
        if _is_compiling():
            return ops.compiled_all_reduce_rmsnorm(self, x, weight, residual, eps, out, residual_out, quant, scale,
                                                   swizzle, algo)
        return fused_norm.all_reduce_rmsnorm(self, x, weight, residual=residual, eps=eps, out=out, algo=algo,
                                             residual_out=residual_out, quant=quant, scale=scale, swizzle=swizzle)

    # ------------------------------------------------------------ CUDA graphs
    def graph_capture(self) -> contextlib.AbstractContextManager[None]:
        """Collective: wrap ``torch.cuda.graph(...)`` in this so that captured custom all-reduces
        read their inputs in place at replay instead of copying them to the staging buffer.

            with comm.graph_capture(), torch.cuda.graph(g):
                y = comm.all_reduce(x)

        The first one opens the NCCL paths' graph communicators. On exit every path registers
        what it recorded, with its peers; all ranks must have captured the same calls
        (PeerMismatchError otherwise, on every rank). Capturing without it is correct too, with
        one copy per custom all-reduce and NCCL's graph-mixing cost. Capture every symcomm call
        of one graph on one stream, and replay graphs on the stream of the eager calls (or order
        them yourself): a rank's custom all-reduces must run in the order they were issued.
        """
        return capture.session(self, list(self._paths.values()))

    # ------------------------------------------------------------ introspection
    def capabilities(self) -> dict[str, Any]:
        """What is enabled, and for everything disabled, why."""
        caps: dict[str, Any] = {
            "device": str(self.device), "rank": self.rank, "world_size": self.world_size,
            "paths": {path.name: ({"enabled": True} if path.name in self._paths
                                  else {"enabled": False, "reason": self._off[path.name]}) for path in self._opened},
            "nccl": None, "custom_all_reduce": None,
            "symmetric_memory": {"enabled": False, "reason": self._off.get(NCCL_SYMM),
                                 "capacity": 0, "bytes_in_use": 0, "regions": 0},
            "tuning_table": self.table.source, "check_mode": self.check,
            "timeout": {"seconds": self.timeout_s, "source": self.timeout_source, "bounds": list(BOUNDED_WAITS),
                        "does_not_bound": list(UNBOUNDED_WAITS)},
        }
        for path in self._opened:
            caps.update(path.info())
        return caps

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Close every path in reverse order (deregistering windows, freeing the pool, destroying
        the NCCL communicators) and let go of the process group. Idempotent.

        Collective, like construction. Pool memory that live tensors still use stays mapped until
        the process exits (with a ResourceWarning). Bounded by the timeout; on timeout the paths
        are aborted instead (NCCL communicators aborted, peer mappings left alone). A graph that
        captured this communicator's calls must not be replayed after it.
        """
        if self.closed:
            return
        self.closed = True
        if self.key is not None:
            registry.unregister(self.key)
        opened, self._opened, self._paths, self._find, self._pool = self._opened, [], {}, None, None
        try:
            close_paths(opened, self.timeout_s, self.device)
        finally:
            self.peers.close()
            self.group = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ",".join(self._paths)
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, paths={state})"
