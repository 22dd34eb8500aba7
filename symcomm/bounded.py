"""Blocking native calls that wait on peers, given up after a bound instead of hanging; and
the list of what a communicator's timeout bounds, which capabilities() and the README state."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .errors import CommTimeoutError


def bounded(what: str, fn: Callable[[], Any], timeout_s: float, device: torch.device | None) -> Any:
    """Run ``fn`` in a helper thread and raise CommTimeoutError after ``timeout_s``.

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


# What Communicator(timeout_s=...) / SYMCOMM_TIMEOUT_S bounds, and what it does not. Each entry
# names the wait and who gives up when the bound runs out.
BOUNDED_WAITS = (
    "every host-side exchange of symcomm's with its peers: the constructor's votes, check mode, "
    "graph_capture() registration, reserve_symmetric(), through the group's store, never queued on the "
    "group (peers.Peers; CommTimeoutError)",
    "NCCL communicator setup and teardown, close() (CommTimeoutError; the paths are aborted)",
    "the descriptor channel that maps peers' pool memory (setup falls back to staging)",
    "every barrier and wait of symcomm's own kernels (the kernel gives up; the next call raises "
    "CommTimeoutError)",
    "collectives of the torch path over gloo, i.e. CPU tensors, on a gloo group of symcomm's own whose "
    "timeout is the same (CommTimeoutError, also when a peer is gone)",
)
UNBOUNDED_WAITS = (
    "NCCL collectives on symcomm's own NCCL communicators (paths nccl and nccl-symm): NCCL itself "
    "waits for a missing peer; the kernel stays in the stream until close() times out and aborts the "
    "communicator, which stops NCCL's symmetric kernels only from NCCL 2.29.7 "
    "(capabilities()['nccl']['features']['abortable_symmetric_kernels'])",
    "collectives of the torch path on CUDA tensors: the process group's own timeout (its watchdog) "
    "bounds them",
    "the caller's own torch.distributed calls",
)
