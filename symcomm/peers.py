"""Peers: the host-side exchanges symcomm runs among the ranks of one group (setup votes, check
mode, graph-capture registration), each framed and bounded.

Every exchange is an all-gather of int64 vectors over the user's group, which every rank must
enter in the same order. Two rules keep a mistake from turning into a hang or a crash:

- **Framed.** The first round carries a fixed-size frame: what the exchange is (its kind), a
  status, the payload's length, and the first ``FRAME_INTS`` values. Ranks in different
  exchanges, or sending different lengths, all see it in that round and all raise
  PeerMismatchError naming each rank's side; gloo never sees tensors of unequal length. A
  longer payload follows in a second round once every rank knows its length.
- **Bounded.** Each round waits at most the communicator's timeout (``Work.wait(timeout)``).
  When it runs out, CommTimeoutError names the exchange, and the group's state is unknown (an
  all-gather may still be pending), so every later exchange raises the same error.

A rank that fails before an exchange its peers wait in (a bad argument in check mode, a
constructor that cannot go on) joins it with ``refuse(kind, reason)``: the peers raise with its
reason instead of waiting for it.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import CommTimeoutError, PeerMismatchError

MAGIC = 0x53594D43  # "SYMC": a frame from symcomm
FRAME_INTS = 64  # payload values carried in the first round
_KIND_INTS = 3  # an exchange's kind, up to 24 ASCII characters
_HEAD = 2 + _KIND_INTS + 1  # magic, kind, status, length
OK, REFUSED = 0, 1
_INT64 = (-(1 << 63), (1 << 63) - 1)

# (values, kind) -> one row per rank. Paths receive Peers.exchange as this.
Exchange = Callable[..., list[list[int]]]


class PeerRefusal(PeerMismatchError):
    """Peers refused the exchange (``Peers.refuse``): ``reasons`` maps each such rank to its
    reason. A PeerMismatchError, so callers that catch that see it too."""

    def __init__(self, kind: str, reasons: dict[int, str]) -> None:
        self.kind, self.reasons = kind, reasons
        super().__init__("; ".join(f"rank {r} could not take part in symcomm's {kind!r} exchange: {why}"
                                   for r, why in reasons.items()))


def _kind_ints(kind: str) -> list[int]:
    raw = kind.encode("ascii", "replace")[:_KIND_INTS * 8].ljust(_KIND_INTS * 8, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _kind_text(values: Sequence[int]) -> str:
    return b"".join(int(v).to_bytes(8, "little", signed=True) for v in values).rstrip(b"\0").decode(
        "ascii", "replace")


def text_ints(text: str, count: int = FRAME_INTS) -> list[int]:
    """``text`` (UTF-8, cut to fit) as ``count`` int64 values, for a refusal's reason."""
    raw = text.encode("utf-8", "replace")[:count * 8].ljust(count * 8, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def ints_text(values: Sequence[int]) -> str:
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in values).rstrip(b"\0")
    return raw.decode("utf-8", "replace")


