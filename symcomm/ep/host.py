"""csrc/ep.cu's dispatch and combine run on the CPU for W simulated ranks at once
(symcomm_ep_dispatch_host, symcomm_ep_combine_host): the kernels' per-entry and per-row code
(csrc/ep.cuh) on host tensors, so machines without a GPU check the bytes the kernels write
against symcomm/ep/layout.py. Not a path: it exists for tests.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .. import _native, fp4
from ..errors import ArgumentError
from ..operations.moe_dispatch import BufferSpec, buffer_specs

_c = ctypes
_I32P = _c.POINTER(_c.c_int32)


@dataclass
class HostRank:
    """One simulated rank's dispatch buffers (what Dispatched and EpHandle hold on a device)."""

    recv: torch.Tensor
    scales: torch.Tensor | None
    recv_src: torch.Tensor
    table: torch.Tensor
    recv_group: torch.Tensor
    send_rows: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    returned: torch.Tensor


def _poisoned(spec: BufferSpec) -> torch.Tensor:
    """A new tensor whose every byte is 0xA5: what no write left behind shows."""
    t = torch.empty(spec.shape, dtype=spec.dtype)
    t.view(torch.uint8).fill_(0xA5)
    return t


# Every buffer's value before a dispatch: 0xA5 bytes (None) where rows land, -7 in the index lists,
# zeros in the counts. A buffer buffer_specs gains must be given one here (KeyError otherwise).
_BLANK = {"handle.table": 0, "out.x": None, "out.scales": None, "handle.recv_src": -7, "handle.recv_group": -7,
          "handle.returned": None, "handle.send_rows": -7, "out.expert_counts": 0, "out.expert_offsets": 0}


def _blank(name: str, spec: BufferSpec) -> torch.Tensor:
    fill = _BLANK[name]
    return _poisoned(spec) if fill is None else torch.full(spec.shape, fill, dtype=spec.dtype)


def _i32(t: torch.Tensor) -> ctypes._Pointer:
    return _c.cast(t.data_ptr(), _I32P)


def dispatch_host(xs: list[torch.Tensor], ids: list[torch.Tensor], weights: list[torch.Tensor], num_experts: int,
                  max_tokens: int, quant: str | None = None, global_scale: float = 1.0, align: int = 1,
                  swizzle: bool = False) -> list[HostRank]:
    """Every rank's buffers after one dispatch of rank r's tokens ``xs[r]`` with ``ids[r]`` and
    ``weights[r]``. Unwritten bytes keep _BLANK's values (0xA5 in rows, scales and returned; -7
    in recv_src, recv_group and send_rows)."""
    world = len(xs)
    k = ids[0].shape[1]
    hidden = xs[0].shape[1]
    specs = buffer_specs(world, max_tokens, k, num_experts, hidden, xs[0].dtype, quant, swizzle, align)
    cap = specs["out.x"].shape[0]
    ranks = []
    args = (_native.EpDispatchArgs * world)()
    for r in range(world):
        x, i, w = xs[r].contiguous(), ids[r].contiguous(), weights[r].contiguous()
        if x.device.type != "cpu" or i.device.type != "cpu" or w.device.type != "cpu":
            raise ArgumentError("dispatch_host takes CPU tensors")
        blank = {name: _blank(name, spec) for name, spec in specs.items()}
        rank = HostRank(blank["out.x"], blank.get("out.scales"), blank["handle.recv_src"], blank["handle.table"],
                        blank["handle.recv_group"], blank["handle.send_rows"], blank["out.expert_counts"],
                        blank["out.expert_offsets"], blank["handle.returned"])
        ranks.append(rank)
        a = args[r]
        a.x, a.dtype, a.rows, a.cols = x.data_ptr(), _native.DTYPE_CODES[x.dtype], x.shape[0], hidden
        a.topk_ids, a.ids_int64, a.topk = i.data_ptr(), int(i.dtype == torch.int64), k
        a.weights, a.weights_dtype = w.data_ptr(), _native.DTYPE_CODES[w.dtype]
        a.num_experts, a.max_tokens, a.align, a.capacity = num_experts, max_tokens, align, cap
        a.quant, a.gs_value, a.swizzle = _native.EP_QUANT_CODES[quant], float(global_scale), int(swizzle)
        a.send_rows, a.expert_counts, a.expert_offsets = (_i32(rank.send_rows), _i32(rank.expert_counts),
                                                          _i32(rank.expert_offsets))
        xs[r], ids[r], weights[r] = x, i, w  # keep the contiguous copies alive through the call
    recv = (_c.c_void_p * world)(*(r.recv.data_ptr() for r in ranks))
    scales = (_c.c_void_p * world)(*((r.scales.data_ptr() if r.scales is not None else None) for r in ranks))
    src = (_I32P * world)(*(_i32(r.recv_src) for r in ranks))
    table = (_I32P * world)(*(_i32(r.table) for r in ranks))
    group = (_I32P * world)(*(_i32(r.recv_group) for r in ranks))
    lib = fp4.host_lib()
    _native.check(lib, "symcomm_ep_dispatch_host",
                  lib.symcomm_ep_dispatch_host(world, args, recv, scales, src, table, group))
    return ranks


def combine_host(ranks: list[HostRank], expert_outs: list[torch.Tensor], ids: list[torch.Tensor], max_tokens: int,
                 quant: str | None = None) -> list[torch.Tensor]:
    """Every rank's combined tokens, after dispatch_host gave ``ranks`` for tokens picked by ``ids``
    (the weights travelled with the dispatch)."""
    world = len(ranks)
    args = (_native.EpCombineArgs * world)()
    outs = []
    for r, rank in enumerate(ranks):
        y, i = expert_outs[r].contiguous(), ids[r].contiguous()
        n, k = i.shape
        out = torch.full((n, y.shape[1]), float("nan"), dtype=y.dtype)
        outs.append(out)
        a = args[r]
        a.expert_out, a.dtype, a.cols, a.capacity = y.data_ptr(), _native.DTYPE_CODES[y.dtype], y.shape[1], y.shape[0]
        a.quant = _native.EP_QUANT_CODES[quant]
        a.recv_group, a.num_local = _i32(rank.recv_group), len(rank.expert_counts)
        a.max_tokens, a.topk, a.rows, a.send_rows = max_tokens, k, n, _i32(rank.send_rows)
        a.topk_ids, a.ids_int64, a.out = i.data_ptr(), int(i.dtype == torch.int64), out.data_ptr()
        expert_outs[r], ids[r] = y, i
    returned = (_c.c_void_p * world)(*(r.returned.data_ptr() for r in ranks))
    lib = fp4.host_lib()
    _native.check(lib, "symcomm_ep_combine_host", lib.symcomm_ep_combine_host(world, args, returned))
    return outs


__all__ = ["HostRank", "combine_host", "dispatch_host"]
