"""Every rank's small JSON value, gathered over the benchmark's process group.

Byte tensors rather than ``all_gather_object``, which needs numpy that a CPU-only machine may
lack; on the stats device, since an NCCL group takes only CUDA tensors.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def gather_json(value: object, device: torch.device) -> list:
    """``value`` from every rank, in rank order. Collective."""
    raw = json.dumps(value).encode()
    world = dist.get_world_size()
    length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    size = max(int(n.item()) for n in lengths)
    local = torch.zeros(size, dtype=torch.uint8, device=device)
    if raw:
        local[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    rows = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(rows, local)
    return [json.loads(bytes(row[:int(n.item())].tolist())) for row, n in zip(rows, lengths)]
