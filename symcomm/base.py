"""The vocabulary every module shares: op names, the validated call, and the path interface.
It imports nothing of symcomm's at run time, so any module may import it.

A *path* is one way to run an operation (plain NCCL, NCCL on symmetric windows, one of
symcomm's kernels, torch.distributed, a fused or composite form of an operation). Each is one
object with its whole life:

    open(setup)        collective; returns None, or the reason it is off (the same on every rank)
    add_region(region) collective; the symmetric pool grew by one registered region
    begin_capture() / end_capture(failed)   around a CUDA-graph capture (Communicator.graph_capture)
    why_not(call)      per call: None if it can serve the call, else the reason, for people
    run(call)          per call: enqueue on the current stream (CUDA) or run (CPU)
    skip(call)         per call, instead of run() for an empty call its operation skips
    refuse(reason)     per call, instead of run() for a call this rank refused before communicating
    ops                the operations whose dispatch lists it (the collectives by default)
    compared_offsets(call)  which tensors check mode compares the pool offsets of
    close() / abort()  teardown, bounded by the Communicator; abort() after a timeout
    alarm              None, or an Alarm the path's kernels set when they gave up on a peer

Every collective step of a path's life runs on every rank in the same order, so a path that
must give up votes first (peers.Peers.exchange) and gives up everywhere.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .operations.base import Dispatcher
    from .peers import Peers

OPS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "all_to_allv")  # the collectives
SCATTERING_OPS = frozenset({"reduce_scatter", "reduce_scatterv"})

# The paths symcomm ships, in the order a Communicator opens them (symcomm.backends.PATHS).
NCCL, NCCL_SYMM, TORCH = "nccl", "nccl-symm", "torch"
FLAGFREE, ONESHOT, TWOSHOT = "custom-flagfree", "custom-oneshot", "custom-twoshot"
PUSH = "custom-push"
TWOSHOT_PUSH = "custom-twoshot-push"

# The current cudaStream_t as an int, without building a torch.cuda.Stream (about 1 us saved per
# eager call). Absent from CPU builds, where nothing that launches GPU work is opened.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_stream_capturing = torch.cuda.is_current_stream_capturing


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never, for a CPU device):
    the one test every module asks."""
    return (device is None or device.type == "cuda") and _stream_capturing()

class Alarm:
    """A word in host memory that a path's kernels set, instead of trapping, when they give up
    waiting for a peer. The Communicator reads ``word.value`` before every call (no CUDA call,
    no synchronisation) and, once it is set, raises CommTimeoutError with ``reason()``."""

    def __init__(self, word: Any, describe: Callable[[int], str]) -> None:
        self.word = word  # anything with an int .value, e.g. a ctypes.c_uint64 over mapped memory
        self._describe = describe

    def reason(self) -> str | None:
        code = self.word.value
        return self._describe(code) if code else None


