"""``a2a``: moe_dispatch and moe_combine composed from collectives, on any device (the CPU's
path over gloo, the reference the peer kernels are held to, NCCL's on GPUs).

Dispatch: the layout in torch (symcomm/ep/layout.py), one all_gather of this rank's counts
into the handle's table, the counts read on the host (one synchronisation: the byte counts of
an all_to_allv live on the host), then one all_to_allv of the rows (quantized first when asked)
with each row's destination, origin and weight beside it, placed on arrival. Combine: one all_gather of
what the ranks must agree on (quant, dtype, the handle's sizes), then each group of rows a rank
holds added up there (symcomm/ep/layout.py, "Combine, by rank") and the partials sent back the same
way, grouped by their owner, who adds them in rank order. The inner collectives are
chosen by their own dispatch (or ``algo=`` forced one), and run without a second validation.

Reading counts on the host cannot be captured in a CUDA graph: during a capture this path
declines, and the peer-memory path (ep_push.py) is the one that can serve. A world of one rank
is the exception: every row's place is known on the device, nothing is sent, and the step is
captured like any local code.
"""
from __future__ import annotations

import torch

from .. import fp4
from ..base import capturing
from ..errors import PeerMismatchError
from ..ep import fp8, layout
from ..operations.all_to_allv import make_all_to_allv
from ..operations.collectives import make_all_gather
from .._native import DTYPE_CODES
from ..operations.moe_combine import OP as COMBINE_OP, QUANTS as COMBINE_QUANTS, CombineCall
from ..operations.moe_dispatch import A2A, OP as DISPATCH_OP, DispatchCall
from .composite import CompositePath

_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
CAPTURE_REASON = ("reads the token counts on the host, which a CUDA-graph capture cannot do; the peer-push path "
                  "serves captured calls")


def _split(table: list[list[int]], rank: int, local: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each rank, rows it receives from each) from the counts table."""
    world = len(table)
    send = [sum(table[rank][p * local:(p + 1) * local]) for p in range(world)]
    recv = [sum(table[q][rank * local:(rank + 1) * local]) for q in range(world)]
    return send, recv


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view with the same rows: index_put does not take every dtype (float8)."""
    row = t.element_size() * torch.Size(t.shape[1:]).numel()
    return t.view(torch.uint8) if t.element_size() == 1 else t.reshape(t.shape[0], row // t.element_size()).view(
        torch.uint8)


