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
from train_utils import Reference, TrainConfig, check_eager, example_main, run_modes


class FullMLP:
    """The reference: the whole MLP on one process, over every rank's tokens."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        h, f, s = cfg.hidden, cfg.ffn, cfg.seed * 1000
        self.params = [seeded((f, h), s + 1, h ** -0.5, cfg.dtype, device).requires_grad_(),
                       seeded((h, f), s + 2, f ** -0.5, cfg.dtype, device).requires_grad_()]

    def loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        w1, w2 = self.params
        return sum(F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), t) for x, t in batches) / len(batches)


class FSDPMLP:
    """This rank's rows of each weight, in the symmetric pool (the same shapes on every rank).
    The sizes must divide by the world size (TrainConfig's --cpu ones do up to world 4)."""

    names = ("w1 shard", "w2 shard")

    def __init__(self, comm: symcomm.Communicator, cfg: TrainConfig, full: FullMLP) -> None:
        for name, n in (("hidden", cfg.hidden), ("ffn", cfg.ffn)):
            if n % comm.world_size:
                raise SystemExit(f"--{name} ({n}) must divide by the world size ({comm.world_size})")
        self.comm = comm
        with symcomm.use_symmetric_memory(comm):
            shards = [torch.empty_like(t) for t in self.shard(full.params)]
        for s, t in zip(shards, self.shard(full.params)):
            s.copy_(t.detach())
        self.params = [s.requires_grad_() for s in shards]

    def shard(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        r, w = self.comm.rank, self.comm.world_size
        return [t[r * t.shape[0] // w:(r + 1) * t.shape[0] // w] for t in full]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(loss.reshape(1))[0]  # the ranks' shares of the mean

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        w1, w2 = (self.comm.all_gather(s) for s in self.params)
        return F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), target) / self.comm.world_size


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


def run_checks(comm: symcomm.Communicator, cfg: TrainConfig, modes: tuple[str, ...], steps: int = 3,
               seed: int = 0, tokens: int = 7) -> list[Check]:
    full = FullMLP(cfg, comm.device)
    model = FSDPMLP(comm, cfg, full)
    reference = Reference(full, cfg.lr)
    batches = batches_for(cfg, comm, seed)
    checks = run_modes(model, reference, batches, modes, steps, seed, cfg.lr, tokens)
    if "eager" in modes:
        checks += gradients_from_the_pool(model, reference, batches, seed, cfg.lr)
    return checks


def main(argv: list[str] | None = None) -> int:
    return example_main(argv, __doc__, "fsdp_train_step", TrainConfig, run_checks)


if __name__ == "__main__":
    sys.exit(main())
