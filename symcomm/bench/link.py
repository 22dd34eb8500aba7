"""How close to the wire: the bytes a collective must move over one GPU's links, and the time a
copy-engine peer copy of those bytes takes in the same run.

A collective of S bytes must move S x bus_factor over each GPU's links (nccl-tests' busbw
factor: 2(W-1)/W for all-reduce, (W-1)/W for gathers and reduce-scatters), whatever its
algorithm. The ``link-copy`` column times exactly that many bytes crossing the link with no
collective around them: every rank at once pulls them from the next rank's buffer
(``dst.copy_(peer view)`` on a PyTorch symmetric-memory buffer, which CUDA runs as a peer
memcpy on the copy engine), captured and replayed like every other column. The summary then
gives each size's bytes on the wire per GPU and the fraction of that copy's speed auto reached
(link-copy time / auto time: 1.00 is the link's copy speed).

The source buffer is made once per size, filled with rank-seeded bytes and made visible before
any peer reads it (the device is synchronised before the collective rendezvous); the check
compares what arrived with the next rank's bytes, regenerated here. Refused, before any
communication and alike on every rank, where nothing crosses a link (world 1, an empty
message) or torch's symmetric memory cannot run.
"""
from __future__ import annotations

import torch

from . import torch_symm
from .spec import Case, Cases, Refusal, Setup

LINK = "link-copy"
NOTES = [f"{LINK}: the row's bytes on the wire per GPU (size x the busbw factor) pulled from the next "
         "rank's PyTorch symmetric-memory buffer by a copy-engine peer copy, every rank at once: the "
         "link's speed for this many bytes, beside which the summary puts auto's time"]


def wire_bytes(nbytes: int, factor: float) -> int:
    """Bytes over one GPU's links for a collective of ``nbytes`` with busbw factor ``factor``."""
    return int(nbytes * factor)


def refusal(device: torch.device, world: int, wire: int) -> str | None:
    if world < 2:
        return "world 1: nothing crosses a link"
    if wire == 0:
        return "an empty message: nothing crosses a link"
    return torch_symm.unavailable(device, ops=())


def _pattern(nbytes: int, seed: int, rank: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    return torch.randint(0, 256, (nbytes,), generator=gen, device=device, dtype=torch.uint8)


def cases(setup: Setup, wire: int) -> Cases:
    """The link-copy column at one size (both modes time the same copy)."""
    why = refusal(setup.device, setup.world, wire)
    if why is not None:
        refused = Refusal(why)
        return lambda column, inplace: refused
    made: list[Case] = []

    def build() -> Case:
        from torch.distributed import _symmetric_memory as symm_mem
        import torch.distributed as dist
        peer = (setup.rank + 1) % setup.world
        src = symm_mem.empty(wire, dtype=torch.uint8, device=setup.device)
        src.copy_(_pattern(wire, setup.seed, setup.rank, setup.device))
        # The peers read src as soon as their rendezvous returns: it must be written by then.
        torch.cuda.synchronize(setup.device)
        handle = symm_mem.rendezvous(src, dist.group.WORLD.group_name)
        view = handle.get_buffer(peer, (wire,), torch.uint8)
        dst = torch.empty(wire, dtype=torch.uint8, device=setup.device)
        expected = _pattern(wire, setup.seed, peer, setup.device)
        spoiled = torch.bitwise_not(expected)  # every byte differs: a copy that did nothing counts all wrong

        def call() -> object:
            return dst.copy_(view)

        def count() -> int:
            return int((dst != expected).sum().item())

        def corrupt() -> None:
            dst[0] = spoiled[0]

        return Case(call=call, load=lambda: dst.copy_(spoiled), count=count if setup.check else None,
                    corrupt=corrupt)

    def case(column: str, inplace: bool) -> Case:
        # Made when the column first asks at this size (tune never asks): the rendezvous is
        # collective, and every rank asks for the columns in the same order.
        if not made:
            made.append(build())
        return made[0]
    return case


def fraction(link_us: float | None, auto_us: float | None) -> float | None:
    """auto's share of the link's copy speed: link-copy time / auto time."""
    return link_us / auto_us if link_us and auto_us else None

