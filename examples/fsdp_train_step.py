"""An FSDP-style training step with symcomm's differentiable collectives.

Data parallel: every rank trains on its own tokens, and holds only its rows of each weight (a
flat shard, allocated in the symmetric pool). Before use the weight is gathered; in backward
the all-gather's gradient is a reduce-scatter, which leaves each rank the sum over ranks of its
rows' gradients, the data-parallel sum, already sharded:

    w1 = comm.all_gather(w1_r); w2 = comm.all_gather(w2_r)     backward: reduce_scatter
    loss = mse(gelu(x_r @ w1.T) @ w2.T, target_r) / world      the global loss: the ranks' mean
    loss.backward(); SGD on w1_r, w2_r

In eager steps the reduce-scatter's output, the gradient shard, comes from the symmetric pool
because the shard it differentiates sat there (on GPUs; gloo has no pool).

On GPUs, given a communication stream (``communication_stream(comm)``, one per model, shared
by its modules), the collectives run there: w2's gather runs beside x @ w1, and since autograd
runs a node's backward on its forward's stream, w2's reduce-scatter runs beside the rest of
the backward. The overlap is within the module: unlike FSDP2, nothing prefetches the next
module's weights. Every collective of a captured step must be on that one stream (symcomm
checks this for its own kernels only, not for NCCL's).

Run (every rank checks its loss, gradient shards and updated shards against one process with the
full weights and every rank's tokens; on GPUs also CUDA graphs of whole steps, bitwise against
eager, and torch.compile):

    torchrun --nproc-per-node=2 examples/fsdp_train_step.py --cpu
    torchrun --nproc-per-node=4 examples/fsdp_train_step.py

It prints one PASS/FAIL line and exits 1 on a mismatch.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import symcomm

from layer_utils import Check, seeded
from train_utils import (Reference, TrainConfig, check_eager, communication_stream, example_main,
                         overlap_changes_no_bit, run_modes)


class FullMLP:
    """The reference: the whole MLP on one process, over every rank's tokens."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        h, f, s = cfg.hidden, cfg.ffn, cfg.seed * 1000
        self.params = [seeded((f, h), s + 1, h ** -0.5, cfg.dtype, device).requires_grad_(),
                       seeded((h, f), s + 2, f ** -0.5, cfg.dtype, device).requires_grad_()]

    def loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        w1, w2 = self.params
        return sum(F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), t) for x, t in batches) / len(batches)


def _letting_go(held: dict[int, torch.Tensor], i: int):
    """The hook that drops gathered weight i once its gradient is accumulated. It holds the dict,
    not the module: a module held by its parameters' hooks would keep its shards in the pool
    until the garbage collector ran."""
    def hook(_param: torch.Tensor) -> None:
        held.pop(i, None)
    return hook


