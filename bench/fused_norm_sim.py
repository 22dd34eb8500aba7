"""Fused all-reduce + RMSNorm against the unfused pair, on simulated ranks of one GPU (issue 27,
item 3): what the fused kernels cost on the SMs and in memory, never what NVLink costs.

    python bench/fused_norm_sim.py [--worlds 2,4] [--tokens 1,2,4,16,64,256,1024] [--hidden 8192]
        [--quant none,nvfp4] [--calls 50] [--replays 7] [--lib NAME=PATH ...] [--json out.json]

W ranks are W contexts of this process linked to each other's buffers (tests/gpu_sim's
SimWorld), each launching on its own stream, so one call's W kernels run side by side and meet
in their barriers as on W GPUs. A peer's buffer is this GPU's memory: a peer read costs an HBM
or L2 read, not an NVLink round trip. Two things W GPUs never need, needed here because the W
ranks share one GPU's SMs:
  - grids: the production caps (36 blocks for one-/two-shot, 32 for flag-free) only while all
    W ranks' blocks fit on the SMs at once (W x 36 <= 128), fewer at W = 4 (every block spins
    in barriers, so all must be resident);
  - no early dependent launch (symcomm_set_early_dependents(0), for every build): a kernel
    launched early behind one rank's all-reduce would hold SMs, waiting, that another rank's
    all-reduce needs to start. So these times lack the launch overlap of a real stream.
After every row each rank's alarm word is read: a context that gave up (a bounded wait ran
out) stops the bench, since its kernels would then return at once and time as fast.

Per (world, kernel, tokens, output), bf16 rows of --hidden values with a residual, µs per call:
  ar        the all-reduce kernel alone (symcomm_ar_run; one-/two-shot stage the input, as the
            fused call does)
  norm      the standalone add + RMSNorm kernel (symcomm_rmsnorm) on one rank's all-reduced rows
            (one stream, the other ranks idle)
  unfused   ar, then norm on every rank: what all_reduce_rmsnorm's unfused path launches
  fused     symcomm_ar_rmsnorm with the same all-reduce kernel
  fused-ar  the fused call's norm half, to set against norm
Each time is a CUDA graph per rank holding --calls calls, the W graphs replayed side by side
--replays times after two untimed replays; the table prints medians, the JSON every sample. Only ratios within one run mean anything.

Before timing, every build's fused outputs (h, y, scales) are checked bit for bit against its
own unfused outputs, on every rank, and against the installed build's. --lib NAME=PATH adds a
build of the native library as more columns.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import platform
import statistics
import sys
from collections.abc import Callable

import torch

# The simulated ranks are the GPU tests' harness; bench/ itself is on the path as the script's folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "gpu_sim"))
from _sim import SimWorld  # noqa: E402
from local_kernels import load_lib, parse_lib, parse_list  # noqa: E402
from symcomm import _native  # noqa: E402
from symcomm.backends.custom_ar import ALGO_CODES  # noqa: E402
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT  # noqa: E402

EPS = 1e-6
KERNELS = (FLAGFREE, ONESHOT, TWOSHOT)
QUANT_CODES = {"none": 0, "fp8": 1, "nvfp4": 2}
GRID_BLOCKS = 36  # csrc/peer.cuh's one-/two-shot cap; flag-free's 32 is below it
SMS_FOR_RANKS = 128  # blocks all ranks may hold at once: under an H100's 132 SMs at one block each


def check(lib: ctypes.CDLL, what: str, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


class Rank:
    """One simulated rank's buffers for one (tokens, output) case."""

    def __init__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, quant: str) -> None:
        tokens, hidden = x.shape
        dev = x.device
        self.x, self.residual, self.weight = x, residual, weight
        self.summed = torch.empty_like(x)
        self.h = torch.empty_like(x)
        self.quant = quant
        self.y = {"none": torch.empty_like(x), "fp8": torch.empty(tokens, hidden, dtype=torch.uint8, device=dev),
                  "nvfp4": torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=dev)}[quant]
        self.scales = torch.empty(tokens, hidden // 16, dtype=torch.uint8, device=dev) if quant == "nvfp4" else None
        self.scale = {"none": None, "fp8": torch.tensor([2.0 ** -5], device=dev),
                      "nvfp4": torch.tensor([448.0 * 6 / 8.0], device=dev)}[quant]

    def args(self) -> _native.RmsnormArgs:
        tokens, hidden = self.x.shape
        return _native.RmsnormArgs(self.residual.data_ptr(), self.weight.data_ptr(),
                                   _native.DTYPE_CODES[self.x.dtype], tokens, hidden, EPS, self.h.data_ptr(),
                                   QUANT_CODES[self.quant], self.y.data_ptr(),
                                   None if self.scales is None else self.scales.data_ptr(),
                                   None if self.scale is None else self.scale.data_ptr(), 0.0, 0)

    def outputs(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.h, self.y, self.scales) if t is not None]

    def mark(self, byte: int) -> None:
        """Fill the outputs, so that bytes a launch leaves unwritten show in the comparison."""
        for t in (self.h, self.y, self.scales):
            if t is not None:
                t.view(torch.uint8).fill_(byte)


