"""A whole world's MoE dispatch and combine in one process, written the plain way (loops over
ranks, tokens and slots), so it checks symcomm/ep/layout.py's vectorised bookkeeping, the a2a
path, the kernels' CPU twin and the kernels themselves rather than repeating any of them.

It follows the rules as symcomm/ep/layout.py states them: valid entries, segments per local
expert in expert order (aligned), ranks in rank order inside a segment, tokens in token order;
the combine adds each token's rows in slot order as ``acc = acc + w * y`` in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from symcomm import fp4
from symcomm.ep import fp8


@dataclass
class Received:
    """One rank's receive side after the dispatch."""

    counts: list[int]
    offsets: list[int]
    recv_src: list[int]  # for rows < offsets[-1]: origin, or -1 (padding)
    rows: dict[int, tuple[int, int]]  # row -> (source rank, token)
    table: list[list[int]]


def encode(x: torch.Tensor, quant: str | None, gs: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row (or rows) as it travels: its own bytes, or (payload, scales) bytes."""
    if quant == "nvfp4":
        packed, scales = fp4.quantize_reference(x, gs)
        return packed, scales.view(torch.uint8)
    if quant == "fp8":
        codes, scales = fp8.quantize(x)
        return codes.view(torch.uint8), scales
    return x, None


def world_dispatch(ids: list[torch.Tensor], num_experts: int, max_tokens: int,
                   align: int = 1) -> tuple[list[Received], list[torch.Tensor]]:
    """(every rank's receive side, every rank's send_rows [n, k] with -1 for skipped entries)."""
    world, k = len(ids), ids[0].shape[1]
    local = num_experts // world
    lists = [[[] for _ in range(local)] for _ in range(world)]  # [dest][local expert] -> (q, t, j)
    for q in range(world):
        for t in range(ids[q].shape[0]):
            seen = set()
            for j in range(k):
                i = int(ids[q][t, j])
                if 0 <= i < num_experts and i not in seen:
                    seen.add(i)
                    lists[i // local][i % local].append((q, t, j))
    send_rows = [torch.full((ids[q].shape[0], k), -1, dtype=torch.int32) for q in range(world)]
    table = [[0] * num_experts for _ in range(world)]
    for p in range(world):
        for e in range(local):
            for q, _, _ in lists[p][e]:
                table[q][p * local + e] += 1
    received = []
    for p in range(world):
        counts, offsets, recv_src, rows = [], [], [], {}
        row = 0
        for e in range(local):
            offsets.append(row)
            counts.append(len(lists[p][e]))
            for q, t, j in lists[p][e]:
                send_rows[q][t, j] = row
                recv_src.append((q * max_tokens + t) * k + j)
                rows[row] = (q, t)
                row += 1
            padded = -(-len(lists[p][e]) // align) * align
            recv_src += [-1] * (padded - len(lists[p][e]))
            row = offsets[-1] + padded
        offsets.append(row)
        received.append(Received(counts, offsets, recv_src, rows, table))
    return received, send_rows


def world_combine(ids: list[torch.Tensor], weights: list[torch.Tensor], send_rows: list[torch.Tensor],
                  expert_outs: list[torch.Tensor], num_experts: int, quant: str | None = None) -> list[torch.Tensor]:
    """Every rank's combined tokens: for each rank holding some of a token's valid entries, in
    rank order, their expert rows weighted and added in slot order (the partial), rounded to the
    dtype (and through block FP8 with ``quant``); the partials added in fp32."""
    world = len(ids)
    local = num_experts // world
    outs = []
    for q in range(world):
        n, k = ids[q].shape
        hidden = expert_outs[0].shape[1]
        dtype = expert_outs[0].dtype
        out = torch.zeros(n, hidden, dtype=dtype)
        for t in range(n):
            total = torch.zeros(hidden, dtype=torch.float32)
            for p in range(world):
                acc = torch.zeros(hidden, dtype=torch.float32)
                held = False
                for j in range(k):
                    row = int(send_rows[q][t, j])
                    if row < 0 or int(ids[q][t, j]) // local != p:
                        continue
                    acc = acc + weights[q][t, j].float() * expert_outs[p][row].float()
                    held = True
                if not held:
                    continue
                partial = acc.to(dtype)[None]
                partial = fp8.dequantize_float(*fp8.quantize(partial)) if quant == "fp8" else partial.float()
                total = total + partial[0]
            out[t] = total.to(dtype)
        outs.append(out)
    return outs


def world_groups(ids: list[torch.Tensor], weights: list[torch.Tensor], send_rows: list[torch.Tensor],
                 num_experts: int, max_tokens: int) -> list[dict[tuple[int, int], list[tuple[int, int]]]]:
    """Per rank p: recv_group's defined slots, {(q, t): [(row, weight bits), ...]}: rank q's token
    t's entries on p in slot order, then (-1, 0) if fewer than k; [(-1, 0)] for a token with none
    there and for every t past rank q's tokens."""
    world, k = len(ids), ids[0].shape[1]
    local = num_experts // world
    defined: list[dict[tuple[int, int], list[tuple[int, int]]]] = [{} for _ in range(world)]
    for q in range(world):
        for t in range(max_tokens):
            for p in range(world):
                listed = []
                if t < ids[q].shape[0]:
                    listed = [(int(send_rows[q][t, j]), int(weights[q][t, j].float().view(torch.int32)))
                              for j in range(k)
                              if int(send_rows[q][t, j]) >= 0 and int(ids[q][t, j]) // local == p]
                if len(listed) < k:
                    listed.append((-1, 0))
                defined[p][(q, t)] = listed
    return defined


def group_mismatches(group: torch.Tensor, defined: dict[tuple[int, int], list[tuple[int, int]]]) -> list[str]:
    """Where a recv_group tensor [W, max_tokens, k, 2] differs from world_groups' defined slots."""
    got = group.cpu()
    return [f"(q {q}, t {t}): {got[q, t, :len(want)].tolist()} != {[list(p) for p in want]}"
            for (q, t), want in defined.items() if got[q, t, :len(want)].tolist() != [list(p) for p in want]]


def random_case(world: int, tokens: list[int], hidden: int, num_experts: int, k: int, seed: int,
                dtype: torch.dtype = torch.bfloat16, ids_dtype: torch.dtype = torch.int64, skip: float = 0.1,
                only_experts: list[int] | None = None, repeat: float = 0.0) -> tuple[list, list, list]:
    """Per rank: tokens [n, hidden], top-k ids [n, k] (distinct per token unless ``repeat``, the
    share of slots after the first that repeat the token's first id; some -1; drawn from
    ``only_experts`` when given, so other experts get nothing), weights float32 [n, k]."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(only_experts if only_experts is not None else list(range(num_experts)))
    xs, ids, ws = [], [], []
    for n in tokens:
        x = (torch.randn(n, hidden, generator=gen) * torch.logspace(-1, 1, max(n, 1))[:n, None]).to(dtype)
        pick = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n)]) if n else \
            torch.empty(0, k, dtype=torch.int64)
        if n and len(pool) < k:
            raise ValueError("fewer experts to draw from than k")
        if repeat:
            again = torch.rand(n, k, generator=gen) < repeat
            again[:, 0] = False
            pick = torch.where(again, pick[:, :1], pick)
        drop = torch.rand(n, k, generator=gen) < skip
        pick = torch.where(drop, -1, pick)
        xs.append(x)
        ids.append(pick.to(ids_dtype))
        ws.append(torch.rand(n, k, generator=gen))
    return xs, ids, ws
