"""Peers: the host-side exchanges symcomm runs among the ranks of one group (setup votes, check
mode, graph-capture registration, the NCCL unique id), each framed and bounded; and the gloo
group of symcomm's own that carries the torch path's collectives on CPU tensors.

Nothing here ever leaves work pending on the user's process group. A timed-out all-gather on
that group stays queued in it, and ``dist.destroy_process_group()`` then waits for it (30
minutes on gloo): the user could neither close symcomm nor tear down torch.distributed.
So:

- **Exchanges go through the group's store**, with deadlines. Each rank posts a frame under
  its next number in the group's sequence (a per-rank counter kept in the store, so every
  communicator of the group shares it, as they shared the group's all-gathers before) and
  waits at most the timeout for the other ranks' frames of that number. A wait that runs out
  leaves nothing behind but a key.
- **The torch path's CPU collectives run on a gloo group symcomm creates** (``collectives``),
  over the same store, whose own timeout is the communicator's: a collective abandoned after
  the timeout ends inside gloo at the same moment, so close() can drop that group at once.

Two rules keep a mistake from turning into a hang or a crash:

- **Framed.** A frame carries what the exchange is (its kind), a status and the payload. Ranks
  in different exchanges, or sending different lengths, all see it and all raise
  PeerMismatchError naming each rank's side.
- **Bounded.** Each exchange waits at most the communicator's timeout. When it runs out (or a
  peer is gone: the store or a gloo connection fails), CommTimeoutError names the exchange and
  the ranks that did not arrive; the ranks are then out of step, so every later exchange and
  collective raises the same error (``broken``).

A rank that fails before an exchange its peers wait in (a bad argument in check mode, a
constructor that cannot go on) posts a refusal in its place (``refuse(kind, reason)``): the
peers raise with its reason instead of waiting for it, and it does not wait for them.
"""
from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import CommTimeoutError, PeerMismatchError

MAGIC = b"SYMC"  # the start of a frame from symcomm
_KIND_BYTES = 24  # an exchange's kind, up to 24 ASCII characters
_FRAME = struct.Struct(f"<4sB{_KIND_BYTES}s")  # magic, status, kind; the payload follows
OK, REFUSED = 0, 1
_INT64 = (-(1 << 63), (1 << 63) - 1)
_PREFIX = "symcomm/"  # symcomm's keys in the group's store, apart from torch's own

# (values, kind) -> one row per rank. Paths receive Peers.exchange as this.
Exchange = Callable[..., list[list[int]]]


class PeerRefusal(PeerMismatchError):
    """Peers refused the exchange (``Peers.refuse``): ``reasons`` maps each such rank to its
    reason. A PeerMismatchError, so callers that catch that see it too."""

    def __init__(self, kind: str, reasons: dict[int, str]) -> None:
        self.kind, self.reasons = kind, reasons
        super().__init__("; ".join(f"rank {r} could not take part in symcomm's {kind!r} exchange: {why}"
                                   for r, why in reasons.items()))


def text_ints(text: str, count: int = 64) -> list[int]:
    """``text`` (UTF-8, cut to fit) as ``count`` int64 values, for text inside a signature."""
    raw = text.encode("utf-8", "replace")[:count * 8].ljust(count * 8, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def ints_text(values: Sequence[int]) -> str:
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in values).rstrip(b"\0")
    return raw.decode("utf-8", "replace")


def _frame(kind: str, status: int, payload: bytes) -> bytes:
    return _FRAME.pack(MAGIC, status, kind.encode("ascii", "replace")[:_KIND_BYTES]) + payload


def _unframe(raw: bytes) -> tuple[str | None, int, bytes]:
    """(kind, status, payload) of a frame; kind None for bytes that are not a symcomm frame."""
    if len(raw) < _FRAME.size or not raw.startswith(MAGIC):
        return None, OK, b""
    _, status, kind = _FRAME.unpack_from(raw)
    return kind.rstrip(b"\0").decode("ascii", "replace"), status, raw[_FRAME.size:]


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store ``group``'s members rendezvoused through (a prefix of the default store that
    is the group's alone). torch has no public accessor; this one is in every torch symcomm
    supports (2.8 on). Its keys are symcomm's only channel that needs no collective on the
    group, so nothing symcomm abandons can stay queued there."""
    from torch.distributed.distributed_c10d import _get_process_group_store
    return _get_process_group_store(group)


class HostCollectives:
    """The torch path's collectives on CPU tensors, on a gloo group of symcomm's own (built by
    ``Peers.collectives``). Each returns the backend's Work, for ``Peers.wait``. The group is
    not registered with torch.distributed (registering one needs a collective new_group over
    the whole world, which a communicator over a sub-group cannot ask of the others), so the
    backend's own methods are called, as torch.distributed's functions call them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> Any:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self.backend.allreduce([t], options)

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> Any:
        return self.backend.allgather([outputs], [t])

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                          in_splits: list[int]) -> Any:
        return self.backend.alltoall_base(out, x, out_splits, in_splits, dist.AllToAllOptions())