class Launches:
    """The four things timed, as per-rank launches on the rank's stream."""

    def __init__(self, sim: SimWorld, kernel: str, ranks: list[Rank]) -> None:
        self.sim, self.kernel, self.ranks = sim, kernel, ranks
        self.norm_args = [r.args() for r in ranks]  # kept alive: the kernels read them at launch

    def ar(self, r: int, stream: int) -> None:
        x, rank = self.ranks[r].x, self.ranks[r]
        check(self.sim.lib, "symcomm_ar_run",
              self.sim.lib.symcomm_ar_run(self.sim.ctxs[r], ALGO_CODES[self.kernel], _native.DTYPE_CODES[x.dtype],
                                          x.data_ptr(), 0, 0, rank.summed.data_ptr(), x.nbytes, 1, stream))

    def norm(self, r: int, stream: int) -> None:
        check(self.sim.lib, "symcomm_rmsnorm",
              self.sim.lib.symcomm_rmsnorm(self.ranks[r].summed.data_ptr(), ctypes.byref(self.norm_args[r]), stream))

    def unfused(self, r: int, stream: int) -> None:
        self.ar(r, stream)
        self.norm(r, stream)

    def unfused_eager(self) -> None:
        """Every rank's all-reduce, then every rank's norm: with lazy module loading a kernel's
        first launch waits for the device to go idle, which never happens while rank 0's
        all-reduce spins for a rank whose launch comes after it."""
        on_ranks(self.sim, self.ar, range(self.sim.world))
        on_ranks(self.sim, self.norm, range(self.sim.world))

    def fused(self, r: int, stream: int) -> None:
        x = self.ranks[r].x
        check(self.sim.lib, "symcomm_ar_rmsnorm",
              self.sim.lib.symcomm_ar_rmsnorm(self.sim.ctxs[r], ALGO_CODES[self.kernel], x.data_ptr(), 0, 0, 1,
                                              ctypes.byref(self.norm_args[r]), stream))


def on_ranks(sim: SimWorld, launch: Callable[[int, int], None], ranks: range) -> None:
    """One call on every rank in ``ranks``, each on its stream, forked from and joined to the
    current stream."""
    here = torch.cuda.current_stream()
    for r in ranks:
        sim.streams[r].wait_stream(here)
        launch(r, sim.streams[r].cuda_stream)
    for r in ranks:
        here.wait_stream(sim.streams[r])


def time_graph(sim: SimWorld, launch: Callable[[int, int], None], ranks: range, calls: int,
               replays: int) -> list[float]:
    """Per-call microseconds of each replay of ``calls`` calls on ``ranks``: one graph per rank,
    captured on its stream, all replayed side by side (as W processes would run them; the
    kernels meet in their barriers, so every rank's graph must run at once)."""
    on_ranks(sim, launch, ranks)  # outside capture: lazy loading never happens inside it
    torch.cuda.synchronize()
    graphs = {}
    for r in ranks:
        graphs[r] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[r], stream=sim.streams[r]):
            for _ in range(calls):
                launch(r, sim.streams[r].cuda_stream)

    def replay() -> None:
        here = torch.cuda.current_stream()
        for r in ranks:
            sim.streams[r].wait_stream(here)
            with torch.cuda.stream(sim.streams[r]):
                graphs[r].replay()
        for r in ranks:
            here.wait_stream(sim.streams[r])

    for _ in range(2):
        replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    graphs.clear()
    return samples


def make_ranks(world: int, tokens: int, hidden: int, quant: str, seed: int) -> list[Rank]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    residual = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
    return [Rank(torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16), residual, weight, quant)
            for _ in range(world)]


def outputs_of(sim: SimWorld, launches: Launches, which: str) -> list[list[torch.Tensor]]:
    for rank in launches.ranks:  # another byte for each, so neither can pass on the other's leftovers
        rank.mark(0xA5 if which == "fused" else 0x5A)
    if which == "unfused":
        launches.unfused_eager()
    else:
        on_ranks(sim, launches.fused, range(sim.world))
    torch.cuda.synchronize()
    return [r.outputs() for r in launches.ranks]


