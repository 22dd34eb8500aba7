"""One MoE layer step under data-parallel attention, with symcomm doing the token exchange.

Every rank owns its own tokens (after DP attention, counts differ per rank; a rank may have
none) and a contiguous share of the experts. One step:

    RMSNorm -> router -> top-k          (each rank, on its own tokens)
    all_gatherv([tokens, top-k ids, top-k weights])             bf16 rows, one collective
      or, from MoEConfig.fp4_from_bytes gathered:
    all_gatherv_fp4(tokens, extra=[top-k ids, top-k weights])   NVFP4 payload, one collective
    local experts: grouped GEMMs over the gathered tokens routed to this rank's experts
    reduce_scatterv(partial outputs) back to the tokens' owners, then the residual add

NVFP4 moves 3.56x fewer bytes, but it costs a global scale every rank shares (an all_reduce of
the ranks' amax), a quantize and a dequantize: at decode, where the gather is a few KiB and
latency-bound, bf16 rows are faster. Every rank decides from the token counts of every rank, so
all take the same collective.

The buffers the collectives read and write come from one workspace allocated inside
``symcomm.use_symmetric_memory(comm)`` with the same shapes on every rank (sized for the
largest per-rank count), and each step uses views of it. Allocating per step with each rank's
own count would leave rank-dependent holes in the pool, and symmetric kernels need every
rank's buffer at the same offset. On the CPU (gloo) the context is a no-op and the same code
allocates ordinary tensors.

Run (every rank checks its tokens against a single-process computation with the full weights):

    torchrun --nproc-per-node=2 examples/dp_moe_step.py --cpu        # gloo, small shapes
    torchrun --nproc-per-node=4 examples/dp_moe_step.py              # GPUs: eager, graphs, compile
    torchrun --nproc-per-node=4 examples/dp_moe_step.py --hidden 7168 --experts 32 --ffn 2048 --top-k 8

On GPUs it runs eagerly, then captures one CUDA graph per batch-size bucket (each rank pads
to the bucket, as DP-attention serving does) and replays them in mixed order, bitwise against
eager, then under ``torch.compile(fullgraph=True)``. It prints one PASS/FAIL line and exits 1
on a mismatch.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import symcomm
from symcomm import fp4

from layer_utils import (Check, add_common_args, bitwise, checks_in_modes, close_enough, init_distributed,
                         modes_for, rms_norm, run_example, seeded, token_counts)


@dataclass(frozen=True)
class MoEConfig:
    hidden: int = 64
    experts: int = 6
    top_k: int = 2
    ffn: int = 32  # each expert's intermediate size
    eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    # Gathers of at least this many bf16 bytes (all ranks' tokens) go as NVFP4. At world 2 on
    # H200 (bench/results/2026-11-28_nvidia-h200-x2_w2_verify_e21875f, all_gatherv_fp4 sweep)
    # bf16 took 5.1-6.7 us to 512 KiB and 15.8 at 4 MiB, NVFP4 with its dequantize 9.7-11.6 and
    # 14.5, before the global scale's all_reduce of max, which plain NCCL serves (~12 us); at
    # 32 MiB, 72.5 against 48.1. The crossing lies between 4 and 32 MiB; not measured closer.
    fp4_from_bytes: int = 4 << 20

    def quantizes(self, total_tokens: int) -> bool:
        """Whether a gather of ``total_tokens`` rows (every rank's) goes as NVFP4."""
        return total_tokens * self.hidden * self.dtype.itemsize >= self.fp4_from_bytes


def experts_of(rank: int, world: int, experts: int) -> range:
    """Contiguous share of the experts; works for any world size, even one with more ranks than experts."""
    return range(rank * experts // world, (rank + 1) * experts // world)


class MoEWeights:
    """The layer's weights, drawn per expert from its own seed: a rank builds only its experts,
    the reference builds all of them, and both get the same bits."""

    def __init__(self, cfg: MoEConfig, experts: range, device: torch.device) -> None:
        h, f, s = cfg.hidden, cfg.ffn, cfg.seed * 1000
        self.norm = 1.0 + seeded((h,), s + 1, 0.1, cfg.dtype, device)
        self.router = seeded((cfg.experts, h), s + 2, h ** -0.5, torch.float32, device)
        # nn.Linear layout (out_features, in_features): gate and up stacked, then down.
        self.gate_up = self._stack([seeded((2 * f, h), s + 100 + e, h ** -0.5, cfg.dtype) for e in experts],
                                   (2 * f, h), cfg.dtype, device)
        self.down = self._stack([seeded((h, f), s + 500 + e, f ** -0.5, cfg.dtype) for e in experts],
                                (h, f), cfg.dtype, device)

    @staticmethod
    def _stack(mats: list[torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        # A rank may own no expert (more ranks than experts): it still needs a [0, out, in] tensor.
        return (torch.stack(mats) if mats else torch.empty(0, *shape, dtype=dtype)).to(device)


class Workspace:
    """Every buffer a collective touches, sized for ``capacity`` tokens per rank."""

    def __init__(self, comm: symcomm.Communicator, cfg: MoEConfig, capacity: int) -> None:
        total, h = capacity * comm.world_size, cfg.hidden
        dev = comm.device
        with symcomm.use_symmetric_memory(comm):
            self.packed = torch.empty(total, h // 2, dtype=torch.uint8, device=dev)
            self.scales = torch.empty(total, h // fp4.BLOCK, dtype=torch.float8_e4m3fn, device=dev)
            self.ids = torch.empty(total, cfg.top_k, dtype=torch.int32, device=dev)
            self.weights = torch.empty(total, cfg.top_k, dtype=torch.float32, device=dev)
            self.values = torch.empty(total, h, dtype=cfg.dtype, device=dev)
            self.partial = torch.empty(total, h, dtype=cfg.dtype, device=dev)
            self.out = torch.empty(capacity, h, dtype=cfg.dtype, device=dev)
        self.capacity = capacity

    @staticmethod
    def nbytes(cfg: MoEConfig, capacity: int, world: int) -> int:
        """Symmetric memory the workspace needs (for Communicator(symmetric_capacity=...))."""
        h, total, item = cfg.hidden, capacity * world, cfg.dtype.itemsize
        per_row = h // 2 + h // fp4.BLOCK + cfg.top_k * 8 + 2 * h * item
        return total * per_row + capacity * h * item


def gather_rows(comm: symcomm.Communicator, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                sizes: list[int], ws: Workspace) -> None:
    """Gather every rank's bf16 tokens, top-k ids and weights into the workspace, the three in
    one collective: one launch of the peer push kernel where every row is whole 16-byte vectors
    (top-k a multiple of 4), one NCCL group otherwise."""
    total = sum(sizes)
    comm.all_gatherv([x, ids, weights], sizes, out=[ws.values[:total], ws.ids[:total], ws.weights[:total]])


def gather_tokens(comm: symcomm.Communicator, x: torch.Tensor, gs: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, sizes: list[int], ws: Workspace) -> None:
    """Quantize this rank's tokens into its slice of the workspace and gather everyone's, with
    the top-k ids and weights, in one NCCL group. The extras are copied into their slices first
    so that the gather runs in place: then every buffer NCCL touches is symmetric."""
    total, first = sum(sizes), sum(sizes[:comm.rank])
    mine = slice(first, first + x.shape[0])
    ws.ids[mine].copy_(ids)
    ws.weights[mine].copy_(weights)
    out = symcomm.Fp4Gathered(ws.packed[:total], ws.scales[:total], (ws.ids[:total], ws.weights[:total]),
                              ws.values[:total], gs)
    comm.all_gatherv_fp4(x, sizes, gs, extra=[ws.ids[mine], ws.weights[mine]], dequantize=True, out=out)


class DPMoELayer:
    """RMSNorm + router + experts sharded over ranks; ``forward`` returns hidden + MoE(hidden)."""

    def __init__(self, comm: symcomm.Communicator, cfg: MoEConfig, ws: Workspace,
                 weights: MoEWeights | None = None) -> None:
        """``weights``: this rank's experts' weights, when already built (drawing them takes
        seconds per expert set on one CPU thread; bench/layer_step.py shares one set across variants)."""
        self.comm, self.cfg, self.ws = comm, cfg, ws
        self.experts = experts_of(comm.rank, comm.world_size, cfg.experts)
        self.w = weights or MoEWeights(cfg, self.experts, comm.device)
        # Group ends are found by searching the sorted expert keys for 1..n: static shapes and no
        # host sync, so the step can be captured in a CUDA graph and compiled without breaks.
        self._group_keys = torch.arange(1, len(self.experts) + 1, device=comm.device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 logits: with bf16 ones, near-ties would flip top-k between differently batched runs.
        logits = x.float() @ self.w.router.t()
        top, ids = torch.topk(logits, self.cfg.top_k, dim=-1)
        return ids.to(torch.int32), torch.softmax(top, dim=-1)

    def local_experts(self, values: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of weight * expert(token), for every gathered token (zero
        for tokens routed elsewhere). The (token, slot) pairs are sorted by expert so that each
        expert's tokens are one contiguous group of a grouped GEMM."""
        t, k = ids.shape
        n_local = len(self.experts)
        if t == 0 or n_local == 0:
            return torch.zeros_like(values)
        local = ids.long() - self.experts.start
        mine = (local >= 0) & (local < n_local)
        key = torch.where(mine, local, n_local).flatten()  # other ranks' pairs sort last
        order = torch.argsort(key, stable=True)
        ends = torch.searchsorted(key[order], self._group_keys, out_int32=True)
        rows = values.index_select(0, order // k)
        gate, up = F.grouped_mm(rows, self.w.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(values.dtype)
        down = F.grouped_mm(act, self.w.down.transpose(1, 2), offs=ends)
        # grouped_mm leaves the rows past the last group unwritten: select, never multiply, them.
        valid = torch.arange(t * k, device=values.device) < ends[-1]
        scaled = torch.where(valid[:, None], down.float() * weights.flatten()[order, None], 0.0)
        # Undo the sort with a scatter to unique rows (deterministic, unlike index_add_), then
        # sum each token's k slots in a fixed order.
        per_pair = torch.empty_like(scaled).index_copy_(0, order, scaled)
        return per_pair.view(t, k, -1).sum(1).to(values.dtype)

    def global_scale(self, x: torch.Tensor) -> torch.Tensor:
        return fp4.global_scale_for(x, self.comm)  # collective: every rank quantizes with the same scale

    def dispatch(self, x: torch.Tensor, gs: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor,
                 sizes: list[int]) -> None:
        """Every rank's tokens, top-k ids and weights into ws.values, ws.ids, ws.weights; as
        NVFP4 with global scale ``gs``, or as they are where ``gs`` is None."""
        if gs is None:
            gather_rows(self.comm, x, ids, weights, sizes, self.ws)
        else:
            gather_tokens(self.comm, x, gs, ids, weights, sizes, self.ws)

    def combine(self, sizes: list[int]) -> torch.Tensor:
        """Sum the ranks' partial outputs (ws.partial) and keep this rank's tokens."""
        n = sizes[self.comm.rank]
        return self.comm.reduce_scatterv(self.ws.partial[:sum(sizes)], sizes, out=self.ws.out[:n])

    def forward(self, hidden: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ws, total = self.ws, sum(sizes)
        x = rms_norm(hidden, self.w.norm, self.cfg.eps)
        ids, weights = self.route(x)
        self.dispatch(x, self.global_scale(x) if self.cfg.quantizes(total) else None, ids, weights, sizes)
        ws.partial[:total].copy_(self.local_experts(ws.values[:total], ws.ids[:total], ws.weights[:total]))
        return hidden + self.combine(sizes)

    __call__ = forward


# ------------------------------------------------------------------ single-process reference
def reference_step(cfg: MoEConfig, chunks: list[torch.Tensor], quantize: bool) -> dict[str, torch.Tensor]:
    """The same layer on one process with every expert, written the plain way (a loop over
    experts with boolean selection), so it checks the grouped-GEMM bookkeeping rather than
    repeating it. ``chunks`` are the ranks' tokens, gathered as NVFP4 where ``quantize`` (the
    layer's choice for the gather it ran). The per-token steps (RMSNorm, router) run per chunk,
    as their owners run them: on GPUs a row reduction's summation order can depend on how many
    rows there are, and the gathered bits are compared exactly."""
    hidden_all = torch.cat(chunks)
    w = MoEWeights(cfg, range(cfg.experts), hidden_all.device)
    normed = [rms_norm(c, w.norm, cfg.eps) for c in chunks]
    x = torch.cat(normed)
    logits = torch.cat([xc.float() @ w.router.t() for xc in normed])
    top, ids = torch.topk(logits, cfg.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    packed = scales = None
    values = x
    if quantize:
        gs = fp4.global_scale_for(x)
        packed, scales = fp4.quantize_reference(x, gs)
        values = fp4.dequantize_reference(packed, scales, gs, cfg.dtype)
    moe = torch.zeros(hidden_all.shape, dtype=torch.float32, device=hidden_all.device)
    for e in range(cfg.experts):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (values[token] @ w.gate_up[e].t()).chunk(2, dim=-1)
            act = (F.silu(gate.float()) * up.float()).to(cfg.dtype)
            moe.index_add_(0, token, (act @ w.down[e].t()).float() * weights[token, slot, None])
    return {"out": hidden_all + moe.to(cfg.dtype), "moe": moe.to(cfg.dtype), "packed": packed, "scales": scales,
            "values": values, "ids": ids.to(torch.int32), "weights": weights}


def step_counts(seed: int, step: int, world: int, capacity: int) -> list[int]:
    """Random per-rank token counts; step 0 always gives the last rank none (when world > 1)."""
    rng = random.Random(seed * 7919 + step)
    counts = [rng.randint(0, capacity) for _ in range(world)]
    if step == 0 and world > 1:
        counts[-1] = 0
        counts[0] = max(counts[0], 1)
    return counts


def step_input(cfg: MoEConfig, seed: int, step: int, rank: int, n: int, device: torch.device) -> torch.Tensor:
    return seeded((n, cfg.hidden), 10_000 + seed * 997 + step * 31 + rank, 1.0, cfg.dtype, device)


# ------------------------------------------------------------------ the checks main() runs
def check_eager(layer: DPMoELayer, steps: int, seed: int) -> list[Check]:
    comm, cfg, ws = layer.comm, layer.cfg, layer.ws
    checks = []
    for step in range(steps):
        counts = step_counts(seed, step, comm.world_size, ws.capacity)
        hidden = step_input(cfg, seed, step, comm.rank, counts[comm.rank], comm.device)
        sizes = token_counts(comm, hidden.shape[0])
        out = layer(hidden, sizes)
        first, total = sum(sizes[:comm.rank]), sum(sizes)
        quantize = cfg.quantizes(total)
        ref = reference_step(cfg, [step_input(cfg, seed, step, r, c, comm.device) for r, c in enumerate(counts)],
                             quantize)
        tag = f"eager step {step} sizes {sizes} ({'NVFP4' if quantize else 'bf16'} gather)"
        gathered = ([bitwise(f"{tag}: gathered FP4 payload", ws.packed[:total], ref["packed"]),
                     bitwise(f"{tag}: gathered FP4 scales", ws.scales[:total], ref["scales"])] if quantize else
                    [bitwise(f"{tag}: gathered bf16 rows", ws.values[:total], ref["values"])])
        checks += [Check(f"{tag}: token counts", sizes == counts, f"{sizes} != {counts}"), *gathered,
                   bitwise(f"{tag}: gathered top-k ids", ws.ids[:total], ref["ids"]),
                   close_enough(f"{tag}: gathered top-k weights", ws.weights[:total], ref["weights"], 1e-6),
                   close_enough(f"{tag}: MoE output (reduce-scattered)", ws.out[:sizes[comm.rank]],
                                ref["moe"][first:first + sizes[comm.rank]], 2e-2),
                   close_enough(f"{tag}: output", out, ref["out"][first:first + sizes[comm.rank]], 2e-2)]
    return checks


def padded_input(cfg: MoEConfig, seed: int, step: int, rank: int, n: int, bucket: int,
                 device: torch.device) -> torch.Tensor:
    """This rank's tokens followed by zero rows up to the bucket. A zero row normalises to zero,
    so it adds nothing to the global scale or to other tokens' outputs."""
    padded = torch.zeros(bucket, cfg.hidden, dtype=cfg.dtype, device=device)
    padded[:n] = step_input(cfg, seed, step, rank, n, device)
    return padded


def check_graphs(layer: DPMoELayer, buckets: list[int], replays: int, seed: int) -> list[Check]:
    """Capture one graph per bucket as a serving engine does, replay them in mixed order with
    fresh inputs, and compare each replay bitwise with the eager step on the same input."""
    comm, cfg = layer.comm, layer.cfg
    world = comm.world_size
    static = torch.zeros(max(buckets), cfg.hidden, dtype=cfg.dtype, device=comm.device)
    # Warm up on a side stream: lazy initialisations (cuBLAS, NCCL) must not land in a capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in buckets:
            layer(static[:b], [b] * world)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
    graphs, outputs = {}, {}
    for b in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its memory
        graphs[b] = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(graphs[b], pool=pool):
            outputs[b] = layer(static[:b], [b] * world)
    checks = []
    for step in range(replays):
        counts = step_counts(seed, 100 + step, world, max(buckets))
        bucket = min(b for b in buckets if b >= max(counts))  # every rank picks the same graph
        n = counts[comm.rank]
        static[:bucket].copy_(padded_input(cfg, seed, 100 + step, comm.rank, n, bucket, comm.device))
        graphs[bucket].replay()
        replayed = outputs[bucket].clone()
        eager = layer(static[:bucket].clone(), [bucket] * world)
        tag = f"graph bucket {bucket} replay {step}"
        checks.append(bitwise(f"{tag}: replay == eager", replayed, eager))
        ref = reference_step(cfg, [step_input(cfg, seed, 100 + step, r, c, comm.device)
                                   for r, c in enumerate(counts)], cfg.quantizes(bucket * world))
        first = sum(counts[:comm.rank])
        checks.append(close_enough(f"{tag}: real rows vs reference", replayed[:n], ref["out"][first:first + n], 2e-2))
    return checks


def check_compiled(layer: DPMoELayer, buckets: list[int], seed: int) -> list[Check]:
    """fullgraph=True: a graph break anywhere in the step is an error, not a silent slow path."""
    comm, cfg = layer.comm, layer.cfg
    compiled = torch.compile(layer.forward, fullgraph=True, dynamic=False)
    checks = []
    for i, bucket in enumerate(buckets):
        hidden = padded_input(cfg, seed, 200 + i, comm.rank, bucket, bucket, comm.device)
        sizes = [bucket] * comm.world_size
        got = compiled(hidden, sizes).clone()
        want = layer(hidden, sizes)
        # Looser than eager's 2e-2: inductor rounds the fused RMSNorm its own way, and NVFP4 turns
        # a last-bit difference into a whole code step for some values (seen on an H100: 0.027 of
        # the largest output). A wrong op or a lost rank is off by the output's own size.
        checks.append(close_enough(f"compiled bucket {bucket} vs eager", got, want, 5e-2))
    return checks


def run_checks(comm: symcomm.Communicator, cfg: MoEConfig, capacity: int, modes: tuple[str, ...],
               steps: int = 4, seed: int = 0, buckets: list[int] | None = None,
               compile_buckets: list[int] | None = None) -> list[Check]:
    """Every mode with cfg's gather switch and, where cfg would never quantize at this capacity
    (so at the defaults), again with every gather as NVFP4, so that both collectives are checked."""
    ws = Workspace(comm, cfg, capacity)
    configs = [cfg]
    if not cfg.quantizes(capacity * comm.world_size):
        configs.append(dataclasses.replace(cfg, fp4_from_bytes=0))
    checks = []
    for c in configs:
        layer = DPMoELayer(comm, c, ws)
        checks += checks_in_modes(layer, capacity, modes, (check_eager, check_graphs, check_compiled), steps, seed,
                                  buckets, compile_buckets)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=None, help="default 64 on --cpu, 2048 on GPUs")
    parser.add_argument("--experts", type=int, default=None, help="default 6 on --cpu, 16 on GPUs")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=None, help="expert intermediate size (default 32 / 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per rank at most (default 5 / 64)")
    parser.add_argument("--fp4-from", type=int, default=MoEConfig.fp4_from_bytes,
                        help="gather as NVFP4 from this many bf16 bytes of every rank's tokens (default 4 MiB)")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small = device.type == "cpu"
    cfg = MoEConfig(hidden=args.hidden or (64 if small else 2048), experts=args.experts or (6 if small else 16),
                    top_k=args.top_k, ffn=args.ffn or (32 if small else 1024), seed=args.seed,
                    fp4_from_bytes=args.fp4_from)
    return run_example("dp_moe_step", lambda comm: run_checks(
        comm, cfg, args.max_tokens or (5 if small else 64), modes_for(args, device), steps=args.steps, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