class A2aDispatchPath(CompositePath):
    ops = frozenset({DISPATCH_OP})
    name = A2A

    def why_not(self, call: DispatchCall) -> str | None:
        return CAPTURE_REASON if call.world > 1 and capturing(call.x.device) else None

    def compared_offsets(self, call: DispatchCall) -> tuple[str, ...]:
        return ()  # sends and receives: no peer touches this rank's buffers at its offsets

    def run(self, call: DispatchCall) -> None:
        rank, h = self._dispatcher.rank, call.handle
        ids, n, k, experts = call.topk_ids, call.x.shape[0], h.topk, call.num_experts
        valid = layout.valid_entries(ids, experts)
        counts, pos = layout.counts_and_positions(ids, valid, experts)
        mark = torch.full((1,), call.fingerprint(), dtype=counts.dtype, device=counts.device)  # no host copy
        row = torch.cat([counts, mark])
        if h.world == 1:
            h.table.view(-1).copy_(row)
        else:
            self._run_inner(make_all_gather(row, h.table.view(-1)), call.inner_algo)
        base, expert_counts, expert_offsets = layout.placement(h.table, experts, rank, call.align)
        call.expert_counts.copy_(expert_counts)
        call.expert_offsets.copy_(expert_offsets)
        rows = layout.send_rows(ids, pos, base)
        h.send_rows[:n].copy_(rows)
        if h.world == 1:
            self._place_locally(call, rows, valid)
            return
        table = h.table.tolist()
        marks = [r[experts] for r in table]
        if any(m != marks[0] for m in marks):  # every rank sees the same table: all raise alike
            raise PeerMismatchError(f"{DISPATCH_OP}: the ranks passed different sizes (max_tokens, top-k, align, "
                                    f"hidden, dtype or quant; fingerprints by rank {marks}); no row was sent")
        send, recv = _split(table, rank, experts // h.world)
        order = layout.entry_order(ids, valid, experts)[:sum(send)]
        tokens = order // k
        origin = (rank * call.max_tokens + tokens) * k + order % k
        weight = layout.weight_bits(call.topk_weights.reshape(-1)[order]).long()
        meta = torch.stack([rows.reshape(-1)[order].long(), origin, weight], dim=1).to(torch.int32)
        payload = [_bytes(t[tokens]) for t in self._encoded(call)]
        arrived = [t.new_empty((sum(recv), *t.shape[1:])) for t in (*payload, meta)]
        self._run_inner(make_all_to_allv([*payload, meta], arrived, send, recv), call.inner_algo)
        h.recv_src.fill_(-1)
        meta = arrived[-1]
        self._place(call, meta[:, 0].long(), meta[:, 1], arrived[:-1])
        h.recv_group.copy_(layout.groups(meta[:, 1], meta[:, 0], meta[:, 2].view(torch.float32), h.world,
                                         call.max_tokens, k))

    def _place_locally(self, call: DispatchCall, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """One rank: every entry's row is known on the device, so the rows go straight to their
        places with no count read on the host (this is what lets a world of one be captured).
        Skipped entries go to distinct rows past the used ones, which the layout leaves
        unspecified: there are at least as many of those as skipped entries, since capacity holds
        every entry of max_tokens tokens."""
        n, k = call.topk_ids.shape
        skipped = ~valid.reshape(-1)
        spare = call.capacity - torch.cumsum(skipped.long(), 0)  # distinct, and >= the used rows
        dst = torch.where(skipped, spare, rows.reshape(-1).long())
        entries = torch.arange(n * k, device=dst.device)
        origin = torch.where(skipped, -1, entries).to(torch.int32)  # rank 0's entry t*k + j
        call.handle.recv_src.fill_(-1)
        rows_of = [_bytes(t) for t in self._encoded(call)]
        per_entry = [t.unsqueeze(1).expand(n, k, t.shape[1]).reshape(n * k, t.shape[1]) for t in rows_of]
        self._place(call, dst, origin, per_entry)
        call.handle.recv_group.copy_(layout.groups(origin, dst, call.topk_weights.reshape(-1).float(), 1,
                                                   call.max_tokens, k))

    @staticmethod
    def _place(call: DispatchCall, dst: torch.Tensor, origin: torch.Tensor, payload: list[torch.Tensor]) -> None:
        """Arrived rows (and their scales) into their rows of the receive buffers."""
        call.handle.recv_src[dst] = origin
        _bytes(call.recv)[dst] = payload[0]
        if call.recv_scales is None:
            return
        scales = _bytes(call.recv_scales)
        if call.swizzle:
            cols = call.x.shape[1] // fp4.BLOCK
            scales.view(-1)[layout.swizzled_scale_index(dst, cols).reshape(-1)] = payload[1].reshape(-1)
        else:
            scales[dst] = payload[1]

    @staticmethod
    def _encoded(call: DispatchCall) -> list[torch.Tensor]:
        """This rank's tokens as they travel: the rows, or their quantized payload and scales."""
        if call.quant == "nvfp4":
            return list(fp4.quantize(call.x, call.gs))
        if call.quant == "fp8":
            return list(fp8.quantize(call.x))
        return [call.x]


class A2aCombinePath(CompositePath):
    ops = frozenset({COMBINE_OP})
    name = A2A

    def why_not(self, call: CombineCall) -> str | None:
        return CAPTURE_REASON if call.handle.world > 1 and capturing(call.expert_out.device) else None

    def compared_offsets(self, call: CombineCall) -> tuple[str, ...]:
        return ()

    def run(self, call: CombineCall) -> None:
        h = call.handle
        n, k, world, hidden = h.tokens, h.topk, h.world, h.hidden
        valid = h.send_rows[:n] >= 0
        if world == 1:  # every group is here: the same sums on the device, no count on the host
            place = (torch.cumsum(valid.int(), dim=1) - 1).clamp(min=0).long()  # an entry's place in its group
            listed = h.recv_group[0, :n]
            weights = listed[torch.arange(n, device=place.device)[:, None], place, 1].view(torch.float32)
            values = call.expert_out[h.send_rows[:n].reshape(-1).clamp(min=0).long()].float().view(n, k, hidden)
            ranks = torch.zeros_like(valid, dtype=torch.int64)
            call.out.copy_(layout.combine_by_rank(values, weights, valid, ranks, 1, h.dtype, call.quant))
            return
        self._agree(call)
        # The groups this rank holds, by the rank that owns the token, then by token: the order
        # that rank expects their partials in.
        listed = h.recv_group.view(world * h.max_tokens, k, 2)
        held = (listed[:, 0, 0] >= 0).nonzero().flatten()
        partial = layout.group_sums(call.expert_out, listed[held]).to(h.dtype)
        send = torch.bincount(held // h.max_tokens, minlength=world).tolist()
        ranks = h.topk_ids.long() // (h.num_experts // world)
        present = torch.stack([(valid & (ranks == p)).any(dim=1) for p in range(world)])  # [W, n]
        recv = present.sum(dim=1).tolist()
        payload = list(fp8.quantize(partial)) if call.quant == "fp8" else [partial]
        arrived = [t.new_empty((sum(recv), *t.shape[1:])) for t in payload]
        self._run_inner(make_all_to_allv(payload, arrived, send, recv), call.inner_algo)
        values = fp8.dequantize_float(*arrived) if call.quant == "fp8" else arrived[0].float()
        partials = torch.zeros(world, n, hidden, dtype=torch.float32, device=values.device)
        partials[present] = values  # rank by rank, tokens in order: the order they were sent in
        call.out.copy_(layout.owner_sum(partials, present, h.dtype))

    def _agree(self, call: CombineCall) -> None:
        """Every rank's quant, dtype and the handle's sizes, compared before any row moves: each
        rank computes the exchange's counts alone (from the sizes and its layout), so a rank
        that encoded its rows another way, or passed another dispatch's handle, would pair them
        with buffers sized for something else. Every rank sees the same table and raises alike."""
        h = call.handle
        columns = (("quant", COMBINE_QUANTS.index(call.quant), lambda v: COMBINE_QUANTS[v] or "none"),
                   ("dtype", DTYPE_CODES[h.dtype], _DTYPE_NAMES.__getitem__),
                   ("hidden", h.hidden, str), ("max_tokens", h.max_tokens, str), ("top-k", h.topk, str),
                   ("num_experts", h.num_experts, str), ("align", h.align, str))
        mine = torch.tensor([value for _, value, _ in columns], dtype=torch.int32, device=h.recv_src.device)
        every = mine.new_empty(h.world * len(columns))
        self._run_inner(make_all_gather(mine, every), call.inner_algo)
        table = every.view(h.world, len(columns)).tolist()
        for i, (name, _, show) in enumerate(columns):
            if any(row[i] != table[0][i] for row in table):
                by_rank = ", ".join(f"rank {r}: {show(row[i])}" for r, row in enumerate(table))
                raise PeerMismatchError(f"{COMBINE_OP}: the ranks passed different {name} ({by_rank}), or the handles "
                                        f"of different dispatches; no row was sent")
