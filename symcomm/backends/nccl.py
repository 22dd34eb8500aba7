"""Plain NCCL (``nccl``) and NCCL on symmetric windows (``nccl-symm``): two paths, each with an
NCCL communicator of its own, sharing the code that enqueues the collectives.

The symmetric communicator has the pool's regions registered as windows; NCCL picks its
symmetric kernels there when every buffer of the call lies in a window at the same offset on
every rank. The plain communicator has none, so even a symmetric tensor runs NCCL's regular
kernels on it, which win at large sizes without NVLS (docs/measuring.md). The symmetric path
owns the pool: the Communicator hands it out for use_symmetric_memory.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _native, _nccl
from .._nccl import DTYPES, REDUCE_OPS, UINT8, Library, reduce_dtype
from ..base import NCCL, SCATTERING_OPS, Call, Path, Setup, capturing, raw_stream, runner_table
from ..peers import Peers

from .._nccl_config import CommConfig
from ..bounded import bounded
from ..device_memory import measured
from ..errors import ArgumentError, DtypeError, SymcommError
from ..pool import GRANULE_SHIFT
from .nccl_schedules import (RSV_PADDED, RSV_REDUCE_PER_ROOT, RSV_SCHEDULES, RSV_SEND_RECV, SENDRECV_GATHERV_MAX_BYTES,
                              rsv_schedule, sum_in_rank_order)



def unique_id(nccl: Library, peers: Peers) -> _nccl.UniqueId:
    """Collective: rank 0's fresh ncclUniqueId on every rank. It travels led by a status byte,
    so a failure on rank 0 raises everywhere instead of leaving the others waiting."""
    payload, failure = None, None
    if peers.rank == 0:
        try:
            payload = b"\0" + nccl.get_unique_id().to_bytes()
        except SymcommError as exc:
            failure, payload = exc, b"\1"
    raw = peers.broadcast(payload, 1 + _nccl.UNIQUE_ID_BYTES)
    if raw[0]:
        if failure is not None:
            raise failure
        raise SymcommError("ncclGetUniqueId failed on rank 0 (its own error says why); "
                           "no NCCL communicator was created")
    return _nccl.UniqueId.from_bytes(raw[1:])


# NCCL keeps state for every channel it may use: at world 1, 6 MiB per channel of maxCTAs (2 MiB
# granules of tiny buffers), 388 MiB for a default communicator (bench/results/
# 2026-11-25_h100_comm_memory). The plain communicator carries the large messages, whose
# bandwidth needs channels: it keeps 16 (NCCL uses 16 or fewer on one NVLink host in the logs
# seen so far; the multi-GPU run measures what the cap costs at 16-256 MiB). The symmetric one
# has its own cap (nccl_symm.py).
PLAIN_MAX_CTAS = 16
# NCCL 2.28 through 2.30.6 launch their symmetric kernels as programmatic dependents that do not
# wait for their predecessor (csrc/launch.cuh): symcomm's kernels must not let them start early.
_PDL_UNSAFE = ((2, 28, 0), (2, 30, 7))


def early_dependents_safe(version: tuple[int, int, int]) -> bool:
    """Whether symcomm's kernels may let the next kernel start early with this NCCL loaded."""
    return not _PDL_UNSAFE[0] <= version < _PDL_UNSAFE[1]


def new_comm(nccl: Library, peers: Peers, timeout_s: float, device: torch.device,
             config: CommConfig | None = None) -> int:
    """Collective: one NCCL communicator over ``peers``, its init bounded by ``timeout_s``;
    ``config`` where this NCCL takes one (before 2.27.3 NCCL picks everything)."""
    uid = unique_id(nccl, peers)
    if config is not None and nccl.config_layout is None:
        config = None
    return bounded("ncclCommInitRank", lambda: nccl.comm_init_rank(peers.world_size, uid, peers.rank, config),
                   timeout_s, device)


def _native_or_none():
    try:
        return _native.load()
    except OSError:
        return None  # no kernels of ours to restrain


