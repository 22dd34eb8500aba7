"""A tensor-parallel decoder block with symcomm's all-reduce.

Every rank holds all the tokens and a contiguous share of the attention heads and of the MLP's
intermediate columns:

    x = RMSNorm(h)
    attention: column-parallel QKV -> attention over this rank's heads -> row-parallel O
    x, h = all_reduce_add_rmsnorm(partial, residual=h)      # all-reduce + residual add + RMSNorm
    MLP: column-parallel gate/up -> SiLU * up -> row-parallel down
    x, h = all_reduce_add_rmsnorm(partial, residual=h)      # x feeds the next block

The attention is a stand-in (causal attention over the batch as one sequence); what matters
here is where the communication sits. The row-parallel outputs are written into buffers from
``symcomm.use_symmetric_memory(comm)``, so the all-reduce can read them in place on the
symmetric and custom-kernel paths. On the CPU (gloo) the context is a no-op.

Run (every rank checks its result against a single-process block with the full weights):

    torchrun --nproc-per-node=2 examples/tp_block.py --cpu          # gloo, small shapes
    torchrun --nproc-per-node=4 examples/tp_block.py                # GPUs: eager, graphs, compile
    torchrun --nproc-per-node=4 examples/tp_block.py --hidden 7168 --heads 56 --ffn 18432

On GPUs it runs eagerly, then captures one CUDA graph per batch-size bucket and replays them in
mixed order, bitwise against eager, then under ``torch.compile(fullgraph=True)``. It prints
one PASS/FAIL line and exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import symcomm

from layer_utils import (Check, add_common_args, bitwise, checks_in_modes, close_enough, init_distributed,
                         modes_for, rms_norm, run_example, seeded)


@dataclass(frozen=True)
class TPConfig:
    hidden: int = 64
    heads: int = 6
    head_dim: int = 16
    ffn: int = 96
    eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16


def share(rank: int, world: int, n: int) -> range:
    """This rank's contiguous share of n heads or columns (uneven shares are fine)."""
    return range(rank * n // world, (rank + 1) * n // world)


def all_reduce_add_rmsnorm(comm: symcomm.Communicator, partial: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the row-parallel partial over ranks, add the residual, normalise: one symcomm call,
    the all-reduce followed by one norm kernel (the torch reference on CPU). Returns
    (normalised, new residual)."""
    got = comm.all_reduce_rmsnorm(partial, weight, residual=residual, eps=eps)
    return got.out, got.residual


class TPWeights:
    """Full weights drawn from fixed seeds (nn.Linear layout: out_features x in_features)."""

    def __init__(self, cfg: TPConfig, device: torch.device) -> None:
        h, d, f, s = cfg.hidden, cfg.heads * cfg.head_dim, cfg.ffn, cfg.seed * 1000
        self.norm_in = 1.0 + seeded((h,), s + 1, 0.1, cfg.dtype, device)
        self.qkv = seeded((3 * d, h), s + 2, h ** -0.5, cfg.dtype, device)
        self.o = seeded((h, d), s + 3, d ** -0.5, cfg.dtype, device)
        self.norm_attn = 1.0 + seeded((h,), s + 4, 0.1, cfg.dtype, device)
        self.gate_up = seeded((2 * f, h), s + 5, h ** -0.5, cfg.dtype, device)
        self.down = seeded((h, f), s + 6, f ** -0.5, cfg.dtype, device)
        self.norm_out = 1.0 + seeded((h,), s + 7, 0.1, cfg.dtype, device)

    def shard(self, cfg: TPConfig, rank: int, world: int) -> "TPWeights":
        """Column-parallel weights keep this rank's output rows, row-parallel ones its input columns."""
        heads, cols = share(rank, world, cfg.heads), share(rank, world, cfg.ffn)
        d, hd = cfg.heads * cfg.head_dim, cfg.head_dim
        q = slice(heads.start * hd, heads.stop * hd)
        out = object.__new__(TPWeights)
        out.norm_in, out.norm_attn, out.norm_out = self.norm_in, self.norm_attn, self.norm_out
        out.qkv = torch.cat([self.qkv[i * d:(i + 1) * d][q] for i in range(3)]).contiguous()
        out.o = self.o[:, q].contiguous()
        out.gate_up = torch.cat([self.gate_up[:cfg.ffn][cols.start:cols.stop],
                                 self.gate_up[cfg.ffn:][cols.start:cols.stop]]).contiguous()
        out.down = self.down[:, cols.start:cols.stop].contiguous()
        return out


def attention(x: torch.Tensor, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Stand-in attention over ``heads`` heads: the batch as one causal sequence."""
    t = x.shape[0]
    if heads == 0 or t == 0:
        return x.new_zeros(t, heads * head_dim)
    q, k, v = (x @ qkv.t()).view(t, 3, heads, head_dim).permute(1, 2, 0, 3)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, heads * head_dim)


def mlp_act(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


class TPBlock:
    """One decoder block over this rank's shard; ``forward(h)`` returns (x for the next block, h)."""

    def __init__(self, comm: symcomm.Communicator, cfg: TPConfig, capacity: int) -> None:
        self.comm, self.cfg = comm, cfg
        self.heads = len(share(comm.rank, comm.world_size, cfg.heads))
        self.w = TPWeights(cfg, comm.device).shard(cfg, comm.rank, comm.world_size)
        # Same shapes on every rank, so each rank's buffer sits at the same pool offset.
        with symcomm.use_symmetric_memory(comm):
            self.attn_partial = torch.empty(capacity, cfg.hidden, dtype=cfg.dtype, device=comm.device)
            self.mlp_partial = torch.empty(capacity, cfg.hidden, dtype=cfg.dtype, device=comm.device)
        self.capacity = capacity

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, w, t = self.cfg, self.w, hidden.shape[0]
        x = rms_norm(hidden, w.norm_in, cfg.eps)
        attn = attention(x, w.qkv, self.heads, cfg.head_dim)
        partial = torch.matmul(attn, w.o.t(), out=self.attn_partial[:t])
        x, hidden = self.all_reduce_add_rmsnorm(partial, hidden, w.norm_attn)
        partial = torch.matmul(mlp_act(x, w.gate_up), w.down.t(), out=self.mlp_partial[:t])
        return self.all_reduce_add_rmsnorm(partial, hidden, w.norm_out)

    def all_reduce_add_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_rmsnorm(self.comm, partial, residual, weight, self.cfg.eps)

    __call__ = forward


def reference_block(cfg: TPConfig, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same block on one process with the full weights and no communication."""
    w = TPWeights(cfg, hidden.device)
    x = rms_norm(hidden, w.norm_in, cfg.eps)
    hidden = hidden + attention(x, w.qkv, cfg.heads, cfg.head_dim) @ w.o.t()
    x = rms_norm(hidden, w.norm_attn, cfg.eps)
    hidden = hidden + mlp_act(x, w.gate_up) @ w.down.t()
    return rms_norm(hidden, w.norm_out, cfg.eps), hidden


def step_input(cfg: TPConfig, seed: int, step: int, tokens: int, device: torch.device) -> torch.Tensor:
    # The same on every rank: under tensor parallelism every rank sees every token.
    return seeded((tokens, cfg.hidden), 20_000 + seed * 997 + step, 1.0, cfg.dtype, device)


def same_on_every_rank(comm: symcomm.Communicator, name: str, t: torch.Tensor) -> Check:
    """After an all-reduce the replicated activations must be identical everywhere, bit for bit."""
    every = comm.all_gather(t.contiguous().view(torch.uint8).reshape(1, -1))
    same = all(torch.equal(every[r], every[0]) for r in range(comm.world_size))
    return Check(name, same, "" if same else "ranks hold different bits")


def check_against_reference(block: TPBlock, tag: str, hidden: torch.Tensor,
                            got: tuple[torch.Tensor, torch.Tensor]) -> list[Check]:
    want = reference_block(block.cfg, hidden)
    return [close_enough(f"{tag}: normalised output", got[0], want[0], 2e-2),
            close_enough(f"{tag}: residual", got[1], want[1], 2e-2)]


def check_eager(block: TPBlock, steps: int, seed: int) -> list[Check]:
    checks = []
    for step in range(steps):
        tokens = random.Random(seed * 7919 + step).randint(1, block.capacity)
        hidden = step_input(block.cfg, seed, step, tokens, block.comm.device)
        got = block(hidden)
        tag = f"eager step {step} ({tokens} tokens)"
        checks += check_against_reference(block, tag, hidden, got)
        checks.append(same_on_every_rank(block.comm, f"{tag}: identical on every rank", got[0]))
    return checks


def check_graphs(block: TPBlock, buckets: list[int], replays: int, seed: int) -> list[Check]:
    """One graph per bucket, captured as a serving engine does, replayed in mixed order."""
    comm, cfg = block.comm, block.cfg
    static = torch.zeros(max(buckets), cfg.hidden, dtype=cfg.dtype, device=comm.device)
    # Warm up on a side stream: lazy initialisations (cuBLAS, NCCL) must not land in a capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in buckets:
            block(static[:b])
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
    graphs, outputs = {}, {}
    for b in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its memory
        graphs[b] = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(graphs[b], pool=pool):
            outputs[b] = block(static[:b])
    checks = []
    rng = random.Random(seed)
    for step in range(replays):
        bucket = rng.choice(buckets)
        hidden = step_input(cfg, seed, 100 + step, bucket, comm.device)
        static[:bucket].copy_(hidden)
        graphs[bucket].replay()
        replayed = tuple(o.clone() for o in outputs[bucket])
        eager = block(hidden)
        tag = f"graph bucket {bucket} replay {step}"
        checks += [bitwise(f"{tag}: normalised output == eager", replayed[0], eager[0]),
                   bitwise(f"{tag}: residual == eager", replayed[1], eager[1])]
        checks += check_against_reference(block, tag, hidden, replayed)
    return checks


def check_compiled(block: TPBlock, buckets: list[int], seed: int) -> list[Check]:
    """fullgraph=True: a graph break anywhere in the block is an error, not a silent slow path."""
    compiled = torch.compile(block.forward, fullgraph=True, dynamic=False)
    checks = []
    for i, bucket in enumerate(buckets):
        hidden = step_input(block.cfg, seed, 200 + i, bucket, block.comm.device)
        got = tuple(o.clone() for o in compiled(hidden))
        eager = block(hidden)
        checks += [close_enough(f"compiled bucket {bucket}: normalised output vs eager", got[0], eager[0], 2e-2),
                   close_enough(f"compiled bucket {bucket}: residual vs eager", got[1], eager[1], 2e-2)]
    return checks


def run_checks(comm: symcomm.Communicator, cfg: TPConfig, capacity: int, modes: tuple[str, ...],
               steps: int = 4, seed: int = 0, buckets: list[int] | None = None,
               compile_buckets: list[int] | None = None) -> list[Check]:
    return checks_in_modes(TPBlock(comm, cfg, capacity), capacity, modes, (check_eager, check_graphs, check_compiled),
                           steps, seed, buckets, compile_buckets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=None, help="default 64 on --cpu, 2048 on GPUs")
    parser.add_argument("--heads", type=int, default=None, help="default 6 on --cpu, 16 on GPUs")
    parser.add_argument("--head-dim", type=int, default=None, help="default 16 on --cpu, 128 on GPUs")
    parser.add_argument("--ffn", type=int, default=None, help="MLP intermediate size (default 96 / 4096)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per step at most (default 7 / 64)")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small = device.type == "cpu"
    cfg = TPConfig(hidden=args.hidden or (64 if small else 2048), heads=args.heads or (6 if small else 16),
                   head_dim=args.head_dim or (16 if small else 128), ffn=args.ffn or (96 if small else 4096),
                   seed=args.seed)
    return run_example("tp_block", lambda comm: run_checks(
        comm, cfg, args.max_tokens or (7 if small else 64), modes_for(args, device), steps=args.steps, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
