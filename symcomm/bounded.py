"""Blocking native calls that wait on peers, given up after a bound instead of hanging."""
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
