"""Communicator lifecycle on CPU over gloo: clean process exits, close() letting go of the
process group, and communicators over one-rank groups.

A closed Communicator that still holds its ProcessGroup keeps the group alive past
``dist.destroy_process_group()`` into interpreter shutdown. The group's gloo worker threads
then outlive the start of Python finalization; one that still has to drop a tensor's Python
object (the last collective's work, freed on the worker after the caller has moved on) asks
for the GIL, is told to exit by the finalizing interpreter (pthread_exit) inside a noexcept C++
destructor, and the process dies with "terminate called without an active exception"
(SIGABRT), in a fraction of runs. Destroying the group while Python is still running joins
those threads first, so a Communicator must not hold the group once closed.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import torch

import symcomm
from _spawn import run_world

ROOT = Path(__file__).resolve().parents[1]
# ~8 s each on 2 cores. The abort is a race: where reported it hit 4 to 7 runs of 10; on a 2-core
# CPU box, 1 to 2 of 10. So before a fix this test fails only sometimes; test (b) always does.
EXIT_LOOP_RUNS = 4


def _exit_loop() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("exit_loop", ROOT / "scripts" / "exit_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------- (a) clean exits
def test_readme_flow_exits_cleanly_under_torchrun():
    """The README flow (CPU) under torchrun at world 3, several times: every run exits 0 and
    no rank prints "terminate called" (the scripts/exit_loop.py check, fewer runs)."""
    loop = _exit_loop()
    failures = []
    for i in range(EXIT_LOOP_RUNS):
        ok, why, out = loop.run_once(3, timeout_s=120)
        if not ok:
            failures.append(f"--- run {i + 1}: {why} ---\n" + "\n".join(out.splitlines()[-25:]))
    assert not failures, (f"{len(failures)} of {EXIT_LOOP_RUNS} runs did not exit cleanly:\n"
                          + "\n".join(failures))


# ------------------------------------------------- (b) close() lets go of the process group
def _children(obj):
    """(label, child) for the references a Python-level holder can keep. Modules and classes
    are not entered (they reach everything, torch.distributed's own registry included), nor
    are functions' globals; closures, defaults and bound methods' selves are."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield f"[{k!r}]", v
            yield f".keys()<{k!r}>", k
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)):
            yield f"[{i}]", v
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
    elif isinstance(obj, types.FunctionType):
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield f".<closure {obj.__code__.co_freevars[i]}>", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        yield ".__defaults__", obj.__defaults__
        yield ".__kwdefaults__", obj.__kwdefaults__
    else:
        seen_attr = False
        if hasattr(obj, "__dict__") and isinstance(getattr(obj, "__dict__", None), dict):
            seen_attr = True
            for k, v in list(vars(obj).items()):
                yield f".{k}", v
        for klass in type(obj).__mro__:
            for slot in klass.__dict__.get("__slots__", ()):
                if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                    seen_attr = True
                    yield f".{slot}", getattr(obj, slot)
        if not seen_attr:
            for ref in gc.get_referents(obj):
                yield f".<{type(ref).__name__}>", ref


def _walk(root, target, depth: int = 6) -> tuple[list[str], dict[int, object]]:
    """Every path of at most ``depth`` steps from ``root`` to ``target`` through _children, and
    the objects seen on the way (by id)."""
    found, seen, frontier = [], {id(root): root}, [(root, "comm")]
    for _ in range(depth):
        nxt = []
        for obj, path in frontier:
            for label, child in _children(obj):
                if child is target:
                    found.append(path + label)
                elif (id(child) not in seen and child is not None
                      and not isinstance(child, (types.ModuleType, type, str, bytes, int, float, bool))):
                    seen[id(child)] = child
                    nxt.append((child, path + label))
        frontier = nxt
    return found, seen


def _holders(comm, group) -> list[str]:
    """The attribute paths by which ``comm`` reaches ``group``. Walked from the Communicator
    rather than read off gc.get_referrers(group): a ProcessGroup is not a GC-tracked object, so
    a holder whose values are all untracked (an instance __dict__ of ints and the group, say) is
    untracked too and never listed as a referrer."""
    return _walk(comm, group)[0]


def _close_drops_group(rank, world):
    import torch.distributed as dist

    problems = []
    # The world group, through public API only: what the Communicator was built over.
    group = dist.group.WORLD
    comm = symcomm.Communicator()
    x = torch.arange(6 * world, dtype=torch.float32)
    comm.all_reduce(x)
    comm.all_gatherv(x[:rank], list(range(world)))
    comm.reduce_scatter(x)
    # The walk must see the group while the communicator is open, or the check after close()
    # would pass for want of looking.
    assert _holders(comm, group), "object-graph walk found no path to the group from an open Communicator"
    comm.close()
    gc.collect()
    held = _holders(comm, group)
    if held:
        problems.append(f"the closed Communicator still holds the world group through {held}")

    # The consequence, on a group of its own: once destroyed, nothing keeps it alive while the
    # closed Communicator lives on. (ProcessGroup takes weak references.)
    sub = dist.new_group(list(range(world)))
    subcomm = symcomm.Communicator(group=sub)
    subcomm.all_reduce(torch.ones(4))
    subcomm.close()
    dist.destroy_process_group(sub)
    alive = weakref.ref(sub)
    del sub
    gc.collect()
    if alive() is not None:
        problems.append(f"a destroyed sub-group is still alive beside its closed Communicator, held through "
                        f"{_holders(subcomm, alive()) or 'nothing the Communicator reaches'}")
    assert not problems, f"rank {rank}: " + "; ".join(problems)


