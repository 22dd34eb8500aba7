"""A tensor-parallel training step with symcomm's differentiable collectives.

Every rank sees the same tokens and computes the same loss; the MLP's weights are split as
Megatron splits them:

    h0 = x @ w_in.T                                    replicated weight
    a  = copy_to_tp_region(comm, h0)                   forward: h0       backward: all-reduce
    h  = gelu(a @ w1_r.T)                              column-parallel: this rank's ffn rows
    y  = reduce_from_tp_region(comm, h @ w2_r.T)       row-parallel:    forward: all-reduce
    loss = mse(y, target); loss.backward(); SGD        backward: the gradient itself

The pair makes the replicated part's gradient right: h0's gradient is the sum of the ranks'
column shares (copy_to_tp_region's all-reduce), so w_in's gradient is whole, and the same, on
every rank; y's gradient is already whole, so reduce_from_tp_region passes it through.

On GPUs, given a communication stream (``train_utils.communication_stream(comm)``), the
column-parallel linear and its entry are one autograd function (as Megatron-LM's asynchronous
tensor-parallel all-reduce does): its backward computes a's gradient, all-reduces it on the
communication stream, and meanwhile computes w1's gradient, which autograd would otherwise
compute before the all-reduce could start. The forward all-reduce runs on that stream too, so
that a captured step's collectives share one stream. Below ``overlap_from_bytes`` of
activations the step stays in order: the stream hops cost more than they hide.

Run (every rank checks its loss, gradients and updated weights against one process with the full
weights; on GPUs also CUDA graphs of whole steps, bitwise against eager, and torch.compile):

    torchrun --nproc-per-node=2 examples/tp_train_step.py --cpu
    torchrun --nproc-per-node=4 examples/tp_train_step.py                # eager, graphs, compile

It prints one PASS/FAIL line and exits 1 on a mismatch.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import symcomm

from layer_utils import Check, seeded
from tp_block import share
import train_utils
from train_utils import (Reference, communication_stream, example_main, overlap_changes_no_bit, run_modes,
                         same_on_every_rank)


@dataclass(frozen=True)
class TrainConfig(train_utils.TrainConfig):
    ffn: int = 20  # uneven shares at world 3


class FullMLP:
    """The reference: the whole MLP on one process."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        h, f, s = cfg.hidden, cfg.ffn, cfg.seed * 1000
        self.params = [seeded((h, h), s + 1, h ** -0.5, cfg.dtype, device).requires_grad_(),
                       seeded((f, h), s + 2, h ** -0.5, cfg.dtype, device).requires_grad_(),
                       seeded((h, f), s + 3, f ** -0.5, cfg.dtype, device).requires_grad_()]

    def loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        w_in, w1, w2 = self.params
        x, target = batches[0]  # tensor parallel: every rank's batch is the same
        return F.mse_loss(F.gelu(x @ w_in.t() @ w1.t()) @ w2.t(), target)


# Where the overlap starts to pay, predicted (bench/NOTES.md, eleventh session): the two waits
# between streams cost 5-8 µs per step in graphs at world 1 (one H200); the all-reduce they can
# hide takes about 6 µs at 512 KiB and 20 µs at 4 MiB at world 2 (H200), next to a weight-gradient
# GEMM at least as long.
OVERLAP_FROM_BYTES = 2 << 20


