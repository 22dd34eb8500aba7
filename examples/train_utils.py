"""What the two training examples share: the step (zero the gradients, loss, backward, SGD),
its checks against a single-process model with the full weights, and the three ways it runs:
eagerly, as CUDA graphs of whole steps (forward, backward and update captured) and under
torch.compile(fullgraph=True).

A model here is this rank's part: ``params`` (its tensors, which require grad), ``loss(*batch)``
(collectives inside: symcomm's differentiable ones), ``shard(tensors)`` (this rank's part of
full-model tensors listed like ``reference.params``), ``global_loss(loss)`` (the loss of the whole
step from this rank's). The reference is the full model on one
process: ``loss(batches)`` for every rank's batch, ``params`` its full weights (leaves that
require grad).
"""
from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import symcomm

from layer_utils import Check, add_common_args, bitwise, close_enough, init_distributed, modes_for, run_example


@dataclass(frozen=True)
class TrainConfig:
    """An MLP's sizes (the defaults: the --cpu ones) and its SGD step."""

    hidden: int = 12
    ffn: int = 24
    lr: float = 0.05
    seed: int = 0
    dtype: torch.dtype = torch.float32


Batch = tuple[torch.Tensor, ...]
# (step, tokens) -> every rank's batch, in rank order (the same batch everywhere under TP)
Batches = Callable[[int, int], list[Batch]]
REL = 1e-4  # fp32 on both sides: sums in another order differ by rounding, orders of magnitude below this


def communication_stream(comm: symcomm.Communicator) -> torch.cuda.Stream | None:
    """A stream for one model's collectives (pass the same one to every module), None on the CPU.
    Every entry to it must first wait for the compute stream: the examples' memory rules rest
    on that (see FSDPMLP's docstring)."""
    return torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None


def train_step(model, batch: Batch, lr: float, static_grads: bool) -> torch.Tensor:
    """One SGD step on this rank's parameters; returns the loss. ``static_grads`` keeps the
    gradient tensors (zeroed in place), as a CUDA graph that replays the step needs; otherwise
    they are dropped and backward makes new ones (the last collective's output, which for
    parameters from the symmetric pool comes from the pool too)."""
    for p in model.params:
        if static_grads:
            p.grad.zero_()
        else:
            p.grad = None
    loss = model.loss(*batch)
    loss.backward()
    with torch.no_grad():
        for p in model.params:
            p.add_(p.grad, alpha=-lr)
    return loss.detach()


def overlap_changes_no_bit(model, in_order, batch: Batch, lr: float) -> list[Check]:
    """The communication stream moves work in time, never in value: one eager step of ``model``
    (with its stream) and one of ``in_order`` (the same model without, given the same parameters
    here), on the same batch, agree bit for bit."""
    with torch.no_grad():
        for q, p in zip(in_order.params, model.params):
            q.copy_(p)
    losses = [train_step(m, batch, lr, static_grads=False) for m in (model, in_order)]
    checks = [bitwise("overlapped step's loss == in-order step's", losses[0].reshape(1), losses[1].reshape(1))]
    for n, p, q in zip(model.names, model.params, in_order.params):
        checks += [bitwise(f"overlapped step's gradient of {n} == in-order step's", p.grad, q.grad),
                   bitwise(f"overlapped step's {n} after the update == in-order step's", p.detach(), q.detach())]
    return checks


class Reference:
    """The full model on one process, stepped alongside: every step's loss, gradients and
    updated weights, to compare this rank's part with."""

    def __init__(self, full, lr: float) -> None:
        self.full, self.lr = full, lr

    def step(self, batches: list[Batch]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        params = self.full.params  # leaves that require grad
        loss = self.full.loss(batches)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-self.lr)
        return loss.detach(), list(grads)


def compare(tag: str, model, ref_loss: torch.Tensor, ref_grads: list[torch.Tensor], reference: Reference,
            loss: torch.Tensor, grads: Sequence[torch.Tensor]) -> list[Check]:
    """This rank's loss, gradients and updated parameters against the reference's (its part of them)."""
    checks = [close_enough(f"{tag}: loss", model.global_loss(loss), ref_loss, REL)]
    for i, (g, want) in enumerate(zip(grads, model.shard(ref_grads))):
        checks.append(close_enough(f"{tag}: gradient of {model.names[i]}", g, want, REL))
    for i, (p, want) in enumerate(zip(model.params, model.shard(reference.full.params))):
        checks.append(close_enough(f"{tag}: {model.names[i]} after the update", p.detach(), want, REL))
    return checks


def check_eager(model, reference: Reference, batches: Batches, steps: int, seed: int, lr: float,
                tokens: int) -> list[Check]:
    checks = []
    rng = random.Random(seed)
    for step in range(steps):
        n = rng.randint(1, tokens)
        every = batches(step, n)
        loss = train_step(model, every[model.comm.rank], lr, static_grads=False)
        ref_loss, ref_grads = reference.step(every)
        checks += compare(f"eager step {step} ({n} tokens)", model, ref_loss, ref_grads, reference, loss,
                          [p.grad for p in model.params])
    return checks