def agree(setup: Setup, reason: str | None) -> str | None:
    """Collective vote: None only if no rank has a reason to stay off."""
    votes = setup.peers.exchange([0 if reason is None else 1])
    if reason is None and any(v for v, in votes):
        return "unavailable on another rank"
    return reason


class NcclPath(Path):
    """NCCL's regular kernels on a communicator with no windows: serves any CUDA tensor."""

    name = NCCL

    def __init__(self) -> None:
        self.nccl: Library | None = None
        self.comm = 0
        # A second communicator for captured launches, opened by the first graph_capture():
        # a communicator that serves both pays NCCL's graph-mixing cost on every captured call.
        self.graph_comm = 0
        self.graph_comm_bytes = 0  # device memory it took, measured when it was opened
        self.comm_bytes = 0  # the same for the eager communicator
        self._graph_comms = False  # graph_capture() opens graph communicators (Communicator option)
        self._config: CommConfig | None = None
        self._peers: Peers | None = None
        self._timeout_s = 0.0
        self._lib = None
        self._rank = 0
        self._device_index: int | None = None
        self._device: torch.device | None = None
        self._reduce_codes: dict[torch.dtype, int] = {}
        # An uneven reduce_scatterv schedule forced by an experiment (force_rsv_schedule), or
        # None: RSV_SCHEDULE_RULES choose.
        self.rsv_forced: str | None = None
        # Only the symmetric path gets the pool's granule map (SegmentIndex.granules); its
        # presence is what makes why_not demand windows.
        self._granules: dict[int, int] | None = None

    def open(self, setup: Setup) -> str | None:
        reason, nccl = self._local_blocker(setup)
        reason = agree(setup, reason)
        if reason is not None:
            return reason
        self._open_comm(setup, nccl, CommConfig(max_ctas=setup.options.get("nccl_max_ctas", PLAIN_MAX_CTAS)))
        if not early_dependents_safe(nccl.version) and (native := _native_or_none()) is not None:
            native.lib.symcomm_set_early_dependents(0)
        return None

    def _open_comm(self, setup: Setup, nccl: Library, config: CommConfig) -> None:
        self._peers, self._timeout_s = setup.peers, setup.timeout_s
        self._graph_comms = bool(setup.options.get("graph_communicators", False))
        self._config = config
        comm, self.comm_bytes = measured(setup.device, lambda: new_comm(nccl, setup.peers, setup.timeout_s,
                                                                        setup.device, config))
        self.attach(nccl, comm, setup.peers.rank, setup.device)

    def _local_blocker(self, setup: Setup) -> tuple[str | None, Library | None]:
        if setup.device.type != "cuda":
            return "the communicator's device is the CPU", None
        try:
            return None, _nccl.load()
        except _nccl.NcclUnavailableError as exc:
            return f"NCCL: {exc}", None

    def attach(self, nccl: Library, comm: int, rank: int, device: torch.device) -> None:
        """Serve calls on ``comm``, an NCCL communicator this path now owns (open() makes one;
        tests pass a recording stand-in)."""
        self.nccl, self._lib, self.comm = nccl, nccl.lib, comm
        self._rank = rank
        self._device = device
        self._device_index = device.index
        for dtype in DTYPES:
            try:
                self._reduce_codes[dtype] = reduce_dtype(dtype, nccl.version)
            except DtypeError:
                pass

    def begin_capture(self) -> None:
        if self.graph_comm or self._peers is None or not self._graph_comms:
            return
        # Collective (graph_capture() is), and outside the capture, which cannot create one.
        def open_graph_comm() -> None:
            self.graph_comm = new_comm(self.nccl, self._peers, self._timeout_s, self._device, self._config)
            try:
                self._graph_comm_opened()
            except BaseException:
                # No half-ready graph communicator: a later graph_capture() tries again from scratch.
                comm, self.graph_comm = self.graph_comm, 0
                self.nccl.comm_destroy(comm)
                raise
        _, self.graph_comm_bytes = measured(self._device, open_graph_comm)

    def _graph_comm_opened(self) -> None:
        """Hook for the symmetric path, which registers its windows on the new communicator."""

    def info(self) -> dict[str, Any]:
        nccl = self.nccl
        if nccl is None:
            return {}
        features = nccl.features
        return {"nccl": {"version": nccl.version_string, "library": nccl.path, "found_by": nccl.source,
                         "features": features,
                         # csrc/launch.cuh: off where this NCCL's symmetric kernels do not wait
                         "early_dependent_launch": early_dependents_safe(nccl.version)},
                f"{self.name}_graph_communicator": {"enabled": self._graph_comms, "open": bool(self.graph_comm),
                                                    "device_bytes": self.graph_comm_bytes},
                "device_bytes": {f"{self.name} communicator": self.comm_bytes,
                                 f"{self.name} graph communicator": self.graph_comm_bytes}}

    def barrier(self) -> None:
        """Every rank's GPU work so far is done: a one-element all-reduce, waited for. Only
        inside a bounded teardown (it blocks until every peer arrives)."""
        flag = torch.ones(1, dtype=torch.int32, device=self._device)
        stream = torch.cuda.current_stream(self._device).cuda_stream
        self._check("ncclAllReduce", self._lib.ncclAllReduce(flag.data_ptr(), flag.data_ptr(), 1,
                                                             DTYPES[torch.int32], REDUCE_OPS["sum"],
                                                             self.comm, stream))
        torch.cuda.synchronize(self._device)

    def close(self) -> None:
        # Each handle is cleared only once destroyed: if a destroy hangs on a missing peer, the
        # Communicator's abort() must still find it to abort.
        self._peers = None
        for attr in ("graph_comm", "comm"):
            comm = getattr(self, attr)
            if comm:
                self.nccl.comm_destroy(comm)
                setattr(self, attr, 0)

    def abort(self) -> None:
        comms, self.comm, self.graph_comm, self._peers = (self.graph_comm, self.comm), 0, 0, None
        for comm in comms:
            if comm:
                self.nccl.comm_abort(comm)

    def why_not(self, call: Call) -> str | None:
        # Runs on every call: cheapest tests first, and nothing the validator already did
        # (device, contiguity, shapes).
        if call.redop is not None and call.dtype not in self._reduce_codes:
            return self._unreducible(call.dtype)
        if self._granules is None:
            return None  # plain NCCL takes any buffer
        if call.op == "all_to_allv":  # first: an all_to_allv's bytes are this rank's own
            return "NCCL's symmetric kernels have no all-to-all: nccl runs its sends and receives"
        if call.nbytes == 0:
            return None  # an empty call touches no memory
        if call.op in SCATTERING_OPS and call.outputs[0].nbytes % 16:
            # Measured 2026-11-21, NCCL 2.28.9, 2x/4x H200: the symmetric reduce-scatter kernels
            # got one element wrong on odd ranks when a rank's chunk was 14 bytes (7 bf16), and
            # NCCL raised no error. Chunks that are whole 16-byte vectors were always right.
            return "each rank's chunk must be a multiple of 16 bytes for NCCL's symmetric reduce-scatter"
        if call.sizes is not None and not call.even:
            # Uneven rows put each rank's slice at a different offset: a symmetric kernel
            # would read the wrong peer memory (docs/symmetric-memory.md, "same offset" rule).
            return "per-rank sizes are uneven, so window offsets differ between ranks"
        symmetric = call.symmetric
        if symmetric is None:
            owner = self._granules.get
            symmetric = True
            for ptr in (*call.in_ptrs, *call.out_ptrs):
                if owner(ptr >> GRANULE_SHIFT) is None:
                    symmetric = False
                    break
            call.symmetric = symmetric
        if not symmetric:
            return "input and output are not both in symmetric memory"
        return None

    def _unreducible(self, dtype: torch.dtype) -> str:
        try:
            reduce_dtype(dtype, self.nccl.version)
        except DtypeError as exc:
            return str(exc)
        return f"NCCL cannot reduce {dtype}"

    def run(self, call: Call) -> None:
        # Captured calls go to a communicator of their own once graph_capture() has opened one:
        # NCCL's support for mixing captured and eager launches on one communicator costs
        # microseconds per captured collective (docs/measuring.md, "Honest ratios").
        graph_comm = self.graph_comm
        comm = graph_comm if graph_comm and capturing() else self.comm
        self._RUNNERS[call.op](self, call, comm, raw_stream(self._device_index))

    def _check(self, call: str, code: int) -> None:
        if code:
            self._raise(call, code)

    def _raise(self, call: str, code: int) -> None:
        self.nccl.check(call, code, self.comm)

    def _all_reduce(self, call: Call, comm: int, stream: int) -> None:
        x = call.inputs[0]
        code = self._lib.ncclAllReduce(call.in_ptrs[0], call.out_ptrs[0], x.numel(), self._reduce_codes[x.dtype],
                                       REDUCE_OPS[call.redop], comm, stream)
        if code:  # no helper call on success: this is the eager hot path
            self._raise("ncclAllReduce", code)

    def _all_gather(self, call: Call, comm: int, stream: int) -> None:
        # Byte-moving ops send every dtype (fp8, packed fp4, ...) as uint8.
        self._check("ncclAllGather", self._lib.ncclAllGather(
            call.in_ptrs[0], call.out_ptrs[0], call.inputs[0].nbytes, UINT8, comm, stream))

    def _reduce_scatter(self, call: Call, comm: int, stream: int) -> None:
        self._check("ncclReduceScatter", self._lib.ncclReduceScatter(
            call.in_ptrs[0], call.out_ptrs[0], call.outputs[0].numel(), self._reduce_codes[call.dtype],
            REDUCE_OPS[call.redop], comm, stream))

    def _all_gatherv(self, call: Call, comm: int, stream: int) -> None:
        if call.even:
            self._grouped(call, lambda x, out, src, base: self._check(
                "ncclAllGather", self._lib.ncclAllGather(src, base, x.nbytes, UINT8, comm, stream)))
        elif call.nbytes <= SENDRECV_GATHERV_MAX_BYTES:
            self._grouped(call, lambda x, out, src, base: self._send_recv_rows(call.sizes, x, out, src, base, comm, stream))
        else:
            self._grouped(call, lambda x, out, src, base: self._broadcast_rows(call.sizes, out, src, base, comm, stream))

    def _grouped(self, call: Call, enqueue) -> None:
        """enqueue(x, out, src_ptr, out_ptr) for each tensor pair, all in one NCCL group."""
        self._check("ncclGroupStart", self._lib.ncclGroupStart())
        try:
            for pair in zip(call.inputs, call.outputs, call.in_ptrs, call.out_ptrs):
                enqueue(*pair)
        finally:
            self._check("ncclGroupEnd", self._lib.ncclGroupEnd())

    def _send_recv_rows(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor, src: int, base: int,
                        comm: int, stream: int) -> None:
        # Every rank knows the sizes, so both ends of a pair skip an empty slice alike. This
        # rank's own rows are a local copy (enqueued on the stream now, so it runs before the
        # group's kernels), and none when the input already sits in place.
        me, lib = self._rank, self._lib
        row_bytes = out.nbytes // out.shape[0]  # out has sum(sizes) > 0 rows here
        start = 0
        for peer, rows in enumerate(sizes):
            if peer == me:
                if rows and src != base + start * row_bytes:
                    out.narrow(0, start, rows).copy_(x)
            else:
                if sizes[me]:
                    self._check("ncclSend", lib.ncclSend(src, sizes[me] * row_bytes, UINT8, peer, comm, stream))
                if rows:
                    self._check("ncclRecv", lib.ncclRecv(base + start * row_bytes, rows * row_bytes, UINT8, peer,
                                                         comm, stream))
            start += rows

    def _broadcast_rows(self, sizes: list[int], out: torch.Tensor, src: int, base: int, comm: int,
                        stream: int) -> None:
        # One broadcast per root into its slice of the output; every rank skips the same empty
        # roots. The root's broadcast also copies its own rows into place.
        me, lib = self._rank, self._lib
        row_bytes = out.nbytes // out.shape[0]
        offset = 0
        for root, rows in enumerate(sizes):
            if rows:
                dst = base + offset
                self._check("ncclBroadcast", lib.ncclBroadcast(src if root == me else dst, dst, rows * row_bytes,
                                                               UINT8, root, comm, stream))
            offset += rows * row_bytes

    def _all_to_allv(self, call: Call, comm: int, stream: int) -> None:
        # One group of sends and receives per call (NCCL 2.28 has no all-to-all call; its later
        # ncclAlltoAll is the same pattern). Both ends of a pair know the pair's count, so both
        # skip an empty one; this rank's own rows are a local copy, enqueued before the group's
        # kernels on the same stream.
        me, lib = self._rank, self._lib
        self._check("ncclGroupStart", lib.ncclGroupStart())
        try:
            for x, out, src, dst in zip(call.inputs, call.outputs, call.in_ptrs, call.out_ptrs):
                row = x.element_size() * torch.Size(x.shape[1:]).numel()
                sent = received = 0
                for peer, (ns, nr) in enumerate(zip(call.sizes, call.recv_sizes)):
                    if peer == me:
                        if ns:
                            out.narrow(0, received, nr).copy_(x.narrow(0, sent, ns))
                    else:
                        if ns:
                            self._check("ncclSend", lib.ncclSend(src + sent * row, ns * row, UINT8, peer, comm, stream))
                        if nr:
                            self._check("ncclRecv", lib.ncclRecv(dst + received * row, nr * row, UINT8, peer, comm,
                                                                 stream))
                    sent, received = sent + ns, received + nr
        finally:
            self._check("ncclGroupEnd", lib.ncclGroupEnd())

    def _reduce_scatterv(self, call: Call, comm: int, stream: int) -> None:
        if call.even:
            self._check("ncclReduceScatter", self._lib.ncclReduceScatter(
                call.in_ptrs[0], call.out_ptrs[0], call.outputs[0].numel(), self._reduce_codes[call.dtype],
                REDUCE_OPS[call.redop], comm, stream))
            return
        x, sizes = call.inputs[0], call.sizes
        row_bytes = x.nbytes // x.shape[0]  # x has sum(sizes) > 0 rows here
        schedule = rsv_schedule(sizes, row_bytes, len(sizes), call.dtype, call.redop, self.rsv_forced)
        self._RSV_RUNNERS[schedule](self, call, comm, stream)

    def force_rsv_schedule(self, schedule: str | None) -> None:
        """For experiments (bench/reduce_scatterv_variants.py): run this path's later uneven
        reduce_scatterv calls on ``schedule``, one of RSV_SCHEDULES, wherever the call can use it
        (elsewhere RSV_SCHEDULE_RULES decide); None goes back to the rules. Every rank must force
        the same schedule before the same calls, or the ranks enqueue different collectives."""
        if schedule is not None and schedule not in RSV_SCHEDULES:
            raise ArgumentError(f"schedule must be one of {', '.join(RSV_SCHEDULES)} or None, got {schedule!r}")
        self.rsv_forced = schedule

    def _rsv_reduce_per_root(self, call: Call, comm: int, stream: int) -> None:
        x = call.inputs[0]
        x_ptr, out_ptr = call.in_ptrs[0], call.out_ptrs[0]
        dtype = self._reduce_codes[call.dtype]
        op = REDUCE_OPS[call.redop]
        row_elems = x.numel() // x.shape[0]
        row_bytes = row_elems * x.element_size()
        lib = self._lib
        self._check("ncclGroupStart", lib.ncclGroupStart())
        try:
            offset = 0
            for root, rows in enumerate(call.sizes):
                if rows:
                    src = x_ptr + offset * row_bytes
                    # recvbuff matters at the root only; elsewhere NCCL ignores it
                    code = lib.ncclReduce(src, out_ptr if root == self._rank else src, rows * row_elems,
                                          dtype, op, root, comm, stream)
                    self._check("ncclReduce", code)
                offset += rows
        finally:
            self._check("ncclGroupEnd", lib.ncclGroupEnd())

    def _rsv_padded(self, call: Call, comm: int, stream: int) -> None:
        # Every root's rows padded to max(sizes) at root * max_rows, so one even ncclReduceScatter
        # does the whole call. The padding rows hold whatever torch.empty left there and reduce to
        # garbage, harmlessly: an element-wise reduction never mixes rows, and only this rank's
        # sizes[rank] leading rows reach out. Temporaries come from torch's allocator on the
        # current stream (NCCL's too), so they are reused only after NCCL is done with them, and
        # are graph-private memory under CUDA-graph capture.
        x, out, sizes, me = call.inputs[0], call.outputs[0], call.sizes, self._rank
        max_rows, row = max(sizes), x.shape[1:]
        padded = torch.empty((len(sizes) * max_rows, *row), dtype=x.dtype, device=x.device)
        start = 0
        for root, rows in enumerate(sizes):
            if rows:
                padded.narrow(0, root * max_rows, rows).copy_(x.narrow(0, start, rows))
            start += rows
        # out (contiguous, validated) takes the result directly when it has all max_rows rows.
        direct = sizes[me] == max_rows
        result = out if direct else torch.empty((max_rows, *row), dtype=x.dtype, device=x.device)
        self._check("ncclReduceScatter", self._lib.ncclReduceScatter(
            padded.data_ptr(), call.out_ptrs[0] if direct else result.data_ptr(), result.numel(),
            self._reduce_codes[call.dtype], REDUCE_OPS[call.redop], comm, stream))
        if not direct and sizes[me]:
            out.copy_(result.narrow(0, 0, sizes[me]))

    def _rsv_send_recv(self, call: Call, comm: int, stream: int) -> None:
        # Each rank sends every non-empty root its slice of x and, as a root, receives its own
        # slice from every peer into a temporary (one slot per peer, in rank order, skipping this
        # rank, whose rows are read from x in place), then sums them (_sum_in_rank_order). Both
        # ends of a pair know sizes, so both skip an empty root alike: a zero-row rank only sends.
        # Temporaries: as in _rsv_padded.
        x, out, sizes, me, lib = call.inputs[0], call.outputs[0], call.sizes, self._rank, self._lib
        mine, x_ptr = sizes[me], call.in_ptrs[0]
        row_bytes = x.nbytes // x.shape[0]
        slot_bytes = mine * row_bytes
        inbox = torch.empty((len(sizes) - 1, mine, *x.shape[1:]), dtype=x.dtype, device=x.device) if mine else None
        inbox_ptr = inbox.data_ptr() if mine else 0
        own = x.narrow(0, sum(sizes[:me]), mine)
        self._check("ncclGroupStart", lib.ncclGroupStart())
        try:
            start = 0
            for peer, rows in enumerate(sizes):
                if peer != me:
                    if rows:
                        self._check("ncclSend", lib.ncclSend(x_ptr + start * row_bytes, rows * row_bytes, UINT8,
                                                             peer, comm, stream))
                    if mine:
                        slot = peer - (peer > me)
                        self._check("ncclRecv", lib.ncclRecv(inbox_ptr + slot * slot_bytes, slot_bytes, UINT8,
                                                             peer, comm, stream))
                start += rows
        finally:
            self._check("ncclGroupEnd", lib.ncclGroupEnd())
        if mine:
            sum_in_rank_order([own if peer == me else inbox[peer - (peer > me)] for peer in range(len(sizes))],
                               out)

    _RUNNERS = runner_table(locals())
    # schedule -> its function, unbound for the reason runner_table gives
    _RSV_RUNNERS = {RSV_REDUCE_PER_ROOT: _rsv_reduce_per_root, RSV_PADDED: _rsv_padded,
                    RSV_SEND_RECV: _rsv_send_recv}
