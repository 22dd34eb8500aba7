"""Memory-handle descriptors reach only the intended peer processes (symcomm/fd_channel.py).

Real Unix sockets and real descriptors (of temporary files standing in for GPU memory
exports), on CPU: the intended peer gets them; a process that is not a rank can neither
receive a rank's descriptors nor get one of its own accepted; and a process of another user can
neither stall a rank (by filling its socket) nor receive from it (by binding a closed rank's
address). The other-user tests fork a child that drops to ``nobody``, which needs root (CI runs
as root); elsewhere they skip, saying so.
"""
from __future__ import annotations

import os
import pwd
import select
import socket
import stat
import struct
import tempfile
import threading
import time

import pytest
import torch

from symcomm.fd_channel import FdChannel, Identity


def _file_fd(content: bytes) -> int:
    fd, path = tempfile.mkstemp()
    os.write(fd, content)
    os.unlink(path)
    return fd


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 100)


@pytest.fixture
def pair():
    a, b = FdChannel(timeout_s=2.0), FdChannel(timeout_s=2.0)
    a.meet({1: b.identity})
    b.meet({0: a.identity})
    yield a, b
    a.close()
    b.close()


def test_descriptors_reach_the_announced_peer(pair):
    a, b = pair
    fd = _file_fd(b"region of rank 1")
    b.send(1, 0, b"hdr", [fd])
    os.close(fd)
    got = a.receive(max_fds=1)
    assert list(got) == [1] and got[1][0] == b"hdr"
    (received,) = got[1][1]
    assert _read(received) == b"region of rank 1" and a.dropped == 0
    os.close(received)


def test_the_socket_sits_in_a_directory_only_its_owner_can_enter(pair):
    a, _ = pair
    folder = os.path.dirname(a.identity.path.decode())
    info = os.stat(folder)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    a.close()
    assert not os.path.exists(folder)  # close() leaves nothing behind


def test_identities_survive_the_int64_exchange():
    """The identity travels as a torch int64 tensor (Peers.exchange): every value must fit."""
    for _ in range(16):
        ch = FdChannel(timeout_s=1.0)
        sent = torch.tensor(ch.identity.to_ints(), dtype=torch.int64).tolist()
        back = Identity.from_ints(sent)
        assert (back.path, back.pid, back.uid) == (ch.identity.path, os.getpid(), os.getuid())
        ch.close()


def test_a_sender_whose_credentials_differ_from_the_announcement_is_refused(pair):
    a, b = pair
    forged = Identity(b.identity.path, b.identity.pid + 1, b.identity.uid)  # announced another pid
    a.meet({1: forged})
    fd = _file_fd(b"x")
    b.send(1, 0, b"", [fd])
    os.close(fd)
    a._timeout_s = 0.5
    with pytest.raises(TimeoutError, match="1 connection"):
        a.receive(max_fds=1)
    assert a.dropped == 1


def test_a_sender_refuses_a_listener_that_is_not_the_announced_process(pair):
    """The receiver's address announced with another pid (as if the rank had died and someone
    else were listening there): the sender checks before anything leaves."""
    a, b = pair
    b.meet({0: Identity(a.identity.path, a.identity.pid + 1, a.identity.uid)})
    fd = _file_fd(b"secret")
    with pytest.raises(PermissionError, match="not the announced"):
        b.send(1, 0, b"", [fd])
    os.close(fd)
    a._timeout_s = 0.3
    with pytest.raises(TimeoutError):
        a.receive(max_fds=1)


def test_a_message_stamped_with_another_rank_is_refused(pair):
    """A peer may only speak for itself: its credentials say which rank it is. A second process
    (rank 2 here) that claims to be rank 1 is refused, and rank 1's own message still counts."""
    a, b = pair
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # rank 2: connects and claims to be rank 1
        try:
            os.read(read_end, 1)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(a.identity.path)
                s.sendmsg([struct.pack("<q", 1) + b"forged"])
        finally:
            os._exit(0)
    a.meet({1: b.identity, 2: Identity(b"/nonexistent", pid, os.getuid())})
    os.write(write_end, b"g")
    os.waitpid(pid, 0)
    fd = _file_fd(b"x")
    b.send(1, 0, b"real", [fd])
    os.close(fd)
    a._timeout_s = 1.0
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\].*1 connection"):
        a.receive(max_fds=1)
    assert a.dropped == 1


