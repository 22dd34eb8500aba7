"""Step latency of the example layers per batch size: symcomm against torch.distributed.

    torchrun --nproc-per-node=4 bench/layer_step.py --tokens 1,2,4,8,16,32,64,2048 \\
        --json layer_step_w4.json --plot layer_step_w4.png        # --plot needs matplotlib
    torchrun --nproc-per-node=2 bench/layer_step.py --cpu         # smoke test over gloo: tiny shapes

The layers are the examples' own (examples/dp_moe_step.py, examples/tp_block.py,
examples/ep_moe_step.py); only their collectives change between variants, all measured in the
same run:

    symcomm-auto        Communicator(): dispatch picks among every path
    symcomm-nccl        Communicator(custom_ar_capacity=0): symcomm's own all-reduce kernels off,
                        NCCL paths only (the DP step still quantizes with symcomm's FP4 codec
                        where its gather is large enough: MoEConfig.fp4_from_bytes)
    torch.distributed   DP: all_gather_single of bf16 tokens, ids and weights, then
                        reduce_scatter_single; TP: all_reduce, then PyTorch's add and RMSNorm;
                        EP: all_to_all_single of the counts, then of each (token, expert)
                        entry's bf16 row, a sort by local expert, and the same back
    torch-symm-mem      torch.distributed._symmetric_memory (one-/two-shot all-reduce for TP,
                        its low-contention all-gather / reduce-scatter for DP), where the
                        installed torch has it; otherwise the row says why it was skipped
    local               the same step with every collective replaced by a no-op: compute alone
                        (TP: symcomm.rmsnorm's add + RMSNorm, the norm symcomm's variants run)

DP and EP rows: tokens per rank, every rank at the same count (graph replay needs static sizes,
and serving pads ranks to the bucket). TP rows: tokens per step (every rank holds all). EP:
symcomm-auto runs moe_dispatch/moe_combine on the peer-memory kernels; symcomm-nccl has them off
(custom_ar_capacity=0), so the same calls take the a2a path over NCCL, which reads counts on the
host and, like torch.distributed's EP step, cannot be captured: those two run eagerly (CUDA
events around --iters eager steps; the table says "eager").
On GPUs each (variant, tokens) is one CUDA graph of one step, captured per bucket into one shared
pool, replayed --iters times between two events (after one untimed replay that lines the ranks up),
--rounds times; the table gives the median round, the slowest rank. ``comm`` is step minus local, so
the communication's share is measured by difference: it includes the DP variants' FP4
quantize/dequantize (symcomm, from 4 MiB gathered: MoEConfig.fp4_from_bytes) and whatever overlap
the collectives cost or allow. On the CPU (--cpu, gloo) the steps run eagerly and the timings mean
nothing: it only proves that every variant runs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import symcomm  # noqa: E402
from symcomm.bench import torch_symm  # noqa: E402

import dp_moe_step as dp  # noqa: E402
import ep_moe_step as ep  # noqa: E402
import tp_block as tp  # noqa: E402
from layer_utils import init_distributed, rms_norm  # noqa: E402

VARIANTS = ("symcomm-auto", "symcomm-nccl", "torch.distributed", "torch-symm-mem", "local")
SYMCOMM_VARIANTS = ("symcomm-auto", "symcomm-nccl")
# torch 2.13 renamed these two (the old names still work, with a deprecation warning per call).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------ DP step, collectives swapped
class DPTorch(dp.DPMoELayer):
    """Plain torch.distributed: bf16 tokens gathered (no FP4), then a reduce-scatter."""

    def global_scale(self, x):
        return x  # unused: nothing is quantized

    def dispatch(self, x, gs, ids, weights, sizes):
        total, ws = sum(sizes), self.ws
        for src, dst in ((x, ws.values), (ids, ws.ids), (weights, ws.weights)):
            _all_gather(dst[:total], src)

    def combine(self, sizes):
        n = sizes[self.comm.rank]
        _reduce_scatter(self.ws.out[:n], self.ws.partial[:sum(sizes)])
        return self.ws.out[:n]


class DPSymmMem(DPTorch):
    """PyTorch symmetric memory's low-contention gather and reduce-scatter (they stage inputs
    that are not symmetric through their own workspace)."""

    def dispatch(self, x, gs, ids, weights, sizes):
        total, ws, name = sum(sizes), self.ws, dist.group.WORLD.group_name
        for src, dst in ((x, ws.values), (ids, ws.ids), (weights, ws.weights)):
            dst[:total].copy_(torch.ops.symm_mem._low_contention_all_gather(src, name))

    def combine(self, sizes):
        name = dist.group.WORLD.group_name
        return torch.ops.symm_mem._low_contention_reduce_scatter(self.ws.partial[:sum(sizes)], "sum", name)


class DPLocal(dp.DPMoELayer):
    """No collective: this rank's own tokens stand in for every rank's (one local copy), so the
    experts see as many tokens, routed by the real router, as in the real step. No FP4 global
    scale either, as torch's step has none: the scale's kernels and its all_reduce count as
    symcomm's communication cost, not as shared compute."""

    def global_scale(self, x):
        return x  # unused: nothing is quantized

    def dispatch(self, x, gs, ids, weights, sizes):
        world, n, ws = len(sizes), x.shape[0], self.ws
        for src, dst in ((x, ws.values), (ids, ws.ids), (weights, ws.weights)):
            dst[:world * n].view(world, n, -1).copy_(src.unsqueeze(0).expand(world, n, -1))

    def combine(self, sizes):
        return self.ws.partial[:sizes[self.comm.rank]]