class Call:
    """One validated collective call. Built per call, so it stays a bag of slots.

    ``inputs[i]`` pairs with ``outputs[i]`` (several only for all_gatherv); ``in_ptrs`` and
    ``out_ptrs`` are their data pointers, read once by the validator. ``sizes`` holds per-rank
    row counts for the v-variants and is None otherwise; ``redop`` is None for gathers.
    ``nbytes`` is the size that selects a path: the tensor for all_reduce, the whole output for
    gathers, the whole input for reduce-scatters (nccl-tests' convention, so tuning tables read
    like its output). ``op`` is also the dispatch table's row: in place or not, every call of an
    op reads the same row (rank-local facts must not choose the path: dispatch.py says why).
    """

    __slots__ = ("op", "inputs", "outputs", "in_ptrs", "out_ptrs", "sizes", "redop", "nbytes", "dtype",
                 "single", "symmetric")

    def __init__(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 in_ptrs: Sequence[int], out_ptrs: Sequence[int], sizes: list[int] | None,
                 redop: str | None, nbytes: int) -> None:
        self.op = op
        self.inputs = inputs
        self.outputs = outputs
        self.in_ptrs = in_ptrs
        self.out_ptrs = out_ptrs
        self.sizes = sizes
        self.redop = redop
        self.nbytes = nbytes
        self.dtype = inputs[0].dtype
        self.single = True  # all_gatherv: given one tensor (not a list), so it returns one
        self.symmetric: bool | None = None  # memo of the symmetric path's window test (backends/nccl.py)

    def named_outputs(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors the call writes, named as the caller's arguments are."""
        if self.single and len(self.outputs) == 1:
            return [("out", self.outputs[0])]
        return [(f"out[{i}]", t) for i, t in enumerate(self.outputs)]

    @property
    def even(self) -> bool:
        """True unless a v-variant has unequal per-rank sizes."""
        sizes = self.sizes
        return sizes is None or sizes.count(sizes[0]) == len(sizes)


def runner_table(namespace: dict) -> dict:
    """op -> the class's ``_<op>`` function, from a class body's namespace (``locals()``).

    Kept on the class, unbound: a dict of bound methods on the instance would form a
    reference cycle that keeps the process group alive past destroy_process_group()."""
    return {op: namespace[f"_{op}"] for op in OPS}


class Setup:
    """What a path's open() may use: the peers, the device, the caller's options, the wait
    bound, the paths opened before it (by name, open ones only), and the Communicator as the
    Dispatcher a composite path runs its inner calls through."""

    def __init__(self, peers: Peers, device: torch.device, timeout_s: float, options: dict[str, Any],
                 dispatcher: Dispatcher | None = None) -> None:
        self.peers = peers
        self.dispatcher = dispatcher
        self.device = device
        self.timeout_s = timeout_s
        self.options = options
        self.opened: dict[str, Path] = {}
        self.off: dict[str, str] = {}  # paths that declined to open, with their reason
        # Native state that several paths of one communicator share (symcomm's three
        # all-reduce kernels share their mapped buffers), by a name their module chooses.
        self.shared: dict[str, Any] = {}


class Path:
    """Base of every path: the lifecycle steps default to nothing, so a path implements the
    ones it needs. See the module docstring for the contract."""

    name: str = ""
    # The symmetric kernels (NCCL's and symcomm's) read peers' tensors at this rank's window
    # offset: check mode compares the offsets across ranks only for paths that say so.
    needs_equal_offsets: bool = False
    equal_offsets: tuple[str, ...] = ("x", "out")  # which of them: inputs ("x"), outputs ("out")
    alarm: Alarm | None = None
    ops: frozenset[str] = frozenset(OPS)

    def compared_offsets(self, call: Call) -> tuple[str, ...]:
        """The tensors ("x" inputs, "out" outputs) whose pool offsets check mode compares for
        this call: those this path's kernels read or write at this rank's offset on peers."""
        return self.equal_offsets if self.needs_equal_offsets else ()

    def open(self, setup: Setup) -> str | None:
        return None

    def add_region(self, region: Any) -> None:
        pass

    def begin_capture(self) -> None:
        pass

    def discard_capture(self) -> None:
        """Forget a capture session without any collective (graph_capture() was misused)."""

    def end_capture(self, failed: bool) -> str | None:
        """After capture ended (collective): None, or a problem that makes the graph unsafe to
        replay (the same on every rank)."""
        return None

    def info(self) -> dict[str, Any]:
        """Sections this path adds to Communicator.capabilities()."""
        return {}

    def close(self) -> None:
        pass

    def abort(self) -> None:
        """close() timed out: release what can be released without peers."""

    def why_not(self, call: Call) -> str | None:
        raise NotImplementedError

    def run(self, call: Call) -> None:
        raise NotImplementedError

    def skip(self, call: Call) -> None:
        """Instead of run() for a call with no bytes that its operation skips: nothing moves. A
        path whose ranks compare every call before moving data (the torch path on CPU tensors)
        joins the comparison here, so a rank whose call alone is empty does not leave its peers
        waiting, or pair its next call with their current one."""

    def refuse(self, reason: str) -> None:
        """This rank's call failed before communicating (a broken argument rule, no path able to
        serve it), outside check mode, whose exchange carries refusals otherwise. A path whose
        ranks compare every call before moving data (the torch path on CPU tensors) joins that
        comparison with ``reason``, so peers making the call raise PeerMismatchError with it
        instead of pairing their call with this rank's next one. It waits for the peers to get
        there, at most the timeout. Every other path has no comparison to join."""


PathFactory = Callable[[], Path]
