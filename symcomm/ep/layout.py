"""Where every token of an expert-parallel dispatch lands, and how combine adds it back: the
definition, in plain torch (any device, no host synchronisation). Every path of moe_dispatch and
moe_combine produces exactly this (the ``a2a`` path computes it with these functions; the
peer-memory kernels in csrc/ep.cu and their CPU twin compute it their own way, and tests hold
them to it bit for bit).

Experts are split evenly: rank p holds the ``E / W`` experts ``p*E/W ..``; expert id ``i``
lives on rank ``i // (E/W)`` as its local expert ``i % (E/W)``.

- **Entries.** Rank q's token t picks experts ``ids[t, 0..k-1]``. Entry (t, j) is *valid* when
  ``0 <= ids[t, j] < E`` and no earlier slot of the same token names the same expert; others
  (``-1`` marks "no expert", for padding) are skipped everywhere: not sent, not added.
- **Counts.** ``counts[q, i]``: rank q's valid entries for expert i. Every rank gets the whole
  [W, E] table (it is what every rank needs to place its rows without asking anyone), plus one
  column: each rank's ``fingerprint`` of the sizes it passed, so that ranks which sized their
  buffers differently all stop before a row moves.
- **Receive layout on rank p.** Its local expert e gets one segment of
  ``align_up(sum_q counts[q, p*E/W + e], align)`` rows, segments in expert order from row 0:
  ``expert_offsets[e]`` is where segment e starts and ``expert_offsets[E/W]`` the rows used;
  ``expert_counts[e]`` the rows filled. Inside a segment, rank 0's rows come first, then rank
  1's, ...; one rank's rows keep its token order. Rows after the filled ones of a segment
  (alignment padding) and after the last segment are not written.
- **Rows.** Entry (t, j) of rank q for expert i, the ``pos``-th valid entry of rank q for expert i
  in token order, lands on rank ``p = i // (E/W)`` at row
  ``expert_offsets_p[e] + sum_{q' < q} counts[q', i] + pos``. ``send_rows[t, j]`` is that row
  (``-1`` for a skipped entry), ``recv_src[row] = (q * max_tokens + t) * k + j`` names the
  entry a row came from (``-1`` for rows not written).
- **Capacity.** A rank receives at most ``W * max_tokens * min(k, E/W)`` rows (a token's valid
  entries name distinct experts, at most E/W of them on one rank) plus ``E/W * (align - 1)`` of
  padding: every buffer is sized for that, equal on every rank, so nothing depends on counts
  known only on the device.
- **Groups.** A token's valid entries that land on one rank form a *group* there.
  ``recv_group[q, t]`` (int32 [W, max_tokens, k, 2] on every rank) lists the group of rank q's
  token t as (row, fp32 bits of the entry's top-k weight, as dispatch read it) in slot order, then
  (-1, 0) where the group has fewer than k entries. A token with no entry on the rank (and every
  t from rank q's token count on) has (-1, 0) first. Slots after the (-1, 0) are not written.
- **Combine, by rank.** The rank holding a group adds it up: its *partial* is
  ``acc = +0.0``, then for the group's entries in slot order ``acc = acc + w * y`` in fp32 (a
  rounded multiply, then a rounded add: no fused multiply-add), where y is the expert output
  row the entry came back as and w the weight dispatch read; rounded once to the output dtype
  (and with ``quant="fp8"``, encoded as block FP8 and decoded). The partial goes back to the
  token's rank, one row per token and rank: the rank's own rows in slot order cross NVLink
  once, summed, instead of once each. Token t's output is then ``acc = +0.0``, and for every
  rank p holding a group of t, in rank order, ``acc = acc + partial_p`` in fp32, rounded once to
  the output dtype. A token with no valid entry gets zeros. ``returned`` holds the partials
  coming back to a rank: row ``p * max_tokens + t`` is rank p's for token t.
"""
from __future__ import annotations

import torch

from .. import fp4
from . import fp8
from .._native import DTYPE_CODES, EP_QUANT_CODES


def capacity(world: int, max_tokens: int, topk: int, num_experts: int, align: int) -> int:
    """Rows every rank's receive buffer holds (the same on every rank)."""
    local = num_experts // world
    return world * max_tokens * min(topk, local) + local * (align - 1)


