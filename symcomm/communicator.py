"""Communicator: owns the NCCL communicators, the symmetric pool and the path table."""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _native, _nccl, checks, ops, registry, validate
from .backends import custom
from .backends.base import Backend, Call
from .backends.nccl import NcclBackend
from .backends.torch_dist import TorchDistBackend
from .dispatch import PLAIN_ROW, Choice, DispatchTable, load_table
from .errors import (ArgumentError, CommClosedError, CommTimeoutError, PeerMismatchError, SymcommError,
                     SymmetricMemoryError)
from .fp4_gather import Fp4Gathered, all_gatherv_fp4 as _all_gatherv_fp4
from .pool import SymmetricPool

# Enough for the activations of a typical TP layer at serving batch sizes; grow it with
# reserve_symmetric() or the constructor argument.
DEFAULT_SYMMETRIC_CAPACITY = 256 << 20
# One bound for every wait on peers: NCCL init/teardown and the custom kernels' barriers.
# Generous against a healthy peer (NCCL init takes seconds), short enough that a dead one is
# reported while someone is still watching.
DEFAULT_TIMEOUT_S = 30.0
_is_compiling = torch.compiler.is_compiling


def _env_timeout() -> float:
    return float(os.environ.get("SYMCOMM_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _bounded(what: str, fn: Callable[[], Any], timeout_s: float, device: torch.device | None) -> Any:
    """Run a blocking native call in a helper thread and give up after ``timeout_s``.

    NCCL init and destroy block until every peer arrives; a dead peer would hang the caller
    forever. The helper thread is a daemon, so a timed-out call cannot keep the process alive.
    """
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the CUDA device is per thread
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name=f"symcomm-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CommTimeoutError(f"{what} did not finish within {timeout_s:.0f} s "
                               f"(a peer is missing or stuck; SYMCOMM_TIMEOUT_S sets the bound)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"device={device} requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ArgumentError(f"device must be cpu or cuda, got {device}")
    return device


class Communicator:
    """Collectives over one torch.distributed group, each on the fastest correct path.

    Construction is collective over ``group``: every rank builds its Communicator in the same
    order with the same arguments. ``symmetric_capacity`` bytes are reserved and registered
    as NCCL symmetric windows up front; ``reserve_symmetric`` adds more, also collectively.
    ``custom_ar_capacity`` bounds the messages symcomm's own all-reduce kernels take (0 turns
    them off, as does SYMCOMM_DISABLE_CUSTOM_AR=1).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | int | None = None,
                 *, symmetric: bool = True, symmetric_capacity: int = DEFAULT_SYMMETRIC_CAPACITY,
                 check: bool | None = None, timeout_s: float | None = None,
                 custom_ar_capacity: int = custom.DEFAULT_STAGING_BYTES) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError("torch.distributed is not initialized: call init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ArgumentError("this process is not a member of the given group")
        self.device = _resolve_device(device)
        self.timeout_s = float(timeout_s) if timeout_s is not None else _env_timeout()
        self.check = (os.environ.get("SYMCOMM_CHECK", "0") == "1") if check is None else check
        self.closed = False
        self.nccl: _nccl.Library | None = None
        self._nccl_comms: list[int] = []
        self._pool: SymmetricPool | None = None
        self._find: Callable[[int], int] | None = None
        self._disabled: dict[str, str] = {}
        self._backends: dict[str, Backend] = {}
        self._custom: custom.CustomAllReduce | None = None
        self.key: int | None = None
        # Before any NCCL setup, so a bad tuning file fails without leaving communicators behind.
        self.table: DispatchTable = load_table(self.world_size, self.device)
        if self.device.type == "cuda":
            try:
                self._init_nccl(symmetric, symmetric_capacity)
                if self.nccl is not None:  # agreed on every rank by _init_nccl's vote
                    self._init_custom(custom_ar_capacity)
                else:
                    for name in custom.ALGO_CODES:
                        # NCCL is their fallback and their teardown barrier.
                        self._disabled[name] = "custom all-reduce: needs NCCL, which is unavailable"
            except BaseException:
                self.close()  # release the NCCL communicators and memory created so far
                raise
        else:
            for name in ("nccl", "nccl-symm", *custom.ALGO_CODES):
                self._disabled[name] = "the communicator's device is the CPU"
        self._backends["torch"] = TorchDistBackend(self.group, self.rank, self.world_size)
        self.key = registry.register(self)

    # ----------------------------------------------------------------- setup
    def _group_device(self) -> torch.device:
        backend = str(dist.get_backend(self.group))
        return torch.device("cpu") if "gloo" in backend else self.device

    def _exchange_ints(self, values: list[int]) -> list[list[int]]:
        """All-gather a short int vector over the torch group (setup and check mode only)."""
        local = torch.tensor(values, dtype=torch.int64, device=self._group_device())
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        return [row.tolist() for row in gathered]

    def _symmetric_blocker(self, nccl: _nccl.Library) -> str | None:
        if not nccl.has_windows:
            return (f"NCCL {nccl.version_string} has no symmetric windows "
                    f"(needs >= {'.'.join(map(str, _nccl.SYMMETRIC_MIN_VERSION))})")
        try:
            _native.load()
        except OSError as exc:
            return str(exc)
        return None

    def _init_nccl(self, symmetric: bool, capacity: int) -> None:
        # Every rank must reach the same decision before any NCCL collective setup, or the
        # ranks that go ahead would wait forever for those that did not: vote first.
        # Levels: 0 = no NCCL, 1 = plain NCCL, 2 = plain and symmetric.
        try:
            nccl: _nccl.Library | None = _nccl.load()
            blocker = "disabled by the caller (symmetric=False)" if not symmetric else self._symmetric_blocker(nccl)
            level, reason = (2, None) if blocker is None else (1, blocker)
        except _nccl.NcclUnavailableError as exc:
            nccl, level, reason = None, 0, str(exc)
        agreed = min(v for v, in self._exchange_ints([level]))
        if agreed < level:
            reason = "unavailable on another rank"
        if agreed == 0:
            self._disabled["nccl"] = self._disabled["nccl-symm"] = f"NCCL: {reason}"
            return
        self.nccl = nccl
        uids = self._broadcast_ids(nccl, agreed)  # one for the plain communicator, one for the symmetric
        plain = self._new_comm(nccl, uids[0])
        self._backends["nccl"] = NcclBackend("nccl", nccl, plain, self.rank, self.device)
        if agreed < 2:
            self._disabled["nccl-symm"] = f"symmetric memory: {reason}"
            return
        symm = self._new_comm(nccl, uids[1])
        self._pool = SymmetricPool(nccl, _native.load(), symm, self.device, self._exchange_ints)
        if capacity > 0:
            self._pool.reserve(capacity)
        self._find = self._pool.index.find
        self._backends["nccl-symm"] = NcclBackend("nccl-symm", nccl, symm, self.rank, self.device,
                                                  granules=self._pool.index.granules)

    def _init_custom(self, capacity: int) -> None:
        if capacity % 16 or capacity < 0:
            raise ArgumentError(f"custom_ar_capacity must be a non-negative multiple of 16, got {capacity}")
        if capacity == 0:
            reason: str | None = "turned off (custom_ar_capacity=0)"
            state = None
        else:
            pool = self._pool
            granules = pool.index.granules if pool is not None else None
            regions = [] if pool is None else [(r.base, r.nbytes) for r in sorted(pool.regions.values(),
                                                                                    key=lambda r: r.number)]
            state, reason = custom.setup(self.rank, self.world_size, self.device, self._exchange_ints,
                                         self.timeout_s, granules, staging_bytes=capacity, regions=regions)
        if state is None:
            for name in custom.ALGO_CODES:
                self._disabled[name] = f"custom all-reduce: {reason}"
            return
        self._custom = state
        for name in custom.ALGO_CODES:
            self._backends[name] = custom.CustomBackend(name, state)

    def _broadcast_ids(self, nccl: _nccl.Library, count: int) -> list[_nccl.UniqueId]:
        """Rank 0's fresh ncclUniqueIds, on every rank. A plain uint8 broadcast (not
        broadcast_object_list, which needs numpy), led by a status byte so that a failure on
        rank 0 raises everywhere instead of leaving the others waiting."""
        size = _nccl.UNIQUE_ID_BYTES
        buf = torch.zeros(1 + count * size, dtype=torch.uint8, device=self._group_device())
        failure = None
        if self.rank == 0:
            try:
                raw = b"".join(nccl.get_unique_id().to_bytes() for _ in range(count))
                buf[1:].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            except SymcommError as exc:
                failure = exc
                buf[0] = 1
        dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)
        raw = bytes(buf.tolist())
        if raw[0]:
            if failure is not None:
                raise failure
            raise SymcommError("ncclGetUniqueId failed on rank 0 (its own error says why); "
                               "no NCCL communicator was created")
        return [_nccl.UniqueId.from_bytes(raw[1 + i * size:1 + (i + 1) * size]) for i in range(count)]

    def _new_comm(self, nccl: _nccl.Library, uid: _nccl.UniqueId) -> int:
        comm = _bounded("ncclCommInitRank", lambda: nccl.comm_init_rank(self.world_size, uid, self.rank),
                        self.timeout_s, self.device)
        self._nccl_comms.append(comm)
        return comm

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
            raise SymmetricMemoryError("symmetric memory is off: " + self._disabled.get("nccl-symm", "unknown"))
        region = self._pool.reserve(nbytes)
        if self._custom is not None:
            custom.map_regions(self._custom, [(region.base, region.nbytes)], self._exchange_ints)

    # --------------------------------------------------------------- dispatch
    def algorithms(self) -> list[str]:
        """The concrete paths this communicator can use, for ``algo=``."""
        return list(self._backends)

    def _require_open(self) -> None:
        if self.closed:
            raise CommClosedError("this Communicator is closed")

    def _choose(self, call: Call, algo: str) -> Backend:
        if algo == "auto":
            bounds, prefs = self.table.rows.get(call.table_key, PLAIN_ROW)
            for name in prefs[bisect_left(bounds, call.nbytes)]:
                backend = self._backends.get(name)
                if backend is not None and backend.why_not(call) is None:
                    return backend
            raise ArgumentError(f"no path can serve this {call.op}: " + "; ".join(
                f"{n}: {r}" for n, r in self._explain(call).rejected.items()))
        backend = self._backends.get(algo)
        if backend is None:
            if algo in self._disabled:
                raise ArgumentError(f"algo={algo!r} is unavailable: {self._disabled[algo]}")
            raise ArgumentError(f"algo must be 'auto' or one of {', '.join(self._backends)}, got {algo!r}")
        reason = backend.why_not(call)
        if reason is not None:
            raise ArgumentError(f"algo={algo!r} cannot serve this {call.op}: {reason}")
        return backend

    def _explain(self, call: Call) -> Choice:
        rejected: dict[str, str] = {}
        chosen = ""
        preference = self.table.preference(call.table_key, call.nbytes)
        for name in (*preference, *(n for n in (*self._backends, *self._disabled) if n not in preference)):
            backend = self._backends.get(name)
            reason = self._disabled.get(name, "not built") if backend is None else backend.why_not(call)
            if reason is None and not chosen:
                chosen = name
            elif name not in rejected and name != chosen:
                rejected[name] = reason or f"ranked below {chosen} at {call.nbytes} bytes by the {self.table.source} table"
        return Choice(chosen, rejected)

    def _launch(self, call: Call, algo: str) -> None:
        try:
            if self.closed:
                raise CommClosedError("this Communicator is closed")
            backend = self._choose(call, algo)
        except SymcommError:
            self._refused()
            raise
        if self.check:
            self._verify(call, backend.name)
        if call.nbytes:
            backend.run(call)

    def _verify(self, call: Call, algo: str) -> None:
        if self._group_device().type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        # Symmetric kernels and the custom kernels (which read pool inputs in place) need each
        # rank's tensor at the same window offset.
        pool = self._pool if algo == "nccl-symm" or algo in custom.ALGO_CODES else None
        values, names = checks.signature(call, algo, self.world_size, None if pool is None else pool.locate)
        problem = checks.first_mismatch(self._exchange_ints(values), names)
        if problem is not None:
            raise PeerMismatchError(f"SYMCOMM_CHECK: {call.op}: {problem}. Every rank must make the same "
                                    f"call, and symmetric tensors must be allocated in the same order "
                                    f"and sizes on every rank")

    def _refused(self) -> None:
        """In check mode, a rank whose call failed its own checks still joins the exchange its
        peers are waiting in, so they raise too instead of waiting for it."""
        if self.check and not (self._group_device().type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._exchange_ints(checks.refusal(self.world_size))

    def select(self, op: str, x: torch.Tensor | Sequence[torch.Tensor], out: Any = None,
               sizes: Sequence[int] | None = None, reduce_op: str = "sum") -> Choice:
        """The path ``algo='auto'`` would take for this call, and why the others were passed over."""
        self._require_open()
        return self._explain(self._build(op, x, out, sizes, reduce_op))

    def _build(self, op: str, x: Any, out: Any, sizes: Any, reduce_op: str) -> Call:
        if op == "all_reduce":
            return validate.all_reduce(x, out, reduce_op, self.device)
        if op == "all_gather":
            return validate.all_gather(x, out, self.rank, self.world_size, self.device)
        if op == "reduce_scatter":
            return validate.reduce_scatter(x, out, reduce_op, self.rank, self.world_size, self.device)
        if op == "all_gatherv":
            return validate.all_gatherv(x, sizes, out, self.rank, self.world_size, self.device)[0]
        if op == "reduce_scatterv":
            return validate.reduce_scatterv(x, sizes, out, reduce_op, self.rank, self.world_size, self.device)
        raise ArgumentError(f"op must be one of all_reduce, all_gather, all_gatherv, reduce_scatter, "
                            f"reduce_scatterv; got {op!r}")

    # ------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                   algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over all ranks into ``out`` (a new tensor, or ``x`` itself for in place)."""
        if _is_compiling():
            return ops.compiled_all_reduce(self, x, out, op, algo)
        try:
            call = validate.all_reduce(x, out, op, self.device)
        except SymcommError:
            self._refused()
            raise
        self._launch(call, algo)
        return call.outputs[0]

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, in rank order."""
        if _is_compiling():
            return ops.compiled_all_gather(self, x, out, algo)
        try:
            call = validate.all_gather(x, out, self.rank, self.world_size, self.device)
        except SymcommError:
            self._refused()
            raise
        self._launch(call, algo)
        return call.outputs[0]

    def all_gatherv(self, tensors: torch.Tensor | Sequence[torch.Tensor], sizes: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                    algo: str = "auto") -> torch.Tensor | list[torch.Tensor]:
        """Gather rows with per-rank counts ``sizes`` (zeros allowed); several tensors share one
        NCCL group. Returns a tensor for a tensor, a list for a list."""
        if _is_compiling():
            return ops.compiled_all_gatherv(self, tensors, sizes, out, algo)
        try:
            call, single = validate.all_gatherv(tensors, sizes, out, self.rank, self.world_size, self.device)
        except SymcommError:
            self._refused()
            raise
        self._launch(call, algo)
        return call.outputs[0] if single else call.outputs

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                       algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over ranks; rank r keeps rows [r*n, (r+1)*n) with n = x.shape[0] / world."""
        if _is_compiling():
            return ops.compiled_reduce_scatter(self, x, out, op, algo)
        try:
            call = validate.reduce_scatter(x, out, op, self.rank, self.world_size, self.device)
        except SymcommError:
            self._refused()
            raise
        self._launch(call, algo)
        return call.outputs[0]

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None,
                        op: str = "sum", algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` (sum(sizes) rows) over ranks; rank r keeps its ``sizes[r]`` rows."""
        if _is_compiling():
            return ops.compiled_reduce_scatterv(self, x, sizes, out, op, algo)
        try:
            call = validate.reduce_scatterv(x, sizes, out, op, self.rank, self.world_size, self.device)
        except SymcommError:
            self._refused()
            raise
        self._launch(call, algo)
        return call.outputs[0]

    def all_gatherv_fp4(self, x: torch.Tensor, sizes: Sequence[int], global_scale: float | torch.Tensor,
                        extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                        swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
        """NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] and gather every rank's payload,
        scales and ``extra`` tensors (dim 0 = this rank's rows) in one NCCL group, in rank order.

        ``global_scale`` must be the same on every rank (``symcomm.fp4.global_scale_for(x, comm)``).
        ``dequantize=True`` adds the decoded rows; ``swizzle=True`` returns the scales in the 128x4
        GEMM layout; ``out`` (an Fp4Gathered) supplies preallocated gathered buffers.
        """
        return _all_gatherv_fp4(self, x, sizes, global_scale, extra, dequantize, algo, swizzle=swizzle, out=out)

    # ------------------------------------------------------------ CUDA graphs
    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Collective: wrap ``torch.cuda.graph(...)`` in this so that captured custom all-reduces
        read their inputs in place at replay instead of copying them to the staging buffer.

            with comm.graph_capture(), torch.cuda.graph(g):
                y = comm.all_reduce(x)

        On exit (after the capture has ended) every rank exchanges the CUDA IPC handles of the
        buffers it recorded; all ranks must have captured the same calls. Capturing without it
        is also correct, with one device copy per call. Eager calls inside are unaffected.
        """
        self._require_open()
        state = self._custom
        if state is None:
            yield
            return
        if state.capture is not None:
            raise ArgumentError("graph_capture() is already active on this communicator (it does not nest)")
        session = state.capture = custom.CaptureSession()
        failed = True
        try:
            yield
            failed = False
        finally:
            state.capture = None
            if torch.cuda.is_current_stream_capturing():
                # Every rank runs this same code, so all raise here; exchanging now would put
                # the exchange itself into the graph.
                raise ArgumentError("graph_capture() must enclose the torch.cuda.graph(...) block, not sit inside it: "
                                    "buffers can be registered only after capture ends")
            problem = custom.register_captured(state, session, failed, self._exchange_ints)
            if session.out_of_slots:
                warnings.warn(f"graph_capture(): all {state.graph_slots - 1} buffer slots are in use; later "
                              f"captured custom all-reduces copy their input to the staging buffer instead",
                              ResourceWarning, stacklevel=3)
            if problem is not None and not failed:
                raise PeerMismatchError(f"graph_capture(): {problem}. The captured graph reads unregistered "
                                        f"memory: do not replay it")

    # ------------------------------------------------------------ introspection
    def capabilities(self) -> dict[str, Any]:
        """What is enabled, and for everything disabled, why."""
        paths = {name: {"enabled": True} for name in self._backends}
        for name, reason in self._disabled.items():
            paths[name] = {"enabled": False, "reason": reason}
        pool = self._pool
        return {
            "device": str(self.device),
            "rank": self.rank,
            "world_size": self.world_size,
            "paths": paths,
            "nccl": None if self.nccl is None else {
                "version": self.nccl.version_string, "library": self.nccl.path, "found_by": self.nccl.source},
            "symmetric_memory": {
                "enabled": pool is not None,
                "reason": None if pool is not None else self._disabled.get("nccl-symm"),
                "capacity": pool.capacity if pool else 0,
                "bytes_in_use": pool.bytes_in_use if pool else 0,
                "regions": len(pool.regions) if pool else 0,
            },
            "tuning_table": self.table.source,
            "custom_all_reduce": None if self._custom is None else {
                "staging_bytes": self._custom.staging_bytes,
                "flagfree_bytes": self._custom.flagfree_bytes,
                "graph_slots_used": self._custom.next_slot - 1,
                # pool regions whose inputs the kernels read in place (else: staged, and why)
                "symmetric_regions_mapped": len(self._custom.region_slots),
                "symmetric_regions_problem": self._custom.region_problem,
            },
            "check_mode": self.check,
        }

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Deregister windows, free the pool and destroy the NCCL communicators. Idempotent.

        Collective, like construction. If tensors from the symmetric pool are still alive, their
        memory stays mapped until the process exits (with a ResourceWarning) rather than being
        freed under them. Bounded by the communicator's timeout; on timeout the NCCL
        communicators are aborted instead.
        """
        if self.closed:
            return
        self.closed = True
        if self.key is not None:
            registry.unregister(self.key)
        self._find = None
        self._backends = {}
        nccl, comms, pool, state = self.nccl, self._nccl_comms, self._pool, self._custom
        self._nccl_comms, self._pool, self._custom = [], None, None
        if nccl is None:
            return

        # Set when close() gave up waiting: the teardown thread may still wake up (after the
        # aborts below release it) and must then touch nothing more.
        abandoned = threading.Event()

        def teardown() -> None:
            if pool is not None or state is not None:
                torch.cuda.synchronize(self.device)
            failure: BaseException | None = None
            if state is not None:
                try:
                    # Peers may still read this rank's buffers in their last kernel: wait for
                    # all of them on the plain communicator (ordered, bounded) before unmapping.
                    self._backends_barrier(nccl, comms[0])
                    if not abandoned.is_set():
                        state.destroy()
                except Exception as exc:  # noqa: BLE001 - finish the collective steps first
                    failure = exc
            # Window deregistration is collective: a rank that skipped it would stall its peers.
            if pool is not None and not abandoned.is_set():
                pool.close()
            for comm in comms:
                if not abandoned.is_set():
                    nccl.comm_destroy(comm)
            if failure is not None:
                raise failure

        try:
            _bounded("close", teardown, self.timeout_s, self.device)
        except CommTimeoutError:
            abandoned.set()
            for comm in comms:
                try:
                    _bounded("ncclCommAbort", lambda c=comm: nccl.comm_abort(c), self.timeout_s, self.device)
                except Exception:  # noqa: BLE001 - best effort after a timeout already reported
                    pass
            raise

    def _backends_barrier(self, nccl: _nccl.Library, comm: int) -> None:
        """Every rank's GPU work so far is done: a one-element all-reduce on the plain NCCL
        communicator, waited for. Runs inside close()'s bounded teardown thread."""
        flag = torch.ones(1, dtype=torch.int32, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        nccl.check("ncclAllReduce", nccl.lib.ncclAllReduce(flag.data_ptr(), flag.data_ptr(), 1, _nccl.DTYPES[torch.int32],
                                                           _nccl.REDUCE_OPS["sum"], comm, stream), comm)
        torch.cuda.synchronize(self.device)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ",".join(self._backends)
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, paths={state})"