def test_a_missing_peer_is_a_timeout_not_a_hang():
    a = FdChannel(timeout_s=0.5)
    b = FdChannel(timeout_s=0.5)
    a.meet({1: b.identity})
    b.close()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        a.receive(max_fds=1)
    with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
        a.send(0, 1, b"", [])  # nobody listens there any more
    assert time.monotonic() - start < 5
    a.close()


# ------------------------------------------------------------------------- another user
def _as_nobody(work, timeout_s: float = 20.0) -> tuple[int, int, float]:
    """Start ``work()`` (returns bytes) in a forked child that has become ``nobody``; _collect()
    returns what it wrote back. Forking keeps this independent of whether nobody may execute
    our Python."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process of another user (CI runs as root)")
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write_end, work())
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            os.write(write_end, f"child failed: {exc!r}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    return read_end, pid, timeout_s


def _collect(handle) -> bytes:
    read_end, pid, timeout_s = handle
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not select.select([read_end], [], [], 0.2)[0]:
            continue
        chunk = os.read(read_end, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return b"".join(chunks)


def _flood(path: bytes):
    def work() -> bytes:
        # What an attacker of the datagram design did: fill the rank's receive queue so that a
        # blocking send to it never returns. Here it has to connect first.
        results = []
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM, socket.SOCK_DGRAM):
            for _ in range(200):
                s = socket.socket(socket.AF_UNIX, kind)
                s.setblocking(False)
                try:
                    if kind == socket.SOCK_DGRAM:
                        s.sendto(b"x" * 200, path)
                    else:
                        s.connect(path)
                        s.send(b"x" * 200)
                    results.append("ok")
                except OSError as exc:
                    results.append(type(exc).__name__)
                finally:
                    s.close()
        return ",".join(sorted(set(results))).encode()
    return work


def test_another_user_cannot_stall_a_send_by_flooding_the_receiver(pair):
    """The flood that blocked Communicator() forever on the datagram design: a process of another
    uid fills rank 0's socket before rank 1 sends. Now it cannot even connect, and the exchange
    finishes well inside the channel's timeout."""
    a, b = pair
    flood = _collect(_as_nobody(_flood(a.identity.path)))
    assert b"ok" not in flood.split(b",") and flood, flood  # every attempt was refused
    done = {}

    def exchange():
        fd = _file_fd(b"after the flood")
        b.send(1, 0, b"hdr", [fd])
        os.close(fd)
        done["got"] = a.receive(max_fds=1)

    worker = threading.Thread(target=exchange, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the send or receive hung after another user's flood"
    (fd,) = done["got"][1][1]
    assert _read(fd) == b"after the flood"
    os.close(fd)


def _squat(path: bytes):
    def work() -> bytes:
        # A closed rank's directory is gone; another user recreates it and listens at the
        # same address, hoping for the next descriptor.
        os.mkdir(os.path.dirname(path))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Bound and listening under a side name, then renamed into place: the address appears
        # only once it accepts, so the rank's connect never races the listen() (which it did,
        # refused, once in CI on a loaded machine).
        s.bind(path + b".pending")
        s.listen(8)
        os.rename(path + b".pending", path)
        s.settimeout(4.0)
        got = b"nothing"
        try:
            conn, _ = s.accept()
            conn.settimeout(2.0)
            data, anc, _, _ = conn.recvmsg(256, socket.CMSG_SPACE(16))
            if data or anc:  # the sender connects, checks who listens, and hangs up: an empty read
                got = b"received " + struct.pack("<q", len(data)) + (b" with fds" if anc else b"")
        except OSError:
            pass
        return got
    return work


def test_a_rebound_address_receives_nothing(pair):
    a, b = pair
    path = a.identity.path
    a.close()
    squatter = _as_nobody(_squat(path))
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(path), "the other user could not bind the address (test setup)"
    fd = _file_fd(b"secret")
    with pytest.raises(PermissionError, match="not the announced"):
        b.send(1, 0, b"hdr", [fd])
    os.close(fd)
    assert _collect(squatter) == b"nothing"