def fingerprint(capacity_rows: int, row_bytes: int, topk: int, align: int, max_tokens: int,
                num_experts: int, quant: str | None, hidden: int, dtype: torch.dtype) -> int:
    """csrc/ep.cuh's fingerprint: what every rank of a dispatch must agree on, as one int32 (the
    encoding and the dtype by the codes the kernels get)."""
    h = 0
    for part in (capacity_rows, row_bytes, topk, align, max_tokens, num_experts, EP_QUANT_CODES[quant], hidden,
                 DTYPE_CODES[dtype]):
        h = ((h * 1000003) & 0xFFFFFFFFFFFFFFFF) ^ part
    return h & 0x7FFFFFFF


def valid_entries(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [n, k]: the entries that are sent (in range, first of their expert in the token)."""
    ids = ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    for j in range(1, ids.shape[1]):
        repeat = (ids[:, :j] == ids[:, j:j + 1]).any(dim=1)
        valid[:, j] &= ~repeat
    return valid


def entry_order(ids: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flat entry indices (t * k + j), the valid ones first, by expert id, token order inside an
    expert: the order rows leave this rank in (grouped by destination rank) and come back in."""
    key = torch.where(valid, ids.long(), num_experts).reshape(-1)
    return torch.argsort(key, stable=True)


def counts_and_positions(ids: torch.Tensor, valid: torch.Tensor,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts int32 [E]: this rank's valid entries per expert, pos int32 [n, k]: each valid
    entry's index among this rank's entries for its expert in token order, -1 for skipped)."""
    n, k = ids.shape
    key = torch.where(valid, ids.long(), num_experts).reshape(-1)
    # scatter_add rather than bincount: bincount reads its input's maximum on the host, which a
    # CUDA-graph capture cannot do (a world of one rank captures this)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    order = torch.argsort(key, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    first = torch.cat([starts, starts.new_zeros(1)])  # skipped entries: anything, masked below
    ranked = torch.arange(n * k, device=ids.device) - first[key[order]]
    pos = torch.empty(n * k, dtype=torch.int64, device=ids.device)
    pos[order] = ranked
    pos = torch.where(valid.reshape(-1), pos, -1)
    return counts.to(torch.int32), pos.view(n, k).to(torch.int32)


def placement(table: torch.Tensor, experts: int, rank: int,
              align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the [W, E] counts table (a fingerprint column after it is ignored): (base int64 [E]:
    the row on expert i's rank where this rank's first entry for i lands, expert_counts int32
    [E/W] and expert_offsets int32 [E/W + 1]: this rank's receive layout)."""
    world = table.shape[0]
    local = experts // world
    table = table[:, :experts].long()
    total = table.sum(0)
    before = table[:rank].sum(0)
    seg = ((total + align - 1) // align * align).view(world, local)
    offsets = torch.cumsum(seg, dim=1) - seg
    base = offsets.reshape(experts) + before
    mine = offsets[rank]
    expert_offsets = torch.cat([mine, (mine[-1:] + seg[rank, -1:])])
    return base, total.view(world, local)[rank].to(torch.int32), expert_offsets.to(torch.int32)


def send_rows(ids: torch.Tensor, pos: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """int32 [n, k]: the destination row of every entry, -1 for the skipped ones."""
    valid = pos >= 0
    row = base[torch.where(valid, ids.long(), 0)] + pos.long()
    return torch.where(valid, row, -1).to(torch.int32)


def padding_rows(expert_counts: torch.Tensor, expert_offsets: torch.Tensor, capacity_rows: int) -> torch.Tensor:
    """bool [capacity]: rows of this rank's receive buffer that no entry fills."""
    rows = torch.arange(capacity_rows, device=expert_offsets.device)
    starts, ends = expert_offsets[:-1].long(), expert_offsets[1:].long()
    filled_end = starts + expert_counts.long()
    seg = torch.searchsorted(ends, rows, right=True).clamp(max=len(ends) - 1)
    return ~((rows >= starts[seg]) & (rows < filled_end[seg]))


def weight_bits(weights: torch.Tensor) -> torch.Tensor:
    """int32: the fp32 bits of each weight, as recv_group holds them."""
    return weights.float().view(torch.int32)


def groups(origin: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, world: int, max_tokens: int,
           topk: int) -> torch.Tensor:
    """recv_group (module docstring) of one rank from the entries it received: each one's origin
    (``(q * max_tokens + t) * k + j``, or -1 for none), the row it landed in and its weight (fp32),
    with no host synchronisation (a world of one captures it). Every slot a group leaves is (-1, 0)."""
    device = origin.device
    slots = world * max_tokens * topk
    out = torch.full((slots + 1, 2), -1, dtype=torch.int32, device=device)  # the last: where no-entries go
    out[:, 1] = 0
    if origin.numel():
        live = origin >= 0
        order = torch.argsort(torch.where(live, origin.long(), torch.iinfo(torch.int64).max), stable=True)
        origin, rows, weights, live = origin.long()[order], rows[order], weights[order], live[order]
        group = origin // topk  # rank q's token t: q * max_tokens + t
        first = torch.ones_like(live)
        first[1:] = group[1:] != group[:-1]
        index = torch.arange(len(group), device=device)
        start = torch.cummax(torch.where(first, index, 0), 0).values  # each group together, in slot order
        at = torch.where(live, group * topk + (index - start), slots)
        out[at, 0] = rows.to(torch.int32)
        out[at, 1] = weight_bits(weights)
    return out[:slots].view(world, max_tokens, topk, 2)


def group_sums(expert_out: torch.Tensor, listed: torch.Tensor) -> torch.Tensor:
    """fp32 [G, H]: the partial (module docstring, "Combine, by rank") of each group in ``listed``
    ([G, k, 2], recv_group entries that hold at least one row) from the expert output rows."""
    rows, weights = listed[..., 0].long(), listed[..., 1].contiguous().view(torch.float32)
    live = torch.cumprod((rows >= 0).int(), dim=1).bool()  # up to the first (-1, 0)
    rows = torch.where(live, rows, 0)  # slots after it hold another dispatch's bytes: never an index
    acc = torch.zeros(rows.shape[0], expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    for j in range(rows.shape[1]):
        y = expert_out[rows[:, j]].float()
        acc = torch.where(live[:, j:j + 1], acc + weights[:, j:j + 1] * y, acc)
    return acc


def as_returned(partial: torch.Tensor, dtype: torch.dtype, quant: str | None) -> torch.Tensor:
    """fp32: the values an owner adds for a partial: rounded to ``dtype``, and block FP8's round trip
    with ``quant="fp8"``."""
    rounded = partial.to(dtype)
    return fp8.dequantize_float(*fp8.quantize(rounded)) if quant == "fp8" else rounded.float()


def owner_sum(partials: torch.Tensor, present: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tokens' outputs from the values of every rank's partial [W, n, H] (fp32, as returned)
    where ``present`` [W, n] says rank p holds a group of token t: rank order, fp32, rounded once."""
    acc = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for p in range(partials.shape[0]):
        acc = torch.where(present[p, :, None], acc + partials[p], acc)
    return acc.to(dtype)


def combine_by_rank(values: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, ranks: torch.Tensor, world: int,
                    dtype: torch.dtype, quant: str | None) -> torch.Tensor:
    """The combine (module docstring) of one rank's tokens from the fp32 values [n, k, H] each
    entry came back as, its weights [n, k], which entries are valid and the rank holding each."""
    n, k, h = values.shape
    w = weights.float()
    partials = torch.zeros(world, n, h, dtype=torch.float32, device=values.device)
    present = torch.zeros(world, n, dtype=torch.bool, device=values.device)
    for p in range(world):
        acc = torch.zeros(n, h, dtype=torch.float32, device=values.device)
        for j in range(k):
            here = valid[:, j] & (ranks[:, j] == p)
            acc = torch.where(here[:, None], acc + w[:, j:j + 1] * values[:, j], acc)
            present[p] |= here
        partials[p] = as_returned(acc, dtype, quant)
    return owner_sum(partials, present, dtype)


def swizzled_scale_index(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """Flat indices [len(rows), cols] of block scales (row, c) in fp4's 128x4 layout of a matrix
    with ``cols`` scale columns (csrc/fp4.cuh's swizzled_index)."""
    padded = fp4.swizzled_shape(1, cols)[1]
    r = rows.long().unsqueeze(1)
    c = torch.arange(cols, device=rows.device).unsqueeze(0)
    tile = (r >> 7) * (padded >> 2) + (c >> 2)
    return tile * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)
