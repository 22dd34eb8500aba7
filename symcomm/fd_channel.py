"""Passing file descriptors (GPU memory exports) between the ranks of one host, and only them.

The custom kernels map each peer's symmetric-pool regions from POSIX file descriptors, which
travel over Unix datagram sockets (SCM_RIGHTS). A descriptor hands over the memory it exports,
so both ends must be sure who is on the other side:

- Each rank binds its socket under a random 128-bit abstract name before telling anyone, and
  announces (name, pid, uid) over the process group. A name that cannot be predicted cannot be
  bound first by another local process, and once bound it is taken: a send to it reaches that
  rank only.
- The receiving socket has SO_PASSCRED on, so the kernel attaches every sender's real pid and
  uid (SCM_CREDENTIALS), which the sender cannot forge without privileges. A message is taken
  only if its sender address, pid and uid are those announced by the rank it claims to come
  from, and only once per rank; anything else is closed, counted and ignored.
"""
from __future__ import annotations

import array
import os
import secrets
import socket
import struct
import time

_PREFIX = b"\0symcomm-"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_HEADER = struct.Struct("<q")  # the sender's rank, ahead of the caller's payload
IDENTITY_INTS = 4  # name (two 64-bit halves), pid, uid


class Identity:
    """Who a rank's socket belongs to: its abstract name, pid and uid."""

    __slots__ = ("name", "pid", "uid")

    def __init__(self, name: bytes, pid: int, uid: int) -> None:
        self.name, self.pid, self.uid = name, pid, uid

    def to_ints(self) -> list[int]:
        """Four ints that fit int64 (the process group exchanges int64 tensors): the token's
        halves are sent as signed 64-bit values and masked back by from_ints."""
        token = int(self.name[len(_PREFIX):], 16)
        halves = [token >> 64, token & ((1 << 64) - 1)]
        return [h - (1 << 64) if h >= 1 << 63 else h for h in halves] + [self.pid, self.uid]

    @classmethod
    def from_ints(cls, values: list[int]) -> "Identity":
        high, low, pid, uid = values
        # the halves travel as int64: mask back to the unsigned 64-bit pieces of the token
        token = ((high & ((1 << 64) - 1)) << 64) | (low & ((1 << 64) - 1))
        return cls(_PREFIX + f"{token:032x}".encode(), pid, uid)


class FdChannel:
    """One rank's end. Build it, announce ``identity`` to the peers (a collective the caller
    runs), ``meet`` them with what they announced, then ``send`` and ``receive``."""

    def __init__(self, timeout_s: float) -> None:
        self.dropped = 0  # messages refused: wrong sender address, credentials, rank or repeat
        self._timeout_s = timeout_s
        self._peers: dict[int, Identity] = {}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            name = _PREFIX + secrets.token_hex(16).encode()
            sock.bind(name)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.identity = Identity(name, os.getpid(), os.getuid())

    def meet(self, peers: dict[int, Identity]) -> None:
        """The identities the other ranks announced, by rank."""
        self._peers = dict(peers)

    def send(self, rank: int, to: int, payload: bytes, fds: list[int]) -> None:
        """Send ``payload`` and ``fds`` to rank ``to``, stamped as coming from ``rank``."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self._sock.sendmsg([_HEADER.pack(rank) + payload], ancillary, 0, self._peers[to].name)

    def receive(self, max_fds: int, max_payload: int = 64) -> dict[int, tuple[bytes, list[int]]]:
        """One message from every met peer: rank -> (payload, fds). The caller owns (and must
        close) the descriptors it gets. Raises TimeoutError if a peer's message has not
        arrived within the channel's timeout; messages that fail the checks never count."""
        got: dict[int, tuple[bytes, list[int]]] = {}
        deadline = time.monotonic() + self._timeout_s
        space = socket.CMSG_SPACE(max_fds * 4) + socket.CMSG_SPACE(_UCRED.size)
        while len(got) < len(self._peers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self._peers) - set(got))
                raise TimeoutError(f"no descriptors from rank(s) {missing} within {self._timeout_s:.0f} s "
                                   f"({self.dropped} message(s) from other senders refused)")
            self._sock.settimeout(left)
            try:
                data, ancillary, _, address = self._sock.recvmsg(_HEADER.size + max_payload, space)
            except socket.timeout:
                continue
            fds, cred = _parse(ancillary)
            sender = _HEADER.unpack_from(data)[0] if len(data) >= _HEADER.size else -1
            expected = self._peers.get(sender)
            if (expected is None or sender in got or address != expected.name or cred is None
                    or cred[:2] != (expected.pid, expected.uid)):
                self.dropped += 1
                for fd in fds:
                    os.close(fd)
                continue
            got[sender] = (data[_HEADER.size:], fds)
        return got

    def close(self) -> None:
        self._sock.close()


def _parse(ancillary) -> tuple[list[int], tuple[int, int, int] | None]:
    fds: list[int] = []
    cred = None
    for level, kind, data in ancillary:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += array.array("i", data[:usable]).tolist()
        elif kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            cred = _UCRED.unpack_from(data)
    return fds, cred