class GroupCollectives:
    """The same collectives on the user's group, for CUDA tensors (a group with an NCCL
    backend): stream-ordered, bounded by the group's own timeout (its watchdog)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group: dist.ProcessGroup | None = group

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> Any:
        return dist.all_reduce(t, op=op, group=self.group, async_op=True)

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> Any:
        return dist.all_gather(outputs, t, group=self.group, async_op=True)

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                          in_splits: list[int]) -> Any:
        return dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group, async_op=True)


class Peers:
    """The ranks of one group. Never on the per-call path of a collective (check mode aside):
    every exchange is a blocking collective among the group's ranks, through its store."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group: dist.ProcessGroup | None = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        # The device the group itself bootstraps on: a group with only an NCCL backend needs
        # CUDA tensors for its collectives (check mode skips capture there: Communicator).
        gloo = "gloo" in str(dist.get_backend(group))
        self.device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.broken: str | None = None  # set once a wait ran out or a peer is gone: later exchanges raise it
        # Alone, a rank exchanges with nobody; otherwise under symcomm's prefix of the group's store.
        self._store: dist.Store | None = (None if self.world_size == 1 else
                                          dist.PrefixStore(_PREFIX, group_store(group)))
        self._turn = 0  # the number of the last exchange every rank completed (equal on all ranks)
        self._posted: list[int] = []  # this rank's frames still in the store, by number
        self._host: HostCollectives | None = None

    # ------------------------------------------------------------------ exchanges
    def exchange(self, values: Sequence[int], kind: str = "setup") -> list[list[int]]:
        """All-gather ``values`` (ints in int64) among the ranks: row r is rank r's. ``kind``
        names the exchange; every rank must be in the same one with the same length, else all
        raise PeerMismatchError. A rank that refused (``refuse``) makes the others raise with
        its reason."""
        values = [int(v) for v in values]
        if any(not _INT64[0] <= v <= _INT64[1] for v in values):
            # Posted as a refusal so no peer waits in this exchange for a frame that never comes.
            self.refuse(kind, "a value does not fit in int64")
            raise OverflowError(f"symcomm's {kind!r} exchange: a value does not fit in int64")
        rows = self._round(kind, OK, struct.pack(f"<{len(values)}q", *values), same_length=True)
        return [list(struct.unpack(f"<{len(row) // 8}q", row)) for row in rows]

    def agree(self, kind: str, what: str, named: dict[str, int]) -> None:
        """Exchange ``named`` values that must be equal on every rank; all raise the same
        PeerMismatchError naming the first that differs, with every rank's value."""
        rows = self.exchange(list(named.values()), kind)
        for i, name in enumerate(named):
            if any(row[i] != rows[0][i] for row in rows):
                per_rank = ", ".join(f"rank {r}: {row[i]}" for r, row in enumerate(rows))
                raise PeerMismatchError(f"{what}: ranks disagree on {name} ({per_rank})")

    def refuse(self, kind: str, reason: str) -> None:
        """Take part in the exchange the peers wait in as a rank that cannot go on: they raise
        PeerMismatchError with ``reason``; this rank raises its own error after, at once (it
        posts its refusal and does not wait for them). Best effort: a peer that is elsewhere
        (or gone) learns nothing, and waits at most its timeout."""
        try:
            self._round(kind, REFUSED, reason.encode("utf-8", "replace"), same_length=False)
        except (PeerMismatchError, CommTimeoutError):
            pass

    def broadcast(self, data: bytes | None, nbytes: int) -> bytes:
        """Rank 0's ``nbytes`` bytes on every rank (other ranks pass None), bounded like an
        exchange (whose frame it is: a rank in another exchange is told so)."""
        rows = self._round("broadcast", OK, (data or b"")[:nbytes] if self.rank == 0 else b"", same_length=False)
        return rows[0].ljust(nbytes, b"\0")

    def _round(self, kind: str, status: int, payload: bytes, same_length: bool) -> list[bytes]:
        """Post this rank's frame under its next number, wait (bounded) for every rank's frame
        of that number, and check them: one payload per rank. A refusal only posts."""
        what = f"symcomm's {kind!r} exchange"
        if self.broken is not None:
            raise CommTimeoutError(self.broken)
        frame = _frame(kind, status, payload)
        if self._store is None:
            table = [frame]
        else:
            table = self._post_and_collect(frame, status, what)
            if table is None:
                return []
        return self._verdict(kind, table, same_length)

    def _post_and_collect(self, frame: bytes, status: int, what: str) -> list[bytes] | None:
        store = self._store
        turn = 0
        keys: list[str] = []
        try:
            # The per-rank counter lives in the store, not in this process: every communicator
            # of the group draws from it, so all of them are one sequence, as the group's
            # all-gathers were (ranks in different communicators' exchanges meet and are told).
            turn = store.add(f"turn/{self.rank}", 1)
            store.set(f"{turn}/{self.rank}", frame)
            self._posted.append(turn)
            if status != OK:
                return None
            keys = [f"{turn}/{r}" for r in range(self.world_size)]
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
            table = store.multi_get(keys)
        except RuntimeError as exc:  # DistStoreError (a timeout), DistNetworkError (a peer gone)...
            raise self._give_up(what, exc, self._missing(keys)) from None
        # Every rank posted this number, so each has finished reading the ones before it: this
        # rank's older frames can go (the store keeps only what a late reader may need).
        for old in [t for t in self._posted if t < turn]:
            try:
                store.delete_key(f"{old}/{self.rank}")
            except RuntimeError:
                pass  # a leftover key costs a few bytes; the exchange itself succeeded
        self._posted = [turn]
        self._turn = turn
        return table

    def _missing(self, keys: list[str]) -> list[int]:
        """The ranks whose frame is not in the store (best effort: [] if the store is gone)."""
        try:
            return [r for r, key in enumerate(keys) if not self._store.check([key])]
        except RuntimeError:
            return []

    def _verdict(self, kind: str, table: list[bytes], same_length: bool) -> list[bytes]:
        frames = [_unframe(raw) for raw in table]
        refused = {r: payload.decode("utf-8", "replace") for r, (_, status, payload) in enumerate(frames)
                   if status != OK}
        if refused:
            raise PeerRefusal(kind, refused)
        kinds = [k if k is not None else "(not a symcomm frame)" for k, _, _ in frames]
        if any(k != kinds[0] for k in kinds):
            per_rank = ", ".join(f"rank {r}: {k!r}" for r, k in enumerate(kinds))
            raise PeerMismatchError(f"ranks are in different symcomm exchanges ({per_rank}): every rank must "
                                    f"make the same symcomm calls (construction included) in the same order")
        lengths = [len(payload) // 8 for _, _, payload in frames]
        if same_length and any(n != lengths[0] for n in lengths):
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            raise PeerMismatchError(f"ranks sent different numbers of values in symcomm's {kind!r} exchange "
                                    f"({per_rank})")
        return [payload for _, _, payload in frames]

    # ------------------------------------------------------------------ collectives
    def collectives(self, device: torch.device) -> HostCollectives | GroupCollectives:
        """Collective on first use for the CPU: the torch path's collectives for ``device``.
        CPU tensors get a gloo group of symcomm's own, over the group's store, whose timeout is
        this communicator's: a collective abandoned past the timeout never stays queued on the
        user's group, and ends inside gloo when the wait gives up. CUDA tensors stay on the
        user's group (stream-ordered NCCL)."""
        if device.type != "cpu":
            return GroupCollectives(self.group)
        if self._host is None:
            if self.broken is not None:
                raise CommTimeoutError(self.broken)
            # A name no earlier group of this store used: the last exchange's number, equal on
            # every rank because every rank completed it.
            store = (dist.HashStore() if self._store is None else
                     dist.PrefixStore(f"gloo/{self._turn}/", self._store))
            try:
                backend = dist.ProcessGroupGloo(store, self.rank, self.world_size,
                                                datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:  # its rendezvous waits in the store, bounded by the timeout
                raise self._give_up("symcomm's gloo group for CPU collectives", exc, []) from None
            self._host = HostCollectives(backend)
        return self._host

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective's ``work`` on symcomm's gloo group at most the timeout. Any
        failure (the bound ran out, a peer's connection closed) is CommTimeoutError, for this
        and every later call: the ranks are out of step, and a later collective would meet a
        peer's abandoned one."""
        if self.broken is not None:
            raise CommTimeoutError(self.broken)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: "Operation timed out!", "Connection closed by peer"...
            raise self._give_up(what, exc, []) from None

    def _give_up(self, what: str, exc: BaseException, missing: list[int]) -> CommTimeoutError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            who = f"rank(s) {', '.join(map(str, missing))}" if missing else "a peer"
            cause = f"{who} did not arrive within {self.timeout_s:g} s (the communicator's timeout)"
        else:
            cause = f"a peer is gone or out of step ({type(exc).__name__}: {text})"
        self.broken = (f"{what}: {cause}; the ranks are no longer in step, so every later symcomm call on this "
                       f"communicator raises: close() it (nothing is left pending on your process group) and "
                       f"build a new one")
        return CommTimeoutError(self.broken)

    def close(self) -> None:
        # A ProcessGroup that outlives destroy_process_group() is torn down during interpreter
        # shutdown, where gloo's threads abort the process: hold none longer than needed. The
        # gloo group of our own goes now too: its destructor joins its threads while Python
        # still runs, and an abandoned collective in it has already ended (its timeout is ours).
        self.group = None
        self._host = None
        self._store = None