class FSDPMLP:
    """This rank's rows of each weight, in the symmetric pool (the same shapes on every rank).
    The sizes must divide by the world size (TrainConfig's --cpu ones do up to world 4).

    With ``comm_stream`` the collectives run there (see the module's docstring); without, in
    order on the caller's stream. Two rules make memory shared by the two streams safe without
    record_stream (which also kept 64 MiB of destroyed graphs reserved in the 16-graph check
    at world 1): every entry to the communication stream first waits for the caller's stream,
    and a gathered weight is held until its gradient shard has been accumulated. The caching
    allocator gives a freed block to the next allocation on the stream that made it, so a
    gathered weight freed when autograd drops it could become a later reduce-scatter's output
    while a GEMM still reads it; its own reduce-scatter waits for every reader of it (all of
    them feed its gradient), so once that has run, the block is free."""

    names = ("w1 shard", "w2 shard")

    def __init__(self, comm: symcomm.Communicator, cfg: TrainConfig, full: FullMLP,
                 comm_stream: torch.cuda.Stream | None = None) -> None:
        for name, n in (("hidden", cfg.hidden), ("ffn", cfg.ffn)):
            if n % comm.world_size:
                raise SystemExit(f"--{name} ({n}) must divide by the world size ({comm.world_size})")
        self.comm = comm
        with symcomm.use_symmetric_memory(comm):
            shards = [torch.empty_like(t) for t in self.shard(full.params)]
        for s, t in zip(shards, self.shard(full.params)):
            s.copy_(t.detach())
        self.params = [s.requires_grad_() for s in shards]
        self.comm_stream = comm_stream
        self.held: dict[int, torch.Tensor] = {}  # gathered weights whose gradients are not accumulated yet
        if comm_stream is not None:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(_letting_go(self.held, i))

    def shard(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        r, w = self.comm.rank, self.comm.world_size
        return [t[r * t.shape[0] // w:(r + 1) * t.shape[0] // w] for t in full]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.comm_stream is None:
            return self.comm.all_reduce(loss.reshape(1))[0]  # the ranks' shares of the mean
        # On the communication stream too: a symcomm kernel launched from a second stream waits
        # for all the work queued on the first, which would hold the next reduce-scatter
        # behind the whole backward.
        here = torch.cuda.current_stream()
        self.comm_stream.wait_stream(here)
        with torch.cuda.stream(self.comm_stream):
            total = self.comm.all_reduce(loss.reshape(1))[0]
        here.wait_stream(self.comm_stream)
        return total

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.comm_stream is None or torch.compiler.is_compiling():
            # In order on the caller's stream (compiled, the backward runs as one node on the
            # forward's stream, so its reduce-scatters could not move anyway).
            w1, w2 = (self.comm.all_gather(s) for s in self.params)
            return F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), target) / self.comm.world_size
        (w1, w1_ready), (w2, w2_ready) = self.gather_ahead()
        here = torch.cuda.current_stream()
        here.wait_event(w1_ready)
        h = F.gelu(x @ w1.t())
        here.wait_event(w2_ready)  # only now: w2's gather ran beside x @ w1
        return F.mse_loss(h @ w2.t(), target) / self.comm.world_size

    def gather_ahead(self) -> list[tuple[torch.Tensor, torch.cuda.Event]]:
        """Every weight gathered on the communication stream, in order, each with the event
        that marks it gathered."""
        here = torch.cuda.current_stream()
        self.comm_stream.wait_stream(here)  # the shards' last update, and every reader of held weights
        self.held.clear()  # a step without backward leaves them: the wait above covers their readers
        gathered = []
        with torch.cuda.stream(self.comm_stream):
            for i, s in enumerate(self.params):
                w = self.held[i] = self.comm.all_gather(s)
                gathered.append((w, torch.cuda.Event()))
                gathered[-1][1].record()
        return gathered


def batches_for(cfg: TrainConfig, comm: symcomm.Communicator, seed: int):
    def batches(step: int, tokens: int):
        # Each rank's own tokens (data parallel), the same count everywhere (graphs capture equal shapes).
        s = 40_000 + seed * 997 + step * 2 * comm.world_size
        return [(seeded((tokens, cfg.hidden), s + 2 * r, 1.0, cfg.dtype, comm.device),
                 seeded((tokens, cfg.hidden), s + 2 * r + 1, 1.0, cfg.dtype, comm.device))
                for r in range(comm.world_size)]
    return batches


def gradients_from_the_pool(model: FSDPMLP, reference: Reference, batches, seed: int, lr: float) -> list[Check]:
    """Eager backward puts the gradient shards in the symmetric pool (where there is one)."""
    if model.comm.symmetric_pool is None:
        return []
    check_eager(model, reference, batches, 1, seed, lr, 4)
    return [Check(f"gradient of {n} allocated in the symmetric pool", model.comm.is_symmetric(p.grad))
            for n, p in zip(model.names, model.params)]


def held_until_accumulated(model: FSDPMLP, batches) -> list[Check]:
    """The lifetime rule of FSDPMLP's docstring: the gathered weights live through the forward
    and are let go once their gradient shards are accumulated."""
    if model.comm_stream is None:
        return []
    loss = model.loss(*batches(301, 3)[model.comm.rank])
    during = sorted(model.held)
    loss.backward()
    return [Check("gathered weights held after the forward", during == [0, 1], f"held: {during}"),
            Check("gathered weights let go once their gradients are accumulated", not model.held,
                  f"still held: {sorted(model.held)}")]


def run_checks(comm: symcomm.Communicator, cfg: TrainConfig, modes: tuple[str, ...], steps: int = 3,
               seed: int = 0, tokens: int = 7) -> list[Check]:
    full = FullMLP(cfg, comm.device)
    model = FSDPMLP(comm, cfg, full, communication_stream(comm))
    reference = Reference(full, cfg.lr)
    batches = batches_for(cfg, comm, seed)
    checks = run_modes(model, reference, batches, modes, steps, seed, cfg.lr, tokens)
    if "eager" in modes:
        checks += gradients_from_the_pool(model, reference, batches, seed, cfg.lr)
        if model.comm_stream is not None:
            checks += overlap_changes_no_bit(model, FSDPMLP(comm, cfg, full), batches(300, 5)[comm.rank], cfg.lr)
        checks += held_until_accumulated(model, batches)
    return checks


def main(argv: list[str] | None = None) -> int:
    return example_main(argv, __doc__, "fsdp_train_step", TrainConfig, run_checks)


if __name__ == "__main__":
    sys.exit(main())