def test_close_lets_go_of_the_process_group():
    run_world(_close_drops_group, 2, timeout_s=120)


# ------------------------------------------------------------- (c) one-rank groups
def _value(rows: int, cols: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
    """Distinct per tag (the global rank), so a result from another rank's group shows."""
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 29 - 7 + 100 * tag
    return t.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _every_op_alone(comm: symcomm.Communicator, tag: int) -> None:
    """At world 1 every collective returns its input: checked bit for bit."""
    assert comm.world_size == 1 and comm.rank == 0, (comm.rank, comm.world_size)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = _value(5, 3, dtype, tag)
        for op in ("sum", "max", "min", "prod") + (("avg",) if dtype.is_floating_point else ()):
            got = comm.all_reduce(x, op=op)
            assert got.dtype == dtype and torch.equal(_bits(got), _bits(x)), (op, dtype, got, x)
        y = x.clone()
        assert comm.all_reduce(y, out=y) is y and torch.equal(y, x)
        for name, got in (("all_gather", comm.all_gather(x)), ("reduce_scatter", comm.reduce_scatter(x)),
                          ("all_gatherv", comm.all_gatherv(x, [5])),
                          ("reduce_scatterv", comm.reduce_scatterv(x, [5]))):
            assert got.shape == x.shape and torch.equal(_bits(got), _bits(x)), (name, dtype, got, x)
        out = torch.empty_like(x)
        assert comm.all_gather(x, out=out) is out and torch.equal(out, x)
        assert comm.all_gatherv(x[:0], [0]).shape == (0, 3)
        assert comm.reduce_scatterv(x[:0], [0]).shape == (0, 3)
    # Several tensors in one all_gatherv, byte-moving dtypes included.
    xs = [_value(4, 7, torch.bfloat16, tag), _value(4, 2, torch.float32, tag).to(torch.float8_e4m3fn),
          _value(4, 16, torch.int64, tag).to(torch.uint8)]
    outs = comm.all_gatherv(xs, [4])
    assert isinstance(outs, list) and len(outs) == 3
    for x, got in zip(xs, outs):
        assert got.dtype == x.dtype and torch.equal(_bits(got), _bits(x)), (x.dtype, got, x)
    x = _value(8, 4, torch.float32, tag)
    for op, kwargs in (("all_reduce", {}), ("all_gather", {}), ("reduce_scatter", {}),
                       ("all_gatherv", {"sizes": [8]}), ("reduce_scatterv", {"sizes": [8]})):
        choice = comm.select(op, x, **kwargs)
        assert choice.algo == "torch", (op, choice)
    comm.close()


def _world_of_one(rank, world):
    import torch.distributed as dist

    assert dist.get_world_size() == 1
    _every_op_alone(symcomm.Communicator(), tag=3)


def test_every_op_at_world_1():
    run_world(_world_of_one, 1, timeout_s=120)


def _one_rank_subgroups(rank, world):
    import torch.distributed as dist

    # Every rank creates every group, in the same order; each then uses only its own.
    groups = [dist.new_group([r]) for r in range(world)]
    comm = symcomm.Communicator(group=groups[rank])
    _every_op_alone(comm, tag=rank)
    dist.barrier()  # the world group still works beside the closed sub-communicators


def test_every_op_on_a_one_rank_subgroup():
    run_world(_one_rank_subgroups, 2, timeout_s=120)


# ------------------------------------------------ (d) communicators never closed (issue 35)
UNCLOSED_RUNS = 4


def test_communicators_left_open_are_closed_at_exit():
    """tests/_unclosed_flow.py forgets comm.close() but destroys the process group, under
    torchrun at world 3, several times: symcomm closes the communicator at exit (each rank
    says so), and no run aborts. Before, the open communicator's groups were torn down during
    interpreter finalization, and about 1 run in 5 aborted ("terminate called")."""
    port = _exit_loop().free_port
    failures = []
    for i in range(UNCLOSED_RUNS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", f"--master-port={port()}",
               str(ROOT / "tests" / "_unclosed_flow.py")]
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                             timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        closed = run.stdout.count("closed at exit: True")
        if run.returncode or "terminate called" in run.stdout or closed != 3:
            failures.append(f"--- run {i + 1}: exit {run.returncode}, {closed} of 3 ranks closed at exit ---\n"
                            + "\n".join(run.stdout.splitlines()[-25:]))
    assert not failures, f"{len(failures)} of {UNCLOSED_RUNS} runs failed:\n" + "\n".join(failures)


def _close_all_at_exit(rank, world):
    import torch.distributed as dist

    from symcomm import registry

    first, second = symcomm.Communicator(timeout_s=30), symcomm.Communicator(timeout_s=30)
    second.all_reduce(torch.ones(4))
    dist.destroy_process_group()  # as a script does before exiting: the hook must not need it
    registry.close_all()  # what atexit runs
    assert first.closed and second.closed
    registry.close_all()  # idempotent
    first.close()
    assert first.group is None and second.group is None


def test_the_exit_hook_closes_every_communicator_after_the_group_is_gone():
    run_world(_close_all_at_exit, 2, timeout_s=120)
