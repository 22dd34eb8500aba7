"""Run the README's example flow (CPU version) under torchrun many times and check every exit.

    python scripts/exit_loop.py [--world 3] [--runs 50] [--timeout 120]

Each run is ``python -m torch.distributed.run --nproc-per-node=N --master-port=<free port>
scripts/exit_loop.py --flow``: init_process_group("gloo"), ``Communicator()``, each collective
once (results checked exactly), ``select()``, ``comm.close()``, ``dist.destroy_process_group()``,
end of script, with the Communicator still in module globals as in a user's script. A run
fails on a non-zero exit, a signal, a timeout, or "terminate called" anywhere in its output
(a C++ std::terminate at interpreter exit, the symptom of a process group that outlived
destroy_process_group() into Python finalization).

Prints one line per run and ``exits: R ok, F failed`` last; exits 1 if any run failed. The
output of each failed run is kept in a file named on its line. Plain Python: needs only torch
and symcomm.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

FLOW_FLAG = "--flow"


def flow() -> None:
    """The README example, CPU version. Runs on every rank under torchrun."""
    import torch
    import torch.distributed as dist

    import symcomm

    global comm  # a user's script keeps it at module level, alive until interpreter exit
    dist.init_process_group("gloo")
    comm = symcomm.Communicator()
    rank, world = comm.rank, comm.world_size

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or not torch.equal(got, want):
            raise SystemExit(f"rank {rank}: {what} gave a wrong result:\n{got}\nexpected\n{want}")

    # Small integer values in float32: every sum is exact, whatever the order.
    def rows(n: int, r: int, cols: int = 4) -> torch.Tensor:
        return torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) + 100 * r

    sizes = [0 if r == 0 else r + 1 for r in range(world)]  # uneven, with a zero
    first = sum(sizes[:rank])
    total = sum(rows(2 * world, r) for r in range(world))
    x = rows(2 * world, rank)
    check("all_reduce", comm.all_reduce(x), total)
    choice = comm.select("all_reduce", x)
    if choice.algo != "torch":
        raise SystemExit(f"rank {rank}: select() chose {choice.algo!r} on CPU, expected 'torch'")
    check("all_gather", comm.all_gather(x), torch.cat([rows(2 * world, r) for r in range(world)]))
    check("all_gatherv", comm.all_gatherv(rows(sizes[rank], rank), sizes),
          torch.cat([rows(sizes[r], r) for r in range(world)]))
    check("reduce_scatter", comm.reduce_scatter(x), total[2 * rank:2 * rank + 2])
    want = sum(rows(sum(sizes), r) for r in range(world))[first:first + sizes[rank]]
    got = comm.reduce_scatterv(rows(sum(sizes), rank), sizes)
    # As in the README, the script ends right after the last collective: close, destroy, exit
    # (the exit race needs the last collective close to the exit; printing or other work in
    # between gives the gloo worker time to finish and hides it). Only a comparison follows.
    comm.close()
    dist.destroy_process_group()
    check("reduce_scatterv", got, want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(world: int, timeout_s: float) -> tuple[bool, str, str]:
    """One torchrun of the flow: (ok, why-not, combined output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={free_port()}", os.path.abspath(__file__), FLOW_FLAG]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; set here to skip its banner
    # A session of its own, so that a timeout kills torchrun and all its workers.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, f"timed out after {timeout_s:.0f} s", out
    problems = []
    if proc.returncode < 0:
        problems.append(f"killed by {signal.Signals(-proc.returncode).name}")
    elif proc.returncode:
        problems.append(f"exit {proc.returncode}")
    if "terminate called" in out:
        problems.append("'terminate called' in output")
    if "SIGABRT" in out or "exitcode  : -6" in out:
        problems.append("a rank aborted (SIGABRT)")
    return not problems, "; ".join(problems), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", "-n", type=int, default=3, help="ranks per run (default 3)")
    parser.add_argument("--runs", "-r", type=int, default=50, help="runs in a row (default 50)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per run (default 120)")
    args = parser.parse_args(argv)
    failed = 0
    for i in range(1, args.runs + 1):
        start = time.monotonic()
        ok, why, out = run_once(args.world, args.timeout)
        took = time.monotonic() - start
        if ok:
            print(f"run {i}/{args.runs}: ok ({took:.1f} s)", flush=True)
            continue
        failed += 1
        with tempfile.NamedTemporaryFile("w", prefix=f"exit_loop_run{i}_", suffix=".log", delete=False) as f:
            f.write(out)
        print(f"run {i}/{args.runs}: FAILED ({why}; {took:.1f} s; output in {f.name})", flush=True)
    print(f"exits: {args.runs - failed} ok, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if FLOW_FLAG in sys.argv[1:]:
        flow()
    else:
        sys.exit(main())
