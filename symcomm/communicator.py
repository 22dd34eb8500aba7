"""Communicator: opens the paths, keeps the order, and runs every operation the same way:
validate once (the operation's build) -> choose a path (dispatch.choose) -> check mode -> run."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import check_mode, registry, settings, validate
from .backends import PATHS
from .base import NCCL_SYMM, Call, Path, PathFactory, Setup, capturing
from .bounded import BOUNDED_WAITS, UNBOUNDED_WAITS
from .capture import CaptureBracket
from .dispatch import TABLE_KEYS, Choice, DispatchTable, Router, load_table
from .errors import ArgumentError, CommClosedError, CommTimeoutError, PeerMismatchError, SymmetricMemoryError
from .lifecycle import close_paths, open_paths
from .methods import OperationMethods
from .operations import ALL_REDUCE, OPERATIONS, Operation
from .operations.autograd import records
from .backends.nccl import PLAIN_MAX_CTAS
from .peer.context import DEFAULT_STAGING_BYTES
from .peers import Peers
from .pool import SymmetricPool

# Enough for the activations of a typical TP layer at serving batch sizes; grow it with
# reserve_symmetric() or the constructor argument.
DEFAULT_SYMMETRIC_CAPACITY = 256 << 20
_is_compiling = torch.compiler.is_compiling
_SETUP = "setup"  # the kind of every constructor vote (peers.Peers frames each exchange with one)
_COLLECTIVE = ALL_REDUCE.name  # algorithms() lists the collectives' paths, which all list this op


class Communicator(OperationMethods):
    """Collectives over one torch.distributed group, each on the fastest correct path.

    Construction is collective over ``group`` (default: the world): every rank builds its
    Communicator in the same order with the same arguments. ``device`` follows the group
    (docs/architecture.md, "The device rule") unless given. ``symmetric_capacity`` bytes are
    reserved and registered as NCCL symmetric windows up front; ``reserve_symmetric`` adds
    more, also collectively. ``custom_ar_capacity`` sizes the staging and scratch buffers of
    symcomm's own all-reduce kernels, and so bounds two-shot and every staged input (a one-shot
    all-reduce of a symmetric-pool input has no limit); 0 turns off every peer-memory path, as
    SYMCOMM_DISABLE_CUSTOM_AR=1 does: the all-reduce kernels, custom-push, fused-flagfree,
    fused-push and peer-push. ``check`` overrides SYMCOMM_CHECK, ``timeout_s`` SYMCOMM_TIMEOUT_S (default: the
    group's own timeout). ``graph_communicators`` makes the first graph_capture() open a second NCCL
    communicator per NCCL path for captured launches (docs/memory.md: hundreds of MiB, for a
    graph-mixing cost not yet shown to matter). ``nccl_max_ctas`` caps the plain NCCL
    communicator's channels (each holds device memory). ``paths`` and ``operations`` replace
    the shipped lists (symcomm.backends.PATHS, symcomm.operations.OPERATIONS), for extensions
    and tests: ``run()`` runs any operation.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | int | None = None,
                 *, symmetric: bool = True, symmetric_capacity: int = DEFAULT_SYMMETRIC_CAPACITY,
                 check: bool | None = None, timeout_s: float | None = None,
                 custom_ar_capacity: int = DEFAULT_STAGING_BYTES, graph_communicators: bool = False,
                 nccl_max_ctas: int = PLAIN_MAX_CTAS, paths: Sequence[PathFactory] | None = None,
                 operations: Sequence[Operation] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError("torch.distributed is not initialized: call init_process_group first")
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ArgumentError("this process is not a member of the given group")
        self.group: dist.ProcessGroup | None = group
        self.device: torch.device | None = None  # until validated: close() then bounds no device
        self.closed = False
        self.key: int | None = None
        self.operations: dict[str, Operation] = {op.name: op for op in (OPERATIONS if operations is None
                                                                          else operations)}
        self._opened: list[Path] = []  # every path tried, in order: closed in reverse
        self._reasons: list[str | None] = []  # each one's reason to stay off, or None
        self._live: list[Path] = []  # the open ones
        self.router: Router | None = None
        self._pool: SymmetricPool | None = None
        self._find = None
        self._alarm = None
        # Local checks first. A rank that fails one still joins the first vote (as a refusal), so
        # its peers raise with its reason instead of waiting for it in the next step. The settings
        # are among those checks (a bad SYMCOMM_TIMEOUT_S on one rank is voted like a bad
        # argument), so until they pass, the bound is the group's own timeout: the documented
        # default, and a number that cannot be wrong.
        self.timeout_s, self.timeout_source = validate.group_bound_s(group), "process group"
        self.peers = Peers(group, self.timeout_s)
        try:
            options = {"symmetric": validate.flag("symmetric", symmetric),
                       "symmetric_capacity": validate.capacity("symmetric_capacity", symmetric_capacity, 1),
                       "custom_ar_capacity": validate.capacity("custom_ar_capacity", custom_ar_capacity, 16),
                       "graph_communicators": validate.flag("graph_communicators", graph_communicators),
                       "nccl_max_ctas": validate.count("nccl_max_ctas", nccl_max_ctas, 1, 64)}
            self.timeout_s, self.timeout_source = validate.timeout(timeout_s, group)
            self.peers.timeout_s = self.timeout_s
            self.check = settings.check_mode() if check is None else validate.flag("check", check)
            self.device = validate.resolve_device(device, group)
            # Before any NCCL setup, so a bad tuning file fails without leaving communicators behind.
            table = load_table(self.peers.world_size, self.device, keys=(*TABLE_KEYS, *self.operations))
            self.router = Router(table, self.operations, self.peers.rank)
            # The first vote: every rank is here, and agrees on what must be equal everywhere.
            self.peers.agree(_SETUP, "Communicator(): every rank must pass the same arguments and settings", {
                "check mode": int(self.check), **{name: int(value) for name, value in options.items()},
                f"the dispatch table (a digest; this rank's: {table.source})": table.digest()})
            setup = Setup(self.peers, self.device, self.timeout_s, options, dispatcher=self.router)
            open_paths(PATHS if paths is None else paths, setup, self._opened, self._reasons)
        except BaseException as exc:
            if not isinstance(exc, (PeerMismatchError, CommTimeoutError)):
                # A failure of this rank alone: peers waiting in the next vote learn why from it.
                self.peers.refuse(_SETUP, f"{type(exc).__name__}: {exc}")
            self.close()  # release what the paths opened so far
            raise
        self.rank: int = self.peers.rank
        self.world_size: int = self.peers.world_size
        self._capture = CaptureBracket(self.device)
        for path, reason in zip(self._opened, self._reasons):
            self.router.add(path, reason)
        self._live = [path for path, reason in zip(self._opened, self._reasons) if reason is None]
        symm = self.router.paths_of(_COLLECTIVE).get(NCCL_SYMM)
        self._pool = getattr(symm, "pool", None)
        self._find = None if self._pool is None else self._pool.index.find
        # every peer-memory path shares its context's alarm: the first is all of them
        self._alarm = next((path.alarm for path in self._live if path.alarm is not None), None)
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
        # Before anything touches the device: measuring the region synchronizes, which invalidates a
        # capture, and torch then aborts the process at the next memory pool's teardown.
        if capturing(self.device):
            raise SymmetricMemoryError("reserve_symmetric() is not allowed during CUDA-graph capture: reserve "
                                       "before capturing")
        if self._pool is None:
            raise SymmetricMemoryError(self.router.off_of(_COLLECTIVE).get(NCCL_SYMM, "symmetric memory is off"))
        region = self.router.paths_of(_COLLECTIVE)[NCCL_SYMM].reserve(nbytes)
        for path in self._live:
            path.add_region(region)

    # --------------------------------------------------------------- dispatch
    @property
    def table(self) -> DispatchTable:
        """The dispatch table auto chooses by (capabilities()["tuning_table"] names its source)."""
        return self.router.table

    @table.setter
    def table(self, table: DispatchTable) -> None:
        """Replace it on a live communicator (experiments; every rank must set the same table)."""
        self.router.table = table

    def algorithms(self, op: str = _COLLECTIVE) -> list[str]:
        """The paths this communicator can use for ``op``'s ``algo=`` (by default the collectives')."""
        return list(self.router.paths_of(self._operation(op).name))

    def path(self, name: str) -> Path:
        """The open collective path called ``name`` (for benchmarks that drive NCCL directly)."""
        paths = self.router.paths_of(_COLLECTIVE)
        if name not in paths:
            raise ArgumentError(f"path {name!r} is not open here: "
                                f"{self.router.off_of(_COLLECTIVE).get(name, 'unknown path')}")
        return paths[name]

    def _operation(self, op: object) -> Operation:
        operation = self.operations.get(op) if isinstance(op, str) else None
        if operation is None:
            raise ArgumentError(f"op must be one of {', '.join(self.operations)}; got {op!r}")
        return operation

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

    def select(self, op: str, /, *args: Any, algo: str = "auto", **kwargs: Any) -> Choice:
        """The path ``op`` would take for these arguments (the op's own, as its method takes them),
        and why every other path was passed over. Local: nothing is communicated."""
        self._require_open()
        operation = self._operation(op)
        call = operation.build(self, *args, **kwargs)
        path, choice = self.router.choose(operation, call, algo, explain=True)
        return operation.explain(choice, operation.inner_choice(call, path, self.router))

    def _run(self, operation: Operation, args: tuple, algo: str, kwargs: dict[str, Any] | None = None) -> Call:
        """Every operation's one way: validate once -> choose -> check mode -> run."""
        try:
            if self.closed:  # inline: this is every eager call's path, a frame costs ~0.1 us
                raise CommClosedError("this Communicator is closed")
            if self.peers.broken is not None or (self._alarm is not None and self._alarm.word.value):
                self.check_health()
            call = operation.build(self, *args, **kwargs) if kwargs else operation.build(self, *args)
            path = self.router.choose(operation, call, algo)[0]
        except Exception as exc:
            self.refused(exc)
            raise
        if self.check and self.checking():
            self._verify(operation, call, path)
        try:
            path.run(call) if call.nbytes or not operation.skips_empty else path.skip(call)
        except PeerMismatchError as exc:
            raise exc.within(operation.name) from None
        return call

    def checking(self) -> bool:
        # Check mode's exchange synchronises with the host: never in a capture, nor once closed.
        return self.check and not self.closed and not (self.peers.device.type == "cuda" and capturing())

    def _verify(self, operation: Operation, call: Call, path: Path) -> None:
        compared = path.compared_offsets(call)
        locate = self._pool.locate if self._pool is not None and compared else None
        names = self.router.names_of(operation.name)
        values, labels = operation.check_signature(call, names.index(path.name), self.world_size, locate, compared)
        check_mode.compare(self.peers, operation.name, values, labels, names, operation.check_decode,
                           operation.window_rule)
        operation.check_more(call, path, self.peers)

    def refused(self, error: BaseException) -> None:
        """This rank's call failed before communicating (any exception). It joins the exchange its
        peers wait in (check mode's, else a path's comparison of calls: Path.refuse), so they
        raise with its reason instead of waiting or pairing their call with its next one. The
        caller raises ``error`` after; a peer that never came is for check_health to report."""
        reason = f"{type(error).__name__}: {error}"
        if self.checking():
            check_mode.refuse(self.peers, reason)
        elif not (self.closed or isinstance(error, CommTimeoutError) or self.peers.broken is not None):
            with contextlib.suppress(CommTimeoutError):
                for path in self._live:
                    path.refuse(reason)

    # ------------------------------------------------------------- operations
    def run(self, op: str, /, *args: Any, algo: str = "auto", **kwargs: Any) -> Any:
        """Run any operation of this communicator by name (``operations=`` adds one), the way its
        method would: ``comm.run("all_reduce", x)`` is ``comm.all_reduce(x)``."""
        try:
            operation = self._operation(op)
        except ArgumentError as exc:
            self.refused(exc)
            raise
        if _is_compiling():
            return operation.compiled(self, *args, algo=algo, **kwargs)
        if records(*args, *kwargs.values()):
            return self._recorded(operation, args, algo, kwargs)
        return operation.result(self._run(operation, args, algo, kwargs))

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
        self._require_open()
        return self._capture.session(self._live)

    # ------------------------------------------------------------ introspection
    def capabilities(self) -> dict[str, Any]:
        """What is enabled, and for everything disabled, why."""
        def listing(op: str) -> dict[str, Any]:
            off = self.router.off_of(op)
            return {name: {"enabled": False, "reason": off[name]} if name in off else {"enabled": True}
                    for name in self.router.names_of(op)}
        caps: dict[str, Any] = {
            "device": str(self.device), "rank": self.rank, "world_size": self.world_size,
            "paths": listing(_COLLECTIVE),
            "operations": {op: listing(op) for op in self.operations},
            "nccl": None, "custom_all_reduce": None,
            "symmetric_memory": {"enabled": False, "reason": self.router.off_of(_COLLECTIVE).get(NCCL_SYMM),
                                 "capacity": 0, "bytes_in_use": 0, "regions": 0},
            "tuning_table": self.table.source, "check_mode": self.check,
            "timeout": {"seconds": self.timeout_s, "source": self.timeout_source, "bounds": list(BOUNDED_WAITS),
                        "does_not_bound": list(UNBOUNDED_WAITS)},
        }
        components: dict[str, int] = {}
        for path in self._opened:
            info = path.info()
            components.update(info.pop("device_bytes", {}))
            caps.update(info)
        total, pool = sum(components.values()), caps["symmetric_memory"]["capacity"]
        caps["memory"] = {"components": components, "total_bytes": total, "beyond_pool_bytes": total - pool,
                          "note": "device bytes each took when it was created (cudaMemGetInfo); the first NCCL "
                                  "communicator of a process includes NCCL's one-time load, and NCCL adds "
                                  "connection buffers at first use past world 1 (docs/memory.md)"}
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
        opened, self._opened, self._live, self._find, self._pool = self._opened, [], [], None, None
        if self.router is not None:
            self.router.clear()
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
        state = "closed" if self.closed else ",".join(self.router.paths_of(_COLLECTIVE))
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, paths={state})"