class _ColumnParallelLinear(torch.autograd.Function):
    """``copy_to_tp_region(comm, a) @ w.T`` whose backward all-reduces a's gradient on ``stream``
    while w's gradient is computed on the caller's stream. Memory shared by the two streams is
    safe without record_stream: the communication stream waits for everything before it, and
    the caller's stream waits for the all-reduce before it returns."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, comm: symcomm.Communicator,
                stream: torch.cuda.Stream) -> torch.Tensor:
        ctx.save_for_backward(a, w)
        ctx.comm, ctx.stream = comm, stream
        return a @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, w = ctx.saved_tensors
        here = torch.cuda.current_stream()
        partial = g @ w  # this rank's columns' share of a's gradient
        ctx.stream.wait_stream(here)
        with torch.cuda.stream(ctx.stream):
            grad_a = ctx.comm.all_reduce(partial)
        grad_w = g.t() @ a
        here.wait_stream(ctx.stream)
        return grad_a, grad_w, None, None


class TPMLP:
    """This rank's part: w_in whole, w1's rows and w2's columns of its ffn share."""

    names = ("w_in", "w1 (column-parallel)", "w2 (row-parallel)")

    def __init__(self, comm: symcomm.Communicator, cfg: TrainConfig, full: FullMLP,
                 comm_stream: torch.cuda.Stream | None = None, overlap_from_bytes: int = OVERLAP_FROM_BYTES) -> None:
        self.comm, self.comm_stream, self.overlap_from_bytes = comm, comm_stream, overlap_from_bytes
        self.cols = share(comm.rank, comm.world_size, cfg.ffn)
        self.params = [t.detach().clone().requires_grad_() for t in self.shard(full.params)]

    def shard(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        w_in, w1, w2 = full
        cols = slice(self.cols.start, self.cols.stop)
        return [w_in, w1[cols], w2[:, cols]]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # every rank computes the whole loss

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        w_in, w1, w2 = self.params
        h0 = x @ w_in.t()
        if (self.comm_stream is None or torch.compiler.is_compiling()
                or h0.numel() * h0.element_size() < self.overlap_from_bytes):
            # In order on the caller's stream (compiled: one backward node on one stream anyway).
            h = F.gelu(symcomm.copy_to_tp_region(self.comm, h0) @ w1.t())
            y = symcomm.reduce_from_tp_region(self.comm, h @ w2.t())
            return F.mse_loss(y, target)
        h = F.gelu(_ColumnParallelLinear.apply(h0, w1, self.comm, self.comm_stream))
        partial = h @ w2.t()
        here = torch.cuda.current_stream()
        self.comm_stream.wait_stream(here)
        with torch.cuda.stream(self.comm_stream):
            y = symcomm.reduce_from_tp_region(self.comm, partial)
        here.wait_stream(self.comm_stream)
        return F.mse_loss(y, target)


def batches_for(cfg: TrainConfig, comm: symcomm.Communicator, seed: int):
    def batches(step: int, tokens: int):
        s = 30_000 + seed * 997 + step * 2
        x = seeded((tokens, cfg.hidden), s, 1.0, cfg.dtype, comm.device)
        target = seeded((tokens, cfg.hidden), s + 1, 1.0, cfg.dtype, comm.device)
        return [(x, target)] * comm.world_size
    return batches


def run_checks(comm: symcomm.Communicator, cfg: TrainConfig, modes: tuple[str, ...], steps: int = 3,
               seed: int = 0, tokens: int = 7) -> list[Check]:
    full = FullMLP(cfg, comm.device)
    model = TPMLP(comm, cfg, full, communication_stream(comm), overlap_from_bytes=0)  # the checks take it at every size
    checks = run_modes(model, Reference(full, cfg.lr), batches_for(cfg, comm, seed), modes, steps, seed, cfg.lr,
                       tokens)
    # The replicated weight got the same gradient, and so the same update, on every rank.
    checks.append(same_on_every_rank(comm, "w_in identical on every rank after training", model.params[0]))
    if model.comm_stream is not None and "eager" in modes:
        checks += overlap_changes_no_bit(model, TPMLP(comm, cfg, full), batches_for(cfg, comm, seed)(300, 5)[comm.rank],
                                         cfg.lr)
    return checks


def main(argv: list[str] | None = None) -> int:
    return example_main(argv, __doc__, "tp_train_step", TrainConfig, run_checks)


if __name__ == "__main__":
    sys.exit(main())