# ------------------------------------------------------------------ EP step, collectives swapped
class EPTorch(ep.EPMoELayer):
    """torch.distributed.all_to_all_single both ways, each (token, expert) entry's bf16 row; the
    receiver sorts its rows by local expert for the grouped GEMM and unsorts them after."""

    def moe(self, hidden, real=None, bucket=None):  # its buffers hold exactly the rows that arrive
        cfg, world = self.cfg, self.comm.world_size
        x = rms_norm(hidden, self.w.norm, cfg.eps)
        ids, weights = self.route(x, real)
        n, k, local = ids.shape[0], cfg.top_k, cfg.experts // world
        flat = ids.long().reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert: by destination rank too
        send = torch.bincount(flat // local, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()
        arrived = x.new_empty((sum(rc), cfg.hidden))
        dist.all_to_all_single(arrived, x[order // k], rc, sc)
        expert = torch.empty(sum(rc), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(expert, flat[order] % local, rc, sc)
        by_expert = torch.argsort(expert, stable=True)
        ends = torch.searchsorted(expert[by_expert], torch.arange(1, local + 1, device=x.device), out_int32=True)
        back_rows = torch.empty_like(arrived)
        back_rows[by_expert] = ep.expert_mlp(self.w, arrived[by_expert], ends)
        back = torch.empty(n * k, cfg.hidden, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(back, back_rows, sc, rc)
        per_entry = torch.empty_like(back)
        per_entry[order] = back
        return (per_entry.view(n, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


class EPLocal(ep.EPMoELayer):
    """No collective, and the same expert work as the real step. This rank's own tokens stand in
    for every rank's (``world`` copies, as DPLocal does): the entries whose expert this rank holds
    are the rows it would receive when every rank holds the same tokens (as here: the inputs are
    seeded by the token count alone), so the grouped GEMMs read the same experts' weights. The rows
    go, grouped by local expert, into the dispatch's own receive buffer (``self.bufs.x``, capacity
    rows for ``max_tokens``), and ep.expert_mlp runs over it with the bound the real step's
    local_experts uses (the rows the step's bucket can fill), so its SiLU-and-multiply covers the
    same rows: that is compute, not communication. The combine's stand-in gathers each token's k
    entries and sums them weighted (entries held elsewhere count zero);
    bench/analysis_2026-11-28_model_steps.md says what a narrower stand-in got wrong."""

    def moe(self, hidden, real=None, bucket=None):
        cfg, world = self.cfg, self.comm.world_size
        x = rms_norm(hidden, self.w.norm, cfg.eps)
        ids, weights = self.route(x, real)
        n, k, local = ids.shape[0], cfg.top_k, len(self.experts)
        mine = ids.long() - self.experts.start
        held = (mine >= 0) & (mine < local)  # padding rows (id -1) and other ranks' experts: False
        key = torch.where(held, mine, local).reshape(-1).repeat(world)  # the world copies' entries
        order = torch.argsort(key, stable=True)  # held entries first, by local expert
        ends = torch.searchsorted(key[order], torch.arange(1, local + 1, device=x.device), out_int32=True)
        rows = self.bufs.x  # [capacity, H]: held entries never exceed it (layout.capacity's bound)
        used = min(order.numel(), rows.shape[0])
        rows[:used].copy_(x.index_select(0, (order[:used] % (n * k)) // k))
        out = ep.expert_mlp(self.w, rows, ends, self.rows_bound(self.bufs.handle, bucket))
        # Where copy 0's entries landed (sorted position), for the combine's stand-in.
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel(), device=x.device)
        first = where[:n * k].clamp_max(rows.shape[0] - 1)
        per_entry = torch.where(held.reshape(-1, 1), out.index_select(0, first), 0)  # unwritten rows never multiplied
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), per_entry.view(n, k, -1)).squeeze(1)


# ------------------------------------------------------------------ TP block, collectives swapped
class TPTorch(tp.TPBlock):
    def all_reduce_add_rmsnorm(self, partial, residual, weight):
        dist.all_reduce(partial)
        hidden = residual + partial
        return rms_norm(hidden, weight, self.cfg.eps), hidden


class TPSymmMem(tp.TPBlock):
    """One-shot all-reduce up to 512 KiB, two-shot above, on buffers from symm_mem.empty: its
    ops find their peers through the buffer's rendezvous, so each bucket gets its own buffers."""

    def use_tokens(self, tokens: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        name = dist.group.WORLD.group_name
        bufs = [symm_mem.empty(tokens, self.cfg.hidden, dtype=self.cfg.dtype, device=self.comm.device)
                for _ in range(2)]
        for b in bufs:
            symm_mem.rendezvous(b, name)
        self.attn_partial, self.mlp_partial = bufs

    def all_reduce_add_rmsnorm(self, partial, residual, weight):
        name = dist.group.WORLD.group_name
        if partial.nbytes <= 512 << 10:
            reduced = torch.ops.symm_mem.one_shot_all_reduce(partial, "sum", name)
        else:
            reduced = torch.ops.symm_mem.two_shot_all_reduce_(partial, "sum", name)
        hidden = residual + reduced
        return rms_norm(hidden, weight, self.cfg.eps), hidden


class TPLocal(tp.TPBlock):
    """No all-reduce, and the norm symcomm's variants run after theirs (symcomm.rmsnorm's kernel
    where it runs): with torch's add and RMSNorm here, 'step - local' credited the kernel's
    speed-up to symcomm's communication and came out negative (bench/NOTES.md, 2026-11-28)."""

    def all_reduce_add_rmsnorm(self, partial, residual, weight):
        got = symcomm.rmsnorm.add_rmsnorm(partial, weight, residual=residual, eps=self.cfg.eps)
        return got.out, got.residual


# ------------------------------------------------------------------ building and timing
def symm_mem_unavailable(device: torch.device) -> str | None:
    return torch_symm.unavailable(device, ("one_shot_all_reduce", "two_shot_all_reduce_",
                                           "_low_contention_all_gather", "_low_contention_reduce_scatter"))


def open_comm(variant: str, symmetric_bytes: int) -> symcomm.Communicator:
    """symcomm variants get the communicator they measure; the others one without a pool, only
    for the layer's rank, world and device (their collectives do not go through it)."""
    capacity = max(symcomm.communicator.DEFAULT_SYMMETRIC_CAPACITY, int(symmetric_bytes * 1.25))
    if variant == "symcomm-auto":
        return symcomm.Communicator(symmetric_capacity=capacity)
    if variant == "symcomm-nccl":
        return symcomm.Communicator(symmetric_capacity=capacity, custom_ar_capacity=0)
    return symcomm.Communicator(symmetric=False, custom_ar_capacity=0)


# EP variants that read token counts on the host: timed eagerly (a graph cannot capture them).
EP_EAGER = ("symcomm-nccl", "torch.distributed")


def build(layer: str, variant: str, comm: symcomm.Communicator, args, capacity: int,
          experts: dp.MoEWeights | None):
    """The variant's step and model; ``experts``: the MoE layers' weights, shared by every variant
    (drawing them per variant took about a minute per EP build on one CPU thread)."""
    if layer == "ep_moe":
        cls = {"torch.distributed": EPTorch, "local": EPLocal}.get(variant, ep.EPMoELayer)
        model = cls(comm, args.ep, capacity, None, weights=experts)
        # every rank passes the same count, so it is the step's bucket (EPMoELayer.moe)
        return lambda hidden: model(hidden, None, hidden.shape[0]), model
    if layer == "dp_moe":
        cls = {"torch.distributed": DPTorch, "torch-symm-mem": DPSymmMem, "local": DPLocal}.get(variant, dp.DPMoELayer)
        ws = dp.Workspace(comm, args.moe, capacity)
        for t in (ws.packed, ws.ids, ws.weights, ws.values, ws.partial):
            t.zero_()  # the local variant reads these without anyone writing them
        model = cls(comm, args.moe, ws, weights=experts)
        return lambda hidden: model(hidden, [hidden.shape[0]] * comm.world_size), model
    cls = {"torch.distributed": TPTorch, "torch-symm-mem": TPSymmMem, "local": TPLocal}.get(variant, tp.TPBlock)
    model = cls(comm, args.tp, capacity)
    return model.forward, model


def slowest_rank(us: float) -> float:
    t = torch.tensor([us], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_cpu(step, hidden, iters: int, rounds: int) -> float:
    step(hidden)
    samples = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            step(hidden)
        samples.append((time.perf_counter() - start) * 1e6 / iters)
    return slowest_rank(statistics.median(samples))


def timed_rounds(once, iters: int, rounds: int) -> float:
    """Median over rounds of the time per ``once()``, CUDA events around ``iters`` of them (after
    one untimed), the slowest rank's."""
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        # The ranks leave the barrier at different host times; one untimed step, whose
        # collectives wait for the last rank, lines them up before the clock starts, so the
        # skew is not charged to the round.
        once()
        start.record()
        for _ in range(iters):
            once()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return slowest_rank(statistics.median(samples))


def time_eager_cuda(step, hidden, iters: int, rounds: int) -> float:
    step(hidden)
    return timed_rounds(lambda: step(hidden), iters, rounds)


def time_graph(step, hidden, iters: int, rounds: int, capture_ctx, pool, graphs: list) -> float:
    """Per-step time of ``step`` captured into ``pool``. The graph is appended to ``graphs`` and
    kept alive: a serving engine keeps one graph per batch size in one shared pool, and torch
    refuses (an internal assert in capture_begin) to capture into a shared pool whose graphs were
    all destroyed while blocks from it are still cached."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(hidden)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with capture_ctx(), torch.cuda.graph(graph, pool=pool):
            step(hidden)
    except Exception:
        # When a capture is invalidated, torch's capture_end raises before it stops routing
        # allocations to the graph's pool; left so, the next memory pool destroyed in this
        # process aborts it (an internal assert). End the routing here, then report the failure.
        with contextlib.suppress(RuntimeError):  # raises when capture_end did end it
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        raise
    graph.replay()
    torch.cuda.synchronize()
    graphs.append(graph)
    return timed_rounds(graph.replay, iters, rounds)


def moe_weights(layer: str, args, device: torch.device) -> dp.MoEWeights | None:
    """This rank's expert weights for an MoE layer (None for the TP block): the experts a rank
    holds depend only on its rank and the world, the same for every variant."""
    cfg = {"dp_moe": args.moe, "ep_moe": args.ep}.get(layer)
    if cfg is None:
        return None
    return dp.MoEWeights(cfg, dp.experts_of(dist.get_rank(), dist.get_world_size(), cfg.experts), device)


def measure(layer: str, variant: str, args, device: torch.device,
            experts: dp.MoEWeights | None) -> dict[int, float]:
    """Microseconds per step for every token count, one communicator for all of them."""
    tokens = args.tokens
    world = dist.get_world_size()
    need = {"dp_moe": dp.Workspace.nbytes(args.moe, max(tokens), world),
            "ep_moe": ep_bytes(args.ep, max(tokens), world)}.get(layer, 2 * max(tokens) * args.tp.hidden * 2)
    comm = open_comm(variant, need)
    graphs: list = []
    try:
        step, model = build(layer, variant, comm, args, max(tokens), experts)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        capture_ctx = comm.graph_capture if variant in SYMCOMM_VARIANTS else contextlib.nullcontext
        times = {}
        for n in tokens:
            hidden = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(n)).to(
                args.dtype).to(device)
            if isinstance(model, TPSymmMem):
                model.use_tokens(n)
            if device.type == "cuda" and layer == "ep_moe" and variant in EP_EAGER:
                times[n] = time_eager_cuda(step, hidden, args.iters, args.rounds)
            elif device.type == "cuda":
                times[n] = time_graph(step, hidden, args.iters, args.rounds, capture_ctx, pool, graphs)
            else:
                times[n] = time_cpu(step, hidden, args.iters, args.rounds)
        return times
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize()
        graphs.clear()  # before close(): graphs captured in graph_capture() hold its buffers
        comm.close()


def ep_bytes(cfg: dp.MoEConfig, tokens: int, world: int) -> int:
    """Symmetric memory one EP step takes: its dispatch buffers, allocated once (EPMoELayer)."""
    return symcomm.moe_dispatch_nbytes(world, tokens, cfg.top_k, cfg.experts, cfg.hidden, cfg.dtype)


def run(args, device: torch.device) -> list[dict]:
    rows = []
    skip_symm = symm_mem_unavailable(device)
    for layer in args.layers:
        results: dict[str, dict[int, float] | str] = {}
        experts = moe_weights(layer, args, device)
        for variant in VARIANTS:
            if variant == "torch-symm-mem" and skip_symm:
                results[variant] = f"skipped: {skip_symm}"
                continue
            if variant == "torch-symm-mem" and layer == "dp_moe":
                # Its low-contention gather stages inputs that are not symmetric; captured at world 2
                # (torch 2.11, 2x H200, 2026-11-27) the capture failed and the run hung (bench/NOTES.md).
                results[variant] = "skipped: torch's low-contention all-gather does not capture here (bench/NOTES.md)"
                continue
            if variant == "torch-symm-mem" and layer == "ep_moe":
                results[variant] = "skipped: torch's all_to_all_vdev needs NVSHMEM, which this step does not set up"
                continue
            if dist.get_rank() == 0:  # progress: the table comes only at the end
                print(f"# measuring {layer} / {variant} ...", file=sys.stderr, flush=True)
            try:
                results[variant] = measure(layer, variant, args, device, experts)
            except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
                if variant != "torch-symm-mem":
                    raise
                results[variant] = f"skipped: failed with {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        local, base = results["local"], results["torch.distributed"]
        for n in args.tokens:
            for variant in VARIANTS:
                r = results[variant]
                row = {"layer": layer, "tokens": n, "variant": variant,
                       "timing": "eager" if layer == "ep_moe" and variant in EP_EAGER and device.type == "cuda"
                       else "graph" if device.type == "cuda" else "cpu"}
                if isinstance(r, str):
                    row["note"] = r
                else:
                    row.update(us=r[n], comm_us=r[n] - local[n], vs_torch=r[n] / base[n])
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = f"# {'layer':<10}{'tokens':>7}  {'variant':<18}{'step(us)':>10}{'comm(us)':>10}{'comm%':>7}{'÷ torch':>9}"
    lines = ["# ÷ torch: this step's time over torch.distributed's at the same tokens (below 1 is faster)", head]
    for r in rows:
        left = f"  {r['layer']:<10}{r['tokens']:>7}  {r['variant']:<18}"
        if "note" in r:
            lines.append(left + r["note"])
        else:
            share = 100 * r["comm_us"] / r["us"] if r["us"] else 0.0
            mode = "  eager" if r.get("timing") == "eager" else ""
            lines.append(left + f"{r['us']:>10.2f}{r['comm_us']:>10.2f}{share:>6.1f}%{r['vs_torch']:>8.3f}x{mode}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        for variant in VARIANTS:
            pts = [(r["tokens"], r["us"]) for r in rows
                   if r["layer"] == layer and r["variant"] == variant and "us" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=variant)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="step (us)", title=layer)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, tiny shapes (a smoke test)")
    parser.add_argument("--layers", default="dp_moe,tp_block,ep_moe")
    parser.add_argument("--tokens", default=None, help="comma-separated (default 1,2,4,...,64,2048; 1,4 on --cpu)")
    parser.add_argument("--hidden", type=int, default=None, help="default 7168 (64 on --cpu)")
    parser.add_argument("--experts-per-rank", type=int, default=8, help="DP step (default 8)")
    parser.add_argument("--ep-experts", type=int, default=None, help="EP step's experts in all (default 256; 4/rank on --cpu)")
    parser.add_argument("--top-k", type=int, default=None, help="default 8 (2 on --cpu)")
    parser.add_argument("--moe-ffn", type=int, default=None, help="expert intermediate size (default 2048)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tp-ffn", type=int, default=None, help="MLP intermediate size (default 18432)")
    parser.add_argument("--iters", type=int, default=20, help="graph replays per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small, world = device.type == "cpu", dist.get_world_size()
    args.layers = [name.strip() for name in args.layers.split(",")]
    args.tokens = [int(t) for t in (args.tokens or ("1,4" if small else "1,2,4,8,16,32,64,2048")).split(",")]
    args.hidden = args.hidden or (64 if small else 7168)
    args.dtype = torch.bfloat16
    head_dim = 16 if small else args.head_dim
    args.moe = dp.MoEConfig(hidden=args.hidden, experts=args.experts_per_rank * world,
                            top_k=args.top_k or (2 if small else 8), ffn=args.moe_ffn or (32 if small else 2048))
    args.ep = dp.MoEConfig(hidden=args.hidden, experts=args.ep_experts or (4 * world if small else 256),
                           top_k=args.top_k or (2 if small else 8), ffn=args.moe_ffn or (32 if small else 2048))
    args.tp = tp.TPConfig(hidden=args.hidden, heads=args.hidden // head_dim, head_dim=head_dim,
                          ffn=args.tp_ffn or (96 if small else 18432))
    rank = dist.get_rank()
    if rank == 0:
        where = (f"{torch.cuda.get_device_name(device)}, CUDA-graph replay" if not small
                 else "CPU over gloo, eager: timings are meaningless here (smoke test only)")
        print(f"# layer_step: world {world}, {where}, torch {torch.__version__}, symcomm {symcomm.__version__}")
        print(f"# dp_moe: hidden {args.moe.hidden}, {args.moe.experts} experts ({args.experts_per_rank}/rank), "
              f"top-{args.moe.top_k}, ffn {args.moe.ffn}; tokens = per rank")
        print(f"# tp_block: hidden {args.tp.hidden}, {args.tp.heads} heads x {args.tp.head_dim}, ffn {args.tp.ffn}; "
              f"tokens = per step")
        print(f"# ep_moe: hidden {args.ep.hidden}, {args.ep.experts} experts ({args.ep.experts // world}/rank), "
              f"top-{args.ep.top_k}, ffn {args.ep.ffn}; tokens = per rank; {', '.join(EP_EAGER)} run eagerly on GPUs")
        print(f"# median of {args.rounds} rounds of {args.iters} steps, slowest rank; comm = step - local")
    rows = run(args, device)
    if rank == 0:
        print(table(rows), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"world": world, "device": str(device), "rows": rows}, indent=1))
        if args.plot:
            plot(rows, args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