def check_graphs(model, reference: Reference, batches: Batches, buckets: list[int], replays: int, seed: int,
                 lr: float) -> list[Check]:
    """One CUDA graph per token bucket, each a whole step (forward, backward, update), all in one
    memory pool, captured inside comm.graph_capture(): static inputs the steps copy their batch
    into and static gradients (zeroed by the graph), as torchtitan captures training. Each
    replay is checked bitwise against an eager step from the same parameters on the same batch,
    and against the reference."""
    comm, rank = model.comm, model.comm.rank
    static = [torch.zeros((max(buckets), *t.shape[1:]), dtype=t.dtype, device=t.device)
              for t in batches(0, 1)[rank]]
    start = [p.detach().clone() for p in model.params]
    warm_up([(model, tuple(t[:b] for t in static)) for b in buckets], lr)
    _restore(model, start)
    pool = torch.cuda.graph_pool_handle()
    graphs, losses = {}, {}
    for b in sorted(buckets, reverse=True):  # largest first: the smaller ones reuse its memory
        graphs[b] = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(graphs[b], pool=pool):
            losses[b] = train_step(model, tuple(t[:b] for t in static), lr, static_grads=True)
    checks = []
    rng = random.Random(seed)
    for step in range(replays):
        b = rng.choice(buckets)
        every = batches(100 + step, b)
        for s, t in zip(static, every[rank]):
            s[:b].copy_(t)
        before = [p.detach().clone() for p in model.params]
        graphs[b].replay()
        got = (losses[b].clone(), [p.grad.clone() for p in model.params], [p.detach().clone() for p in model.params])
        _restore(model, before)
        loss = train_step(model, every[rank], lr, static_grads=True)
        tag = f"graph bucket {b} replay {step}"
        checks.append(bitwise(f"{tag}: loss == eager", got[0].reshape(1), loss.reshape(1)))
        checks += [bitwise(f"{tag}: gradient of {n} == eager", g, p.grad)
                   for n, g, p in zip(model.names, got[1], model.params)]
        checks += [bitwise(f"{tag}: {n} after the update == eager", q, p.detach())
                   for n, q, p in zip(model.names, got[2], model.params)]
        ref_loss, ref_grads = reference.step(every)
        checks += compare(tag, model, ref_loss, ref_grads, reference, got[0], got[1])
    del graphs
    return checks


def warm_up(steps: list[tuple[object, Batch]], lr: float) -> None:
    """Give each model static gradients (a graph's step zeroes them in place) and run each step
    once on a side stream: lazy initialisations (cuBLAS, NCCL) must not land in a capture. The
    steps update the parameters: restore them if that matters."""
    for model, _ in steps:
        for p in model.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for model, batch in steps:
            train_step(model, batch, lr, static_grads=True)
    torch.cuda.current_stream().wait_stream(side)


def check_compiled(model, reference: Reference, batches: Batches, buckets: list[int], seed: int,
                   lr: float) -> list[Check]:
    """The loss under torch.compile(fullgraph=True); AOTAutograd compiles the backward, whose
    collectives are the operations' registered backward. Against eager and the reference."""
    compiled = _Compiled(model, torch.compile(model.loss, fullgraph=True, dynamic=False))
    checks = []
    for i, b in enumerate(buckets):
        every = batches(200 + i, b)
        before = [p.detach().clone() for p in model.params]
        loss = train_step(compiled, every[model.comm.rank], lr, static_grads=False)
        got = (loss, [p.grad.clone() for p in model.params], [p.detach().clone() for p in model.params])
        _restore(model, before)
        eager = train_step(model, every[model.comm.rank], lr, static_grads=False)
        tag = f"compiled bucket {b}"
        checks.append(close_enough(f"{tag}: loss vs eager", got[0], eager, REL))
        checks += [close_enough(f"{tag}: gradient of {n} vs eager", g, p.grad, REL)
                   for n, g, p in zip(model.names, got[1], model.params)]
        ref_loss, ref_grads = reference.step(every)
        checks += compare(tag, model, ref_loss, ref_grads, reference, got[0], got[1])
    return checks


class _Compiled:
    """A model whose loss runs compiled; everything else is the model's."""

    def __init__(self, model, loss) -> None:
        self.params, self.loss, self.global_loss = model.params, loss, model.global_loss


def _restore(model, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(model.params, values):
            p.copy_(v)


def run_modes(model, reference: Reference, batches: Batches, modes: tuple[str, ...], steps: int, seed: int,
              lr: float, tokens: int) -> list[Check]:
    """The checks ``modes`` ask for (eager steps of 1..tokens tokens; graphs and compile per
    bucket: 1, half and all of ``tokens``)."""
    buckets = sorted({1, max(1, tokens // 2), tokens})
    checks: list[Check] = []
    if "eager" in modes:
        checks += check_eager(model, reference, batches, steps, seed, lr, tokens)
    if "graph" in modes:
        checks += check_graphs(model, reference, batches, buckets, 2 * len(buckets), seed, lr)
    if "compile" in modes:
        checks += check_compiled(model, reference, batches, buckets[-1:], seed, lr)
    return checks


def example_main(argv: list[str] | None, doc: str, title: str, config, run_checks) -> int:
    """A training example's command line: its --cpu sizes are ``config``'s defaults, its GPU
    sizes hidden 1024, ffn 4096 and 64 tokens."""
    cpu = config()
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=None, help=f"default {cpu.hidden} on --cpu, 1024 on GPUs")
    parser.add_argument("--ffn", type=int, default=None, help=f"default {cpu.ffn} on --cpu, 4096 on GPUs")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank per step at most (default 7 / 64)")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small = device.type == "cpu"
    cfg = config(hidden=args.hidden or (cpu.hidden if small else 1024), ffn=args.ffn or (cpu.ffn if small else 4096),
                 seed=args.seed)
    tokens = args.tokens or (7 if small else 64)
    return run_example(title, lambda comm: run_checks(comm, cfg, modes_for(args, device), steps=args.steps,
                                                      seed=args.seed, tokens=tokens))


def same_on_every_rank(comm: symcomm.Communicator, name: str, t: torch.Tensor) -> Check:
    """A replicated tensor must hold the same bits on every rank."""
    every = comm.all_gather(t.detach().contiguous().view(torch.uint8).reshape(1, -1))
    same = all(torch.equal(every[r], every[0]) for r in range(comm.world_size))
    return Check(name, same, "" if same else "ranks hold different bits")