class Peers:
    """The ranks of one group. Never on the per-call path of a collective (check mode aside):
    every method is a blocking collective over the user's torch.distributed group."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group: dist.ProcessGroup | None = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        # gloo carries CPU tensors only; a group with only an NCCL backend takes the current
        # CUDA device (as torch.distributed would).
        gloo = "gloo" in str(dist.get_backend(group))
        self.device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.broken: str | None = None  # set once a wait ran out: later exchanges raise it

    # ------------------------------------------------------------------ exchanges
    def exchange(self, values: Sequence[int], kind: str = "setup") -> list[list[int]]:
        """All-gather ``values`` (ints in int64) among the ranks: row r is rank r's. ``kind``
        names the exchange; every rank must be in the same one with the same length, else all
        raise PeerMismatchError. A rank that refused (``refuse``) makes the others raise with
        its reason."""
        values = [int(v) for v in values]
        if any(not _INT64[0] <= v <= _INT64[1] for v in values):
            # Joined as a refusal so no peer waits in this exchange for a frame that never comes.
            self.refuse(kind, "a value does not fit in int64")
            raise OverflowError(f"symcomm's {kind!r} exchange: a value does not fit in int64")
        return self._round(kind, OK, values)

    def agree(self, kind: str, what: str, named: dict[str, int]) -> None:
        """Exchange ``named`` values that must be equal on every rank; all raise the same
        PeerMismatchError naming the first that differs, with every rank's value."""
        rows = self.exchange(list(named.values()), kind)
        for i, name in enumerate(named):
            if any(row[i] != rows[0][i] for row in rows):
                per_rank = ", ".join(f"rank {r}: {row[i]}" for r, row in enumerate(rows))
                raise PeerMismatchError(f"{what}: ranks disagree on {name} ({per_rank})")

    def refuse(self, kind: str, reason: str) -> None:
        """Join the exchange the peers wait in as a rank that cannot go on: they raise
        PeerMismatchError with ``reason``; this rank raises its own error after. Best effort:
        a peer that is elsewhere (or gone) leaves this waiting at most the timeout."""
        try:
            self._round(kind, REFUSED, text_ints(reason))
        except (PeerMismatchError, CommTimeoutError):
            pass

    def _round(self, kind: str, status: int, values: list[int]) -> list[list[int]]:
        head = [MAGIC, *_kind_ints(kind), status, len(values)]
        first = values[:FRAME_INTS]
        table = self._all_gather(head + first + [0] * (FRAME_INTS - len(first)), kind)
        if status != OK:
            return []
        refused = {r: ints_text(row[_HEAD:]) for r, row in enumerate(table) if row[_HEAD - 2] != OK}
        if refused:
            raise PeerRefusal(kind, refused)
        kinds = [_kind_text(row[1:1 + _KIND_INTS]) if row[0] == MAGIC else "(not a symcomm frame)" for row in table]
        if any(k != kinds[0] for k in kinds):
            per_rank = ", ".join(f"rank {r}: {k!r}" for r, k in enumerate(kinds))
            raise PeerMismatchError(f"ranks are in different symcomm exchanges ({per_rank}): every rank must "
                                    f"make the same symcomm calls (construction included) in the same order")
        lengths = [row[_HEAD - 1] for row in table]
        if any(n != lengths[0] for n in lengths):
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            raise PeerMismatchError(f"ranks sent different numbers of values in symcomm's {kind!r} exchange "
                                    f"({per_rank})")
        rows = [row[_HEAD:_HEAD + len(first)] for row in table]
        if len(values) > FRAME_INTS:
            rest = self._all_gather(values[FRAME_INTS:], kind)
            rows = [a + b for a, b in zip(rows, rest)]
        return rows

    def _all_gather(self, values: list[int], kind: str) -> list[list[int]]:
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        self.wait(dist.all_gather(gathered, local, group=self.group, async_op=True), f"symcomm's {kind!r} exchange")
        return [row.tolist() for row in gathered]

    def broadcast(self, data: bytes | None, nbytes: int) -> bytes:
        """Rank 0's ``nbytes`` bytes on every rank (other ranks pass None), bounded like an
        exchange. A plain uint8 broadcast: broadcast_object_list would need numpy."""
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if self.rank == 0 and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.wait(dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group, async_op=True),
                  "symcomm's broadcast of the NCCL unique id")
        return bytes(buf.tolist())

    def wait(self, work: Any, what: str) -> None:
        """Wait for a torch.distributed ``work`` at most the timeout; CommTimeoutError after,
        for this and every later exchange (the group then has an operation still pending)."""
        if self.broken is not None:
            raise CommTimeoutError(self.broken)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: "Operation timed out!"; NCCL: DistBackendError
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            self.broken = (f"{what}: a peer did not arrive within {self.timeout_s:g} s (the communicator's "
                           f"timeout); the group may still hold a pending operation, so every later symcomm call "
                           f"on this communicator raises: close() it and build a new one")
            raise CommTimeoutError(self.broken) from None

    def close(self) -> None:
        # A ProcessGroup that outlives destroy_process_group() is torn down during interpreter
        # shutdown, where gloo's threads abort the process: hold it no longer than needed.
        self.group = None
