"""Passing file descriptors (GPU memory exports) between the ranks of one host, and only them.

The custom kernels map each peer's symmetric-pool regions from POSIX file descriptors, which
travel over Unix sockets (SCM_RIGHTS). A descriptor hands over the memory it exports, so no
other local user may receive one, and none may stall a rank that sends or receives one
(docs/architecture.md, "The descriptor channel", weighs the alternatives):

- Each rank listens on a SOCK_SEQPACKET socket at a filesystem path inside a directory of its
  own, created mode 0700 (tempfile.mkdtemp). Another uid cannot search that directory, so it can
  neither connect to the socket (and fill its backlog) nor bind the path. An abstract socket,
  which this replaced, has no permissions at all: anyone could send to it.
- Both ends check the kernel's credentials of the connection (SO_PEERCRED), which a process
  cannot forge: the sender connects and sends only if the listener is the pid and uid the rank
  announced, so a socket rebound by someone else after a rank closed its own gets nothing; the
  receiver takes a message only from a connection whose pid and uid are those of the rank the
  message claims to come from, and only once per rank.
- Every step (connect, send, accept, receive) is bounded by the channel's deadline, so a peer
  that never arrives, or a full backlog, ends in TimeoutError, never a hang.

A process of the same uid is not kept out: it could read this process's memory anyway.
"""
from __future__ import annotations

import array
import os
import select
import shutil
import socket
import struct
import tempfile
import time

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_HEADER = struct.Struct("<q")  # the sender's rank, ahead of the caller's payload
_PATH_INTS = 14  # sun_path holds 108 bytes: a path of at most 107 travels as 14 int64 values
IDENTITY_INTS = _PATH_INTS + 2  # path, pid, uid


class Identity:
    """Who a rank's socket belongs to: its path, pid and uid."""

    __slots__ = ("path", "pid", "uid")

    def __init__(self, path: bytes, pid: int, uid: int) -> None:
        self.path, self.pid, self.uid = path, pid, uid

    def to_ints(self) -> list[int]:
        """IDENTITY_INTS ints that fit int64 (the process group exchanges int64 tensors)."""
        raw = self.path.ljust(_PATH_INTS * 8, b"\0")
        return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)] + [self.pid,
                                                                                                        self.uid]

    @classmethod
    def from_ints(cls, values: list[int]) -> "Identity":
        raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in values[:_PATH_INTS])
        return cls(raw.rstrip(b"\0"), int(values[_PATH_INTS]), int(values[_PATH_INTS + 1]))


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket, from the kernel."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


class FdChannel:
    """One rank's end. Build it, announce ``identity`` to the peers (a collective the caller
    runs), ``meet`` them with what they announced, then ``send`` and ``receive``."""

    def __init__(self, timeout_s: float, directory: str | None = None) -> None:
        self.dropped = 0  # connections refused: wrong credentials, rank, or a repeat
        self._timeout_s = timeout_s
        self._peers: dict[int, Identity] = {}
        self._dir = tempfile.mkdtemp(prefix="symcomm-", dir=directory)  # mode 0700, owned by us
        path = os.path.join(self._dir, "s").encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if len(path) > _PATH_INTS * 8 - 1:
                raise OSError(f"socket path {path!r} is longer than a Unix socket address allows")
            sock.bind(path)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._sock = sock
        self.identity = Identity(path, os.getpid(), os.getuid())

    def meet(self, peers: dict[int, Identity]) -> None:
        """The identities the other ranks announced, by rank."""
        self._peers = dict(peers)

    def _left(self, deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} did not finish within {self._timeout_s:g} s")
        return left

    def send(self, rank: int, to: int, payload: bytes, fds: list[int]) -> None:
        """Send ``payload`` and ``fds`` to rank ``to``, stamped as coming from ``rank``, once the
        listener is proven to be the process rank ``to`` announced. Raises TimeoutError past
        the channel's timeout, PermissionError if someone else holds the peer's socket."""
        peer = self._peers[to]
        deadline = time.monotonic() + self._timeout_s
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            try:
                sock.settimeout(self._left(deadline, f"connecting to rank {to}"))
                sock.connect(peer.path)
                held_by = peer_credentials(sock)
                if held_by != (peer.pid, peer.uid):
                    raise PermissionError(f"rank {to}'s socket is held by pid {held_by[0]} uid {held_by[1]}, not "
                                          f"the announced pid {peer.pid} uid {peer.uid}: nothing was sent")
                sock.settimeout(self._left(deadline, f"sending to rank {to}"))
                sock.sendmsg([_HEADER.pack(rank) + payload], ancillary)
            except socket.timeout:
                raise TimeoutError(f"sending descriptors to rank {to} did not finish within "
                                   f"{self._timeout_s:g} s") from None

    def receive(self, max_fds: int, max_payload: int = 64) -> dict[int, tuple[bytes, list[int]]]:
        """One message from every met peer: rank -> (payload, fds). The caller owns (and must
        close) the descriptors it gets. Raises TimeoutError if a peer's message has not arrived
        within the channel's timeout; connections that fail the checks never count."""
        got: dict[int, tuple[bytes, list[int]]] = {}
        deadline = time.monotonic() + self._timeout_s
        ranks_of: dict[tuple[int, int], set[int]] = {}
        for rank, peer in self._peers.items():
            ranks_of.setdefault((peer.pid, peer.uid), set()).add(rank)
        space = socket.CMSG_SPACE(max_fds * 4)
        while len(got) < len(self._peers):
            left = deadline - time.monotonic()
            if left <= 0:
                for _, fds in got.values():
                    for fd in fds:
                        os.close(fd)
                missing = sorted(set(self._peers) - set(got))
                raise TimeoutError(f"no descriptors from rank(s) {missing} within {self._timeout_s:g} s "
                                   f"({self.dropped} connection(s) from other processes refused)")
            if not select.select([self._sock], [], [], left)[0]:
                continue
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                continue
            with conn:
                allowed = ranks_of.get(peer_credentials(conn), set()) - set(got)
                if not allowed:
                    self.dropped += 1
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    data, ancillary, _, _ = conn.recvmsg(_HEADER.size + max_payload, space)
                except (socket.timeout, OSError):
                    self.dropped += 1
                    continue
            fds = _fds(ancillary)
            rank = _HEADER.unpack_from(data)[0] if len(data) >= _HEADER.size else -1
            if rank not in allowed:
                self.dropped += 1
                for fd in fds:
                    os.close(fd)
                continue
            got[rank] = (data[_HEADER.size:], fds)
        return got

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _fds(ancillary) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += array.array("i", data[:usable]).tolist()
    return fds
