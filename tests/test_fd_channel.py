"""Memory-handle descriptors reach only the intended peer processes (symcomm/fd_channel.py).

Real Unix sockets and real descriptors (of temporary files standing in for GPU memory
exports), on CPU: the intended peer gets them; a local process that is not a rank can neither
receive a rank's descriptors by binding a name first nor get one of its own accepted.
"""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import tempfile

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


def test_identities_survive_the_int64_exchange():
    """The identity travels as a torch int64 tensor (Peers.exchange): every value must fit, for
    any random token (half of them have a high bit set in some half)."""
    for _ in range(64):
        ch = FdChannel(timeout_s=1.0)
        sent = torch.tensor(ch.identity.to_ints(), dtype=torch.int64).tolist()
        back = Identity.from_ints(sent)
        assert (back.name, back.pid, back.uid) == (ch.identity.name, os.getpid(), os.getuid())
        ch.close()


def test_a_sender_whose_credentials_differ_from_the_announcement_is_refused(pair):
    a, b = pair
    forged = Identity(b.identity.name, b.identity.pid + 1, b.identity.uid)  # announced another pid
    a.meet({1: forged})
    fd = _file_fd(b"x")
    b.send(1, 0, b"", [fd])
    os.close(fd)
    a._timeout_s = 0.5
    with pytest.raises(TimeoutError, match="1 message"):
        a.receive(max_fds=1)
    assert a.dropped == 1


_INTRUDER = r"""
import array, os, socket, struct, sys
target = bytes.fromhex(sys.argv[1])
fd = os.open("/dev/null", os.O_RDONLY)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(b"\0intruder-" + str(os.getpid()).encode())
# claims to be rank 1, the way a real rank stamps its messages
s.sendmsg([struct.pack("<q", 1) + b"hdr"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, target)
"""


def test_a_process_that_is_not_a_rank_cannot_get_a_descriptor_accepted(pair):
    a, b = pair
    subprocess.run([sys.executable, "-c", _INTRUDER, a.identity.name.hex()], check=True, timeout=30)
    fd = _file_fd(b"the real one")
    b.send(1, 0, b"hdr", [fd])
    os.close(fd)
    got = a.receive(max_fds=1)
    assert a.dropped == 1  # the intruder's message, closed unread
    assert _read(got[1][1][0]) == b"the real one"
    os.close(got[1][1][0])


def test_a_process_that_is_not_a_rank_cannot_bind_a_name_first(pair):
    """Names are random per rank and bound before they are announced: an intruder can neither
    predict one nor take one that is in use, so a rank's send reaches only its peer."""
    a, b = pair
    assert a.identity.name != b.identity.name and len(a.identity.name) == len(b"\0symcomm-") + 32
    thief = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with pytest.raises(OSError) as err:
        thief.bind(a.identity.name)
    assert err.value.errno == errno.EADDRINUSE
    # the names the previous scheme derived from one shared random number: nothing goes there
    thief.bind(b"\0symcomm-" + os.urandom(4).hex().encode() + b"-0")
    thief.settimeout(0.3)
    fd = _file_fd(b"secret")
    b.send(1, 0, b"", [fd])
    os.close(fd)
    with pytest.raises(socket.timeout):
        thief.recvmsg(64, socket.CMSG_SPACE(4))
    got = a.receive(max_fds=1)
    assert _read(got[1][1][0]) == b"secret"
    os.close(got[1][1][0])
    thief.close()
