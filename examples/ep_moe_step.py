"""One MoE layer step under expert parallelism, with symcomm moving the tokens.

Every rank owns its own tokens (a rank may have none) and ``experts / world`` of the experts.
One step:

    RMSNorm -> router -> top-k                  (each rank, on its own tokens)
    moe_dispatch(tokens, top-k ids, weights)    each token to the ranks holding its experts,
                                                NVFP4 or FP8 on the way with --quant
    local experts: grouped GEMMs over the received rows, already grouped by local expert
    moe_combine(expert outputs)                 back to the tokens' owners, weighted, summed
    residual add

The dispatch's buffers are allocated once, inside ``symcomm.use_symmetric_memory(comm)``, by a
dispatch of no tokens sized for the most tokens any rank will pass (``max_tokens``); every step
passes them back as ``out=``. Their shapes are equal on every rank, so they sit at equal pool
offsets, which the peer-memory path needs, and a CUDA graph captured over a step keeps them; the
pool is sized for them with ``symcomm.moe_dispatch_nbytes``. On the CPU (gloo) the context is a
no-op and the same code runs the a2a path.

The receive buffer holds every row ``max_tokens`` tokens a rank could bring, which at decode is
far more than arrive. The grouped GEMMs skip rows past the last group, but the elementwise work
between them (and a quantized dispatch's dequantize) would not: a step that knows its bucket,
the most tokens any rank passes in it (every rank pads to it under CUDA graphs), passes
``bucket=`` and that work stops at the rows that bucket can fill.

Run (every rank checks its tokens against a single-process computation with the full weights):

    torchrun --nproc-per-node=2 examples/ep_moe_step.py --cpu        # gloo, small shapes
    torchrun --nproc-per-node=4 examples/ep_moe_step.py              # GPUs: eager, graphs, compile
    torchrun --nproc-per-node=8 examples/ep_moe_step.py --hidden 7168 --experts 256 --ffn 2048 --top-k 8 --quant nvfp4

On GPUs it runs eagerly, then captures one CUDA graph per batch-size bucket (each rank pads to the
bucket with zero rows routed nowhere) and replays them in mixed order, bitwise against eager, then
under ``torch.compile(fullgraph=True)``. It prints one PASS/FAIL line and exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import symcomm
from symcomm import fp4
from symcomm.communicator import DEFAULT_SYMMETRIC_CAPACITY
from symcomm.ep import fp8, layout

from dp_moe_step import MoEConfig, MoEWeights, experts_of, padded_input, step_counts, step_input
from layer_utils import (Check, add_common_args, bitwise, checks_in_modes, close_enough, init_distributed,
                         modes_for, rms_norm, run_example, token_counts)

QUANTS = {"none": None, "nvfp4": "nvfp4", "fp8": "fp8"}


def expert_mlp(w: MoEWeights, rows: torch.Tensor, ends: torch.Tensor, bound: int | None = None) -> torch.Tensor:
    """Rows grouped by local expert (group e ends at ends[e]) through their experts' gated MLP,
    as grouped GEMMs; rows past the last group stay unwritten. Where every group ends by row
    ``bound``, the SiLU-and-multiply between the GEMMs stops there too: over a whole receive
    buffer (16,384 rows of 7168 x 2048 at world 1, top-8 of 64 experts, 2048 tokens' capacity)
    it took 0.42 ms of a 0.98 ms one-token step on an H200
    (bench/results/2026-11-29_nvidia-h200_w1_tenth_session, run l)."""
    gate, up = F.grouped_mm(rows, w.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    if bound is None or bound >= rows.shape[0]:
        act = (F.silu(gate.float()) * up.float()).to(rows.dtype)
    else:  # rows past the bound are in no group: the second GEMM never reads them
        act = gate.new_empty(gate.shape)
        act[:bound] = (F.silu(gate[:bound].float()) * up[:bound].float()).to(rows.dtype)
    return F.grouped_mm(act, w.down.transpose(1, 2), offs=ends)


class EPMoELayer:
    """RMSNorm + router + experts held by ranks; ``forward`` returns hidden + MoE(hidden)."""

    def __init__(self, comm: symcomm.Communicator, cfg: MoEConfig, capacity: int, quant: str | None,
                 weights: MoEWeights | None = None) -> None:
        """``weights``: as for DPMoELayer (this rank's experts' weights, when already built)."""
        if cfg.experts % comm.world_size:
            raise SystemExit(f"--experts ({cfg.experts}) must be a multiple of the world size ({comm.world_size})")
        self.comm, self.cfg, self.capacity, self.quant = comm, cfg, capacity, quant
        self.experts = experts_of(comm.rank, comm.world_size, cfg.experts)
        self.w = weights or MoEWeights(cfg, self.experts, comm.device)
        dev, h, k = comm.device, cfg.hidden, cfg.top_k
        # The buffers every step reuses: one dispatch of no tokens allocates them (a collective).
        with symcomm.use_symmetric_memory(comm):
            self.bufs = comm.moe_dispatch(torch.empty(0, h, dtype=cfg.dtype, device=dev),
                                          torch.empty(0, k, dtype=torch.int32, device=dev),
                                          torch.empty(0, k, device=dev), cfg.experts, max_tokens=capacity,
                                          quant=quant, global_scale=1.0 if quant == "nvfp4" else None)

    def route(self, x: torch.Tensor, real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 logits: with bf16 ones, near-ties would flip top-k between differently batched runs.
        logits = x.float() @ self.w.router.t()
        top, ids = torch.topk(logits, self.cfg.top_k, dim=-1)
        ids = ids.to(torch.int32)
        if real is not None:  # padding rows go to no expert
            ids = torch.where(real[:, None], ids, -1)
        return ids, torch.softmax(top, dim=-1)

    @staticmethod
    def rows_bound(handle: symcomm.EpHandle, bucket: int | None) -> int | None:
        """The row every received row of ``handle``'s dispatch lies below when no rank passed
        more than ``bucket`` tokens (layout.capacity for that many, with the dispatch's own
        alignment padding), or None: the whole receive buffer."""
        if bucket is None:
            return None
        return layout.capacity(handle.world, bucket, handle.topk, handle.num_experts, handle.align)

    def decode(self, d: symcomm.Dispatched, bound: int | None = None) -> torch.Tensor:
        """The received rows in the model's dtype; quantized ones decoded below ``bound`` only."""
        if self.quant is None:
            return d.x
        n = d.x.shape[0] if bound is None else min(bound, d.x.shape[0])
        if self.quant == "nvfp4":
            decoded = fp4.dequantize(d.x[:n], d.scales[:n], d.global_scale, self.cfg.dtype)
        else:
            decoded = fp8.dequantize(d.x[:n], d.scales[:n], self.cfg.dtype)
        if n == d.x.shape[0]:
            return decoded
        rows = decoded.new_empty((d.x.shape[0], decoded.shape[1]))  # past n: in no group, never read
        rows[:n] = decoded
        return rows

    def local_experts(self, d: symcomm.Dispatched, bound: int | None = None) -> torch.Tensor:
        """Every received row through its expert: the rows arrive grouped by local expert, so
        the grouped GEMM takes the dispatch's expert offsets as they are (rows past the last
        group stay unwritten, and combine never reads them)."""
        return expert_mlp(self.w, self.decode(d, bound), d.expert_offsets[1:], bound)

    def moe(self, hidden: torch.Tensor, real: torch.Tensor | None = None, bucket: int | None = None) -> torch.Tensor:
        """The MoE branch alone: each token's weighted sum of its experts' outputs. ``bucket``:
        the most tokens any rank passes in this step, the same on every rank (the bucket every
        rank pads to under CUDA graphs), or None. Each rank checks only its own count against
        it; nothing compares the ranks' buckets (the dispatch's fingerprint covers max_tokens,
        not this), and a rank whose bucket is below a peer's count would leave rows past its
        bound uncomputed and return them as they are."""
        comm = self.comm
        if bucket is not None and hidden.shape[0] > bucket:
            raise ValueError(f"this rank passes {hidden.shape[0]} tokens, more than bucket={bucket}")
        x = rms_norm(hidden, self.w.norm, self.cfg.eps)
        ids, weights = self.route(x, real)
        gs = fp4.global_scale_for(x, comm) if self.quant == "nvfp4" else None  # collective, the same everywhere
        # Compiled code allocates its own buffers (a custom op is functional); eager and graphs reuse them.
        out = None if torch.compiler.is_compiling() else self.bufs
        d = comm.moe_dispatch(x, ids, weights, self.cfg.experts, max_tokens=self.capacity, quant=self.quant,
                              global_scale=gs, out=out)
        return comm.moe_combine(self.local_experts(d, self.rows_bound(d.handle, bucket)), d.handle)

    def forward(self, hidden: torch.Tensor, real: torch.Tensor | None = None, bucket: int | None = None) -> torch.Tensor:
        return hidden + self.moe(hidden, real, bucket)

    __call__ = forward


# ------------------------------------------------------------------ single-process reference
def reference_step(cfg: MoEConfig, chunks: list[torch.Tensor], quant: str | None) -> dict[str, torch.Tensor]:
    """The same layer on one process with every expert, written the plain way: a loop over
    experts with boolean selection, then each token's slot-order weighted sum in fp32
    (moe_combine adds by rank and rounds each rank's partial once more: within the tolerance). ``chunks`` are the ranks' tokens; RMSNorm and the router run per chunk,
    as their owners run them."""
    hidden_all = torch.cat(chunks)
    w = MoEWeights(cfg, range(cfg.experts), hidden_all.device)
    normed = [rms_norm(c, w.norm, cfg.eps) for c in chunks]
    x = torch.cat(normed)
    logits = torch.cat([xc.float() @ w.router.t() for xc in normed])
    top, ids = torch.topk(logits, cfg.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    if quant == "nvfp4":
        gs = fp4.global_scale_for(x)
        values = fp4.dequantize_reference(*fp4.quantize_reference(x, gs), gs, cfg.dtype)
    elif quant == "fp8":
        values = fp8.dequantize(*fp8.quantize(x), cfg.dtype)
    else:
        values = x
    n, k = ids.shape
    per_slot = torch.zeros(n, k, cfg.hidden, dtype=torch.float32, device=x.device)
    for e in range(cfg.experts):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (values[token] @ w.gate_up[e].t()).chunk(2, dim=-1)
            act = (F.silu(gate.float()) * up.float()).to(cfg.dtype)
            per_slot[token, slot] = (act @ w.down[e].t()).float()
    acc = torch.zeros(n, cfg.hidden, dtype=torch.float32, device=x.device)
    for j in range(k):
        acc = acc + weights[:, j:j + 1] * per_slot[:, j]
    moe = acc.to(cfg.dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=cfg.experts)
    return {"out": hidden_all + moe, "moe": moe, "counts": counts.to(torch.int32)}


# ------------------------------------------------------------------ the checks main() runs
def check_eager(layer: EPMoELayer, steps: int, seed: int) -> list[Check]:
    comm, cfg = layer.comm, layer.cfg
    checks = []
    for step in range(steps):
        counts = step_counts(seed, step, comm.world_size, layer.capacity)
        hidden = step_input(cfg, seed, step, comm.rank, counts[comm.rank], comm.device)
        sizes = token_counts(comm, hidden.shape[0])
        moe = layer.moe(hidden, bucket=max(counts))  # every rank knows every count: the bounded step
        out = layer(hidden)
        ref = reference_step(cfg, [step_input(cfg, seed, step, r, c, comm.device) for r, c in enumerate(counts)],
                             layer.quant)
        first, n, tag = sum(sizes[:comm.rank]), sizes[comm.rank], f"eager step {step} sizes {sizes}"
        mine = ref["counts"][layer.experts.start:layer.experts.stop]
        checks += [Check(f"{tag}: token counts", sizes == counts, f"{sizes} != {counts}"),
                   bitwise(f"{tag}: rows received per local expert", layer.bufs.expert_counts.cpu(), mine.cpu()),
                   close_enough(f"{tag}: MoE output (combined)", moe, ref["moe"][first:first + n], 2e-2),
                   close_enough(f"{tag}: output", out, ref["out"][first:first + n], 2e-2)]
    return checks


def check_graphs(layer: EPMoELayer, buckets: list[int], replays: int, seed: int) -> list[Check]:
    """Capture one graph per bucket, replay them in mixed order with fresh inputs, and compare each
    replay bitwise with the eager step on the same input."""
    comm, cfg = layer.comm, layer.cfg
    world = comm.world_size
    static = torch.zeros(max(buckets), cfg.hidden, dtype=cfg.dtype, device=comm.device)
    real = torch.zeros(max(buckets), dtype=torch.bool, device=comm.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in buckets:
            layer(static[:b], real[:b], b)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for b in sorted(buckets, reverse=True):
        graphs[b] = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(graphs[b], pool=pool):
            outputs[b] = layer(static[:b], real[:b], b)
    checks = []
    for step in range(replays):
        counts = step_counts(seed, 100 + step, world, max(buckets))
        bucket = min(b for b in buckets if b >= max(counts))  # every rank picks the same graph
        n = counts[comm.rank]
        static[:bucket].copy_(padded_input(cfg, seed, 100 + step, comm.rank, n, bucket, comm.device))
        real.zero_()
        real[:n] = True
        graphs[bucket].replay()
        replayed = outputs[bucket].clone()
        eager = layer(static[:bucket].clone(), real[:bucket].clone(), bucket)
        tag = f"graph bucket {bucket} replay {step}"
        checks.append(bitwise(f"{tag}: replay == eager", replayed, eager))
        ref = reference_step(cfg, [step_input(cfg, seed, 100 + step, r, c, comm.device) for r, c in enumerate(counts)],
                             layer.quant)
        first = sum(counts[:comm.rank])
        checks.append(close_enough(f"{tag}: real rows vs reference", replayed[:n], ref["out"][first:first + n], 2e-2))
    comm.check_health()  # a replay cannot raise: a rank that gave up says so here
    return checks


def check_compiled(layer: EPMoELayer, buckets: list[int], seed: int) -> list[Check]:
    """fullgraph=True: a graph break anywhere in the step is an error, not a silent slow path."""
    comm, cfg = layer.comm, layer.cfg
    # Inductor keeps a fused kernel's intermediates in fp32 unless told to round them as eager
    # does; then the router sees x before its bf16 rounding, a near-tie flips a top-k choice, and
    # that token's output moves by a whole expert's share (0.52 of 4.9 on an H100, one bucket of
    # 64 tokens). Rounding as eager does keeps the comparison about symcomm, not about routing.
    compiled = torch.compile(layer.forward, fullgraph=True, dynamic=False,
                             options={"emulate_precision_casts": True})
    checks = []
    for i, bucket in enumerate(buckets):
        hidden = padded_input(cfg, seed, 200 + i, comm.rank, bucket, bucket, comm.device)
        got = compiled(hidden, None, bucket).clone()
        want = layer(hidden, None, bucket)
        checks.append(close_enough(f"compiled bucket {bucket} vs eager", got, want, 5e-2))
    return checks


def run_checks(comm: symcomm.Communicator, cfg: MoEConfig, capacity: int, modes: tuple[str, ...],
               steps: int = 4, seed: int = 0, quant: str | None = None, buckets: list[int] | None = None,
               compile_buckets: list[int] | None = None) -> list[Check]:
    layer = EPMoELayer(comm, cfg, capacity, quant)
    return checks_in_modes(layer, capacity, modes, (check_eager, check_graphs, check_compiled), steps, seed,
                           buckets, compile_buckets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=None, help="default 128 on --cpu, 2048 on GPUs")
    parser.add_argument("--experts", type=int, default=None, help="default 2 per rank on --cpu, 4 per rank on GPUs")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=None, help="expert intermediate size (default 32 / 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per rank at most (default 5 / 64)")
    parser.add_argument("--quant", choices=tuple(QUANTS), default="none", help="dispatch quantization")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small = device.type == "cpu"
    world = torch.distributed.get_world_size()
    cfg = MoEConfig(hidden=args.hidden or (128 if small else 2048),
                    experts=args.experts or (2 if small else 4) * world, top_k=args.top_k,
                    ffn=args.ffn or (32 if small else 1024), seed=args.seed)
    max_tokens = args.max_tokens or (5 if small else 64)
    # The dispatch's buffers beside what the default pool leaves for the rest (graphs, the
    # collectives' outputs): at 8 ranks, 2048 tokens, top-8 and hidden 7168 they alone take 2 GiB.
    # (Nothing where --experts does not divide among the ranks: EPMoELayer says so in the example's words.)
    extra = 0 if cfg.experts % world else symcomm.moe_dispatch_nbytes(
        world, max_tokens, cfg.top_k, cfg.experts, cfg.hidden, cfg.dtype, QUANTS[args.quant])
    return run_example("ep_moe_step", lambda comm: run_checks(
        comm, cfg, max_tokens, modes_for(args, device), steps=args.steps, seed=args.seed,
        quant=QUANTS[args.quant]), symmetric_capacity=DEFAULT_SYMMETRIC_CAPACITY + extra)


if __name__ == "__main__":
    sys.exit(main())