def check_alarms(sim: SimWorld, what: str) -> None:
    words = [sim.alarm(r) for r in range(sim.world)]
    if any(words):
        sys.exit(f"{what}: a rank's kernels gave up (alarm words {[hex(w) for w in words]}); no time after this "
                 f"point would mean anything")


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def run_world(args, world: int, libs: dict[str, ctypes.CDLL | None]) -> list[dict]:
    blocks = min(GRID_BLOCKS, SMS_FOR_RANKS // world)
    need = max(args.tokens) * args.hidden * 2
    rows, installed = [], {}
    sims = {name: SimWorld(world, max_blocks=blocks, staging_bytes=3 * need + (1 << 20), flagfree_bytes=need,
                           lib=lib) for name, lib in libs.items()}
    try:
        for quant in args.quant:
            for tokens in args.tokens:
                for kernel in KERNELS:
                    row = {"world": world, "kernel": kernel, "tokens": tokens, "quant": quant, "blocks": blocks,
                           "builds": {}}
                    for name, sim in sims.items():
                        ranks = make_ranks(world, tokens, args.hidden, quant, seed=tokens * 31 + world)
                        launches = Launches(sim, kernel, ranks)
                        fused = outputs_of(sim, launches, "fused")
                        unfused = outputs_of(sim, launches, "unfused")
                        ok = same(fused, unfused) and same(fused, [fused[0]] * world)
                        key = (quant, tokens, kernel)
                        installed.setdefault(key, fused)
                        b = {"fused_equals_unfused": ok, "equals_installed": same(fused, installed[key])}
                        everyone = range(world)
                        for what, launch, on in (("ar", launches.ar, everyone), ("norm", launches.norm, range(1)),
                                                 ("unfused", launches.unfused, everyone),
                                                 ("fused", launches.fused, everyone)):
                            b[what] = time_graph(sim, launch, on, args.calls, args.replays)
                        row["builds"][name] = b
                        check_alarms(sim, f"{name} build, W={world} {kernel} {tokens} tokens {quant}")
                    rows.append(row)
                    print_row(row, list(libs))
    finally:
        for sim in sims.values():
            sim.close()
    return rows


def med(samples: list[float]) -> float:
    return statistics.median(samples)


def print_header(libs: list[str]) -> None:
    cols = "".join(f" | {n}: ar | norm | unfused | fused | fused-ar | fused/unfused | bits" for n in libs)
    print(f"world | kernel | tokens | out{cols}")


def print_row(row: dict, libs: list[str]) -> None:
    cells = []
    for n in libs:
        b = row["builds"][n]
        ar, norm, unfused, fused = (med(b[k]) for k in ("ar", "norm", "unfused", "fused"))
        bits = "ok" if b["fused_equals_unfused"] and b["equals_installed"] else \
            ("FUSED != UNFUSED" if not b["fused_equals_unfused"] else "differs from installed")
        cells.append(f"{ar:.2f} | {norm:.2f} | {unfused:.2f} | {fused:.2f} | {fused - ar:.2f} | "
                     f"{fused / unfused:.2f} | {bits}")
    print(f"{row['world']} | {row['kernel']} | {row['tokens']} | {row['quant']} | " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=parse_list, default=parse_list("2,4"))
    p.add_argument("--tokens", type=parse_list, default=parse_list("1,2,4,16,64,256,1024"))
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--quant", type=lambda t: [q for q in t.split(",") if q], default=["none", "nvfp4"])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--lib", type=parse_lib, action="append", default=[], help="NAME=PATH of another build")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args(argv)
    bad = [q for q in args.quant if q not in QUANT_CODES]
    if bad:
        p.error(f"--quant takes {', '.join(QUANT_CODES)}; got {', '.join(bad)}")
    if args.hidden % 16 or not 16 <= args.hidden <= 8192:
        p.error(f"--hidden must be a multiple of 16 up to 8192 (the fused kernels' limit); got {args.hidden}")
    if not torch.cuda.is_available():
        sys.exit("fused_norm_sim.py needs a CUDA GPU")
    libs: dict[str, ctypes.CDLL | None] = {"installed": None}
    for name, path in args.lib:
        libs[name] = load_lib(path)
    for lib in [_native.load().lib, *(v for v in libs.values() if v is not None)]:
        lib.symcomm_set_early_dependents(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, hidden {args.hidden}, residual, "
          f"{args.calls} calls a graph, median of {args.replays} replays, µs per call; simulated ranks on one GPU: "
          f"no NVLink in these times", flush=True)
    print_header(list(libs))
    rows = []
    for world in args.worlds:
        rows += run_world(args, world, libs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "lib"}, "libs": dict(args.lib),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "python": platform.python_version(), "rows": rows}, f, indent=1)
    if any(not b["fused_equals_unfused"] or not b["equals_installed"] for r in rows for b in r["builds"].values()):
        sys.exit("some fused outputs differ from unfused or from the installed build (see the bits column)")


if __name__ == "__main__":
    main()
