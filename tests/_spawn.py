"""Run a function on N gloo ranks in fresh processes, with a hard time bound.

Each rank runs ``fn(rank, world_size, *args)`` after init_process_group. A rank that raises
reports its traceback; a world that outlives ``timeout_s`` is killed and the test fails, so a
collective bug shows up as a failure, never as a hung CI job.

Ranks fork from a forkserver that has imported torch once: a spawned rank imports it again,
which on a GPU machine's CUDA build costs seconds per rank, hundreds of times per suite. The
server is a fresh process (it never touches CUDA, whatever the test process did), and a fork
from it sees the server's environment, so each rank takes the test's current one explicitly.
symcomm itself is imported in the rank, after that environment is in place.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback


_PRELOAD = ["torch", "torch.distributed"]


def _entry(fn, rank, world_size, port, args, results, environ):
    os.environ.clear()
    # The test process holds the store (as torchrun's agent does): every rank connects as a client.
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # a scenario may destroy it itself (the README's last line)
                dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, traceback.format_exc()))


def run_world(fn, world_size: int = 2, *args, timeout_s: float = 240.0, may_exit: frozenset[int] = frozenset()) -> None:
    """``may_exit``: ranks that may end their process without reporting (a test's dead peer);
    the others must finish as usual."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first world only
    results = ctx.Queue()
    # The store listens before any rank starts. (A free port picked here and bound later by rank 0
    # could be taken in between, by a rank's own connect retries among others: rank 0 then fails
    # to listen.)
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results, environ), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    failures, seen = {}, set()
    try:
        while not set(range(world_size)) - set(may_exit) <= seen:
            rank, error = results.get(timeout=timeout_s)
            seen.add(rank)
            if error:
                failures[rank] = error
    except Exception:  # queue.Empty: some rank never finished
        missing = sorted(set(range(world_size)) - seen - set(may_exit))
        failures.update({r: f"rank {r} did not finish within {timeout_s} s (hang?)" for r in missing})
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store  # every rank has ended: none waits on it
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(failures.items())))
