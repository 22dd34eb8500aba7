"""``symcomm-bench moe``: one MoE layer's token exchange, dispatch + combine, per size, one column
per way of doing it, in the same run:

- ``all_to_all_single``: the baseline every peer starts from: each (token, expert) entry's row
  sent to its expert's rank with torch.distributed.all_to_all_single (counts first, exchanged
  the same way and read on the host), then sent back the same way and summed with the top-k
  weights. It does less than the others: its rows arrive grouped by source, not by expert.
  Eager only: its split sizes are read on the host.
- ``a2a-buckets``: the same exchange as a CUDA graph can hold it, as serving engines capture
  it: every rank sends every peer a bucket of ``tokens x min(topk, experts per rank)`` rows (the
  most one rank can send another), filled on the device in token order, with one equal-split
  all_to_all_single each way; the slots each entry took are computed on the device too. It
  moves padding where a bucket is not full, which is the price of needing no host count.
- ``a2a``, ``a2a+nvfp4``: ``comm.moe_dispatch`` / ``comm.moe_combine`` on their a2a path
  (one all_gather of the counts, then all_to_allv over the path --algo names; the counts are
  read on the host);
- ``peer-push``, ``peer-push+nvfp4``, ``peer-push+fp8``: on the peer-memory kernels (no host
  synchronisation; FP8 both ways, NVFP4 on the way out), N/A where they cannot run (the CPU);
- ``peer-push:dispatch``, ``peer-push+nvfp4:dispatch``: the dispatch alone, so the NVFP4
  dispatch's gain over bf16 shows without the combine beside it.

A size is the bytes of the rows one rank dispatches, one per (token, expert) entry: its
``size / (topk * hidden * itemsize)`` tokens (the count column) of ``--hidden`` values, or
``--tokens`` names them. Every token picks ``--topk`` distinct experts of ``--experts`` at
random. Busbw counts those rows going out and coming back, (W-1)/W of them over links. The "expert" between dispatch and combine is the identity,
so the timed steps are the exchange alone; the check decodes what arrived, feeds it back
through the combine, and compares every output bit with the same sum computed locally (the
all_to_all_single columns within a few bf16 units: they sum their own way). Columns that read
counts on the host (all_to_all_single, a2a) cannot be captured: with -G they are N/A, the
summary says why, and a2a-buckets is the baseline there; -G 0 times every column eagerly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import symcomm
from symcomm import fp4
from symcomm.ep import fp8, layout
from symcomm.operations.moe_dispatch import OP as DISPATCH_OP
from symcomm.operations.moe_dispatch import QUANTS, BufferSpec, buffer_specs

from . import check
from .config import DATATYPES, BenchError
from .sizes import Layout
from .spec import Buffers, Case, Cases, Inputs, OpSpec, Refusal, Setup

BASELINE = "all_to_all_single"
BUCKETS = "a2a-buckets"  # the baseline a CUDA graph can capture
# column -> (path, dispatch quant, combine quant, dispatch only)
_COLUMNS = {"a2a": ("a2a", None, None, False), "a2a+nvfp4": ("a2a", "nvfp4", None, False),
            "peer-push": ("peer-push", None, None, False), "peer-push+nvfp4": ("peer-push", "nvfp4", None, False),
            "peer-push+fp8": ("peer-push", "fp8", "fp8", False),
            "peer-push:dispatch": ("peer-push", None, None, True),
            "peer-push+nvfp4:dispatch": ("peer-push", "nvfp4", None, True)}
VARIANTS = (BASELINE, BUCKETS, *_COLUMNS)
SHAPE_FLAGS = ("hidden", "topk", "experts")  # --hidden, --topk, --experts
_ALIGN = 512  # every carved buffer starts on a pool allocation boundary
_DTYPE_OF_ITEMSIZE = {1: torch.uint8, 2: torch.float16, 4: torch.float32}  # for byte counts


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class MoeSpec(OpSpec):
    name: str = "moe"
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    reduces = False
    variants = VARIANTS
    shape_flags = SHAPE_FLAGS

    def configure(self, options: dict[str, int]) -> "MoeSpec":
        return dataclasses.replace(self, **{k: v for k, v in options.items() if k in SHAPE_FLAGS})

    # -- sizes -----------------------------------------------------------------------
    def token_bytes(self, itemsize: int) -> int:
        """Bytes one token dispatches: its row once per expert it picks."""
        return self.topk * self.hidden * itemsize

    def layout(self, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
        tokens = nbytes // self.token_bytes(itemsize)
        storage = sum(self._pieces(tokens, world, itemsize).values())
        return Layout(tokens * self.token_bytes(itemsize), tokens, tokens * self.hidden, -(-storage // itemsize),
                      (tokens,) * world, self.hidden)

    def smallest_size(self, world: int, itemsize: int, limit: int = 1 << 24) -> int | None:
        return self.token_bytes(itemsize)

    def bus_factor(self, world: int) -> float:
        return 2.0 * (world - 1) / world  # out in dispatch, back in combine

    def _specs(self, tokens: int, world: int, dtype: torch.dtype, quant: str | None) -> Mapping[str, BufferSpec]:
        """The dispatch's buffers for ``tokens`` tokens a rank (at least one: max_tokens >= 1)."""
        return buffer_specs(world, max(tokens, 1), self.topk, self.experts, self.hidden, dtype, quant)

    def _pieces(self, tokens: int, world: int, itemsize: int) -> dict[str, int]:
        """Bytes of every buffer one size uses, carved from the run's symmetric recv buffer: the
        dispatch's (the received rows and their scales share "rows", sized for the largest quant),
        the experts' output and the combined tokens."""
        dtype = _DTYPE_OF_ITEMSIZE[itemsize]  # only byte counts are read
        specs = {quant: self._specs(tokens, world, dtype, quant) for quant in QUANTS}
        rows = max(_up(s["out.x"].nbytes) + (s["out.scales"].nbytes if "out.scales" in s else 0)
                   for s in specs.values())
        pieces = {"rows": _up(rows)}
        pieces.update({name: _up(spec.nbytes) for name, spec in specs[None].items() if name != "out.x"})
        cap, h, t = specs[None]["out.x"].shape[0], self.hidden, max(tokens, 1)
        pieces.update({"expert_out": _up(cap * h * itemsize), "combined": _up(t * h * itemsize)})
        return pieces

    def validate(self, datatype: str) -> None:
        if DATATYPES[datatype][1] not in ("bfloat16", "float16"):
            raise BenchError(f"{self.name} moves bfloat16 or half tokens, not {datatype}")
        if self.hidden % fp8.BLOCK or self.hidden < fp8.BLOCK:
            raise BenchError(f"--hidden must be a multiple of {fp8.BLOCK} (FP8 blocks), got {self.hidden}")
        if self.topk < 1 or self.experts < 1 or self.topk > self.experts:
            raise BenchError(f"--topk ({self.topk}) must be from 1 to --experts ({self.experts})")

    def default_datatype(self, device: str) -> str:
        return "bfloat16"

    def notes(self, world: int, itemsize: int, path: str) -> list[str]:
        if self.experts % world:
            raise BenchError(f"--experts ({self.experts}) must be a multiple of the world size ({world})")
        return [f"MoE: hidden {self.hidden}, top-{self.topk} of {self.experts} experts ({self.experts // world} per "
                f"rank); size = one rank's tokens x {self.token_bytes(itemsize)} B (k rows each), count = tokens per rank; columns "
                f"{', '.join(VARIANTS)}; the a2a columns run all_to_allv on --algo {path}",
                f"MoE check: the combined tokens bit for bit against the same by-rank sum (symcomm/ep/layout.py) "
                f"done locally from the decoded rows; {BASELINE} within bf16 rounding; busbw = algbw x 2(W-1)/W; in place is N/A: "
                f"dispatch and combine write buffers of their own"]

    # -- data ------------------------------------------------------------------------
    def input_elems(self, lay: Layout, rank: int) -> int:
        return lay.count * self.hidden

    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return bufs.send[:lay.in_elems].view(-1, self.hidden), bufs.recv[:lay.count * self.hidden].view(-1, self.hidden)

    def run(self, comm: Any, lay: Layout, x: torch.Tensor, out: torch.Tensor, redop: str,
            algo: str) -> Callable[[], object]:
        raise NotImplementedError("moe builds its calls per column (cases)")

    def expected(self, lay: Layout, redop: str, dtype: torch.dtype, rank: int, world: int,
                 gen: Inputs) -> check.Expected:
        raise NotImplementedError("moe checks per column (cases)")

    def routing(self, setup: Setup, lay: Layout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s top-k ids (distinct per token) and weights, regenerable by any rank."""
        gen = torch.Generator().manual_seed(check.seed_for(setup.seed, 1000 + rank, lay.nbytes))
        scores = torch.rand(lay.count, self.experts, generator=gen)
        ids = scores.topk(self.topk, dim=1).indices.to(torch.int32)
        weights = torch.rand(lay.count, self.topk, generator=gen)
        return ids.to(setup.device), weights.to(setup.device)

    def cases(self, setup: Setup, lay: Layout, gen: Inputs) -> Cases:
        comm, world, dtype, h, k = setup.comm, setup.world, setup.dtype, self.hidden, self.topk
        tokens = lay.count
        x = setup.bufs.send[:tokens * h].view(tokens, h)
        mine = gen(setup.rank)
        ids, weights = self.routing(setup, lay, setup.rank)
        every = torch.cat([gen(p).view(-1, h) for p in range(world)])
        gs = fp4.global_scale_for(every)  # the same on every rank without a collective
        bufs = self._carve(setup, tokens, world, dtype)
        valid = torch.ones(tokens, k, dtype=torch.bool, device=setup.device)
        ranks = ids.long() // (self.experts // world)

        def decoded(quant: str | None, d: symcomm.Dispatched) -> torch.Tensor:
            if quant == "nvfp4":
                return fp4.dequantize(d.x, d.scales, gs, dtype)
            if quant == "fp8":
                return fp8.dequantize(d.x, d.scales, dtype)
            return d.x

        def want(quant: str | None, combine_quant: str | None) -> torch.Tensor:
            xs = x.view(tokens, h)
            if quant == "nvfp4":
                xs = fp4.dequantize(*fp4.quantize(xs, gs), gs, dtype)
            elif quant == "fp8":
                xs = fp8.dequantize(*fp8.quantize(xs), dtype)
            return layout.combine_by_rank(xs.float().unsqueeze(1).expand(tokens, k, h), weights, valid, ranks, world,
                                          dtype, combine_quant)

        def case(variant: str, inplace: bool) -> Case | Refusal | None:
            if inplace:
                return None
            out = bufs["combined"]
            if variant in (BASELINE, BUCKETS):
                call = (self._baseline if variant == BASELINE else self._buckets)(setup, x, ids, weights, out)
                value = (mine.view(tokens, h).double() * weights.double().sum(1, keepdim=True)).reshape(-1)
                exp = check.Expected(value, value.abs() * 2.0**-6)  # a few bf16 roundings of its own sum
                return Case(call=call, load=lambda: _load(x, mine, out),
                            count=(lambda: check.count_wrong(out, exp)) if setup.check else None,
                            corrupt=lambda: check.corrupt(out))
            path, quant, combine_quant, only_dispatch = _COLUMNS[variant]
            if path == "a2a" and setup.path != "auto":
                path = setup.path  # an all_to_allv path: a2a with it inside
            if path == "peer-push" and "peer-push" not in comm.algorithms("moe_dispatch"):
                return Refusal(comm.router.off_of(DISPATCH_OP).get("peer-push", "not open on this communicator"))
            d = self._dispatched(bufs, tokens, world, quant, ids, weights, dtype, gs)
            expert_out = bufs["expert_out"]

            def call() -> object:
                got = comm.moe_dispatch(x, ids, weights, self.experts, max_tokens=max(tokens, 1), quant=quant,
                                        global_scale=gs if quant == "nvfp4" else None, out=d, algo=path)
                if only_dispatch:
                    return got
                return comm.moe_combine(expert_out, got.handle, quant=combine_quant, out=out, algo=path)

            spoil = []  # the corrupt hook's mark: count() re-runs the pair, so it spoils that output

            def count() -> int:
                got = comm.moe_dispatch(x, ids, weights, self.experts, max_tokens=max(tokens, 1), quant=quant,
                                        global_scale=gs if quant == "nvfp4" else None, out=d, algo=path)
                expert_out.copy_(decoded(quant, got))
                check.poison_fill(out)
                comm.moe_combine(expert_out, got.handle, quant=combine_quant, out=out, algo=path)
                if spoil:
                    spoil.clear()
                    check.corrupt(out)
                expected = want(quant, combine_quant)
                return int((out.view(torch.int16) != expected.view(torch.int16)).sum())

            return Case(call=call, load=lambda: _load(x, mine, out), count=count if setup.check else None,
                        corrupt=lambda: spoil.append(True))
        return case

    def _carve(self, setup: Setup, tokens: int, world: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw = setup.bufs.recv.view(torch.uint8)
        pieces, views, at = self._pieces(tokens, world, dtype.itemsize), {}, 0
        for name, nbytes in pieces.items():
            views[name] = raw[at:at + nbytes]
            at += nbytes
        h = self.hidden
        cap = self._specs(tokens, world, dtype, None)["out.x"].shape[0]
        views["expert_out"] = views["expert_out"][:cap * h * dtype.itemsize].view(dtype).view(cap, h)
        views["combined"] = views["combined"][:tokens * h * dtype.itemsize].view(dtype).view(tokens, h)
        return views

    def _dispatched(self, bufs: dict[str, torch.Tensor], tokens: int, world: int, quant: str | None,
                    ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, gs: Any) -> symcomm.Dispatched:
        """A Dispatched over the carved buffers, for out=: no allocation in the timed calls."""
        specs = self._specs(tokens, world, dtype, quant)

        def view(name: str, raw: torch.Tensor) -> torch.Tensor:
            spec = specs[name]
            return raw[:spec.nbytes].view(spec.dtype).view(spec.shape)

        recv = view("out.x", bufs["rows"])
        scales = view("out.scales", bufs["rows"][_up(recv.nbytes):]) if "out.scales" in specs else None
        held = {name: view(name, bufs[name]) for name in specs if name not in ("out.x", "out.scales")}
        handle = symcomm.EpHandle(held["handle.send_rows"], held["handle.recv_src"], held["out.expert_offsets"],
                                  held["handle.table"], held["handle.returned"], held["handle.recv_group"], ids,
                                  weights, self.experts, max(tokens, 1), 1, dtype)
        return symcomm.Dispatched(recv, scales, held["out.expert_counts"], held["out.expert_offsets"], handle,
                                  gs if quant == "nvfp4" else None)

    def _baseline(self, setup: Setup, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  out: torch.Tensor) -> Callable[[], object]:
        """torch.distributed.all_to_all_single both ways, as an expert-parallel layer without
        symcomm does it: counts first (read on the host), then the rows, then back."""
        world, k, local = setup.world, self.topk, self.experts // setup.world
        dest = (ids.long() // local).reshape(-1)
        order = torch.argsort(dest, stable=True)
        tokens = order // k
        group = dist.group.WORLD

        def call() -> object:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise symcomm.ArgumentError(f"{BASELINE} needs its split sizes on the host, which a CUDA graph "
                                            f"cannot capture")
            send = torch.bincount(dest, minlength=world)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            sc, rc = send.tolist(), recv.tolist()
            rows = x[tokens]
            arrived = x.new_empty((sum(rc), x.shape[1]))
            dist.all_to_all_single(arrived, rows, rc, sc, group=group)
            back = torch.empty_like(rows)
            dist.all_to_all_single(back, arrived, sc, rc, group=group)
            per_entry = torch.empty_like(back)
            per_entry[order] = back
            sums = (per_entry.view(-1, k, x.shape[1]).float() * weights.unsqueeze(-1)).sum(1)
            out.copy_(sums)
            return out
        return call

    def _buckets(self, setup: Setup, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor) -> Callable[[], object]:
        """all_to_all_single both ways on fixed buckets (module docstring): no host count, so a
        CUDA graph captures it. Bucket q of a rank's send buffer holds its entries for rank q in
        token order; the slot of each entry is its place among the earlier entries for q."""
        world, k, h = setup.world, self.topk, self.hidden
        local = self.experts // world
        tokens = x.shape[0]
        bucket = max(tokens, 1) * min(k, local)
        group = dist.group.WORLD

        def call() -> object:
            dest = (ids.long() // local).reshape(-1)  # [tokens * k]
            onehot = torch.nn.functional.one_hot(dest, world)
            slot = onehot.cumsum(0).gather(1, dest.unsqueeze(1)).squeeze(1) - 1
            where = dest * bucket + slot  # row of the entry in the [world * bucket, h] buffers
            send = x.new_zeros((world * bucket, h))
            send[where] = x.repeat_interleave(k, dim=0)
            arrived = torch.empty_like(send)
            dist.all_to_all_single(arrived, send, group=group)
            back = torch.empty_like(send)  # the expert is the identity: the rows go straight back
            dist.all_to_all_single(back, arrived, group=group)
            sums = (back[where].view(tokens, k, h).float() * weights.unsqueeze(-1)).sum(1)
            out.copy_(sums)
            return out
        return call


def _load(x: torch.Tensor, mine: torch.Tensor, out: torch.Tensor) -> None:
    check.poison_fill(out)
    if x.numel():
        x.reshape(-1).copy_(mine)


MOE_DISPATCH_COMBINE = MoeSpec()
