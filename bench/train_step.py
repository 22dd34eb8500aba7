"""Training-step latency: symcomm's differentiable collectives against torch.distributed's
functional collectives, in the same run.

    torchrun --nproc-per-node=4 bench/train_step.py --tokens 64,512,4096 --json train_step_w4.json
    torchrun --nproc-per-node=2 bench/train_step.py --cpu     # smoke test over gloo: tiny shapes

The steps are the examples' own (examples/tp_train_step.py, examples/fsdp_train_step.py): forward,
backward and an SGD update of a tensor-parallel MLP (tp) and of an FSDP-style one (fsdp, tokens
per rank). Only their collectives change between variants:

    symcomm   the examples as written, with a communication stream on GPUs: copy_to_tp_region /
              reduce_from_tp_region, the first fused with the column-parallel linear so that its
              backward all-reduce runs beside w1's gradient; comm.all_gather of the weight shards
              (in the symmetric pool), whose backward reduce-scatters, beside the GEMMs
    serial    the same collectives in order on the step's own stream: the overlap's share
    funcol    torch.distributed._functional_collectives (on NCCL's internal stream, waited
              for where each result is used): all_gather_tensor_autograd and
              reduce_scatter_tensor_autograd; the tensor-parallel pair as autograd Functions
              over its all_reduce
    local     every collective replaced by a local stand-in of the same shape: compute alone

On GPUs each (step, variant, tokens) is one CUDA graph of a whole step (static inputs and gradients,
as examples/train_utils.py captures), every graph of a variant in one pool, replayed --iters times
between two events (after one untimed replay that lines the ranks up), --rounds times; the table
gives the median round, the slowest rank, and ``comm`` = step minus local. On the CPU (--cpu) the
steps run eagerly and the timings mean nothing: it only proves that every variant runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import symcomm  # noqa: E402

import fsdp_train_step as fsdp  # noqa: E402
import tp_train_step as tp  # noqa: E402
from layer_utils import init_distributed, seeded  # noqa: E402
from train_utils import communication_stream, train_step, warm_up  # noqa: E402

VARIANTS = ("symcomm", "serial", "funcol", "local")
# torch 2.13 renamed it (the old name still works, with a deprecation warning per call).
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class _FuncolCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class _FuncolReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPFuncol(tp.TPMLP):
    def loss(self, x, target):
        w_in, w1, w2 = self.params
        group = self.comm.group
        h = F.gelu(_FuncolCopy.apply(x @ w_in.t(), group) @ w1.t())
        return F.mse_loss(_FuncolReduce.apply(h @ w2.t(), group), target)


class TPLocal(tp.TPMLP):
    def loss(self, x, target):
        w_in, w1, w2 = self.params
        return F.mse_loss(F.gelu(x @ w_in.t() @ w1.t()) @ w2.t(), target)


class FSDPFuncol(fsdp.FSDPMLP):
    def loss(self, x, target):
        w1, w2 = (funcol.wait_tensor(_gather_autograd(s, 0, self.comm.group)) for s in self.params)
        return F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), target) / self.comm.world_size


class TPOverlapped(tp.TPMLP):
    def __init__(self, comm, cfg, full):
        super().__init__(comm, cfg, full, communication_stream(comm))


class FSDPOverlapped(fsdp.FSDPMLP):
    def __init__(self, comm, cfg, full):
        super().__init__(comm, cfg, full, communication_stream(comm))


class FSDPLocal(fsdp.FSDPMLP):
    def loss(self, x, target):
        w1, w2 = (s.repeat(self.comm.world_size, 1) for s in self.params)
        return F.mse_loss(F.gelu(x @ w1.t()) @ w2.t(), target) / self.comm.world_size


MODELS = {("tp", "symcomm"): TPOverlapped, ("tp", "serial"): tp.TPMLP, ("tp", "funcol"): TPFuncol, ("tp", "local"): TPLocal,
          ("fsdp", "symcomm"): FSDPOverlapped, ("fsdp", "serial"): fsdp.FSDPMLP, ("fsdp", "funcol"): FSDPFuncol,
          ("fsdp", "local"): FSDPLocal}


def build(step: str, variant: str, comm: symcomm.Communicator, hidden: int, ffn: int, dtype: torch.dtype):
    module = tp if step == "tp" else fsdp
    cfg = module.TrainConfig(hidden=hidden, ffn=ffn, dtype=dtype)
    return MODELS[step, variant](comm, cfg, module.FullMLP(cfg, comm.device)), cfg


def batch(comm: symcomm.Communicator, tokens: int, hidden: int, dtype: torch.dtype):
    """Inputs and targets (each rank its own: timing does not care whether TP's are replicated)."""
    return tuple(seeded((tokens, hidden), 7 + 2 * comm.rank + i, 1.0, dtype, comm.device) for i in range(2))


def time_gpu(comm, model, cfg, tokens_list, iters, rounds) -> dict[int, float]:
    """Microseconds per step per token count: one graph each, in one pool, replayed."""
    static = {t: batch(comm, t, cfg.hidden, cfg.dtype) for t in tokens_list}
    warm_up([(model, static[t]) for t in tokens_list], cfg.lr)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for t in sorted(tokens_list, reverse=True):
        graphs[t] = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(graphs[t], pool=pool):
            train_step(model, static[t], cfg.lr, static_grads=True)
    out = {}
    for t in tokens_list:
        graphs[t].replay()  # warm
        samples = []
        for _ in range(rounds):
            dist.barrier(group=comm.group)
            graphs[t].replay()  # untimed: its collectives line the ranks up after the barrier's skew
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graphs[t].replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / iters)
        out[t] = statistics.median(samples)
    del graphs
    return out


def time_cpu(comm, model, cfg, tokens_list, iters, rounds) -> dict[int, float]:
    out = {}
    for t in tokens_list:
        data = batch(comm, t, cfg.hidden, cfg.dtype)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(iters):
                train_step(model, data, cfg.lr, static_grads=False)
            samples.append((time.perf_counter() - start) * 1e6 / iters)
        out[t] = statistics.median(samples)
    return out


def slowest(comm, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cpu", action="store_true", help="gloo smoke test: tiny shapes, eager, meaningless timings")
    parser.add_argument("--tokens", default=None, help="comma-separated tokens per step (default 64,512,4096; 1,4 on --cpu)")
    parser.add_argument("--steps", default="tp,fsdp")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096 (12 on --cpu)")
    parser.add_argument("--ffn", type=int, default=None, help="default 14336 (24 on --cpu)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--nccl-max-ctas", type=int, default=None,
                        help="symcomm's plain NCCL communicator's maxCTAs (default: symcomm's, 16); "
                             "the FSDP rows' large gathers and reduce-scatters run there")
    args = parser.parse_args(argv)
    device = init_distributed(args.cpu)
    small = device.type == "cpu"
    tokens_list = [int(t) for t in (args.tokens or ("1,4" if small else "64,512,4096")).split(",")]
    hidden, ffn = args.hidden or (12 if small else 4096), args.ffn or (24 if small else 14336)
    dtype = torch.float32 if small else torch.bfloat16
    # FSDP keeps its weight shards in the pool and, eagerly, their gradients: room for both, twice over.
    shards = 2 * hidden * ffn // dist.get_world_size() * torch.empty((), dtype=dtype).element_size()
    extra = {} if args.nccl_max_ctas is None else {"nccl_max_ctas": args.nccl_max_ctas}
    comm = symcomm.Communicator(symmetric_capacity=max(256 << 20, 4 * shards), **extra)
    rows = []
    try:
        if comm.rank == 0:
            print(f"# world {comm.world_size}, {device.type}, hidden {hidden}, ffn {ffn}, {dtype}, "
                  f"torch {torch.__version__}" + ("; CPU: timings are meaningless" if small else ""), flush=True)
            print(f"# {'step':<5} {'tokens':>7} {'variant':<8} {'us/step':>10} {'comm us':>10}", flush=True)
        for step in args.steps.split(","):
            times = {}
            for variant in VARIANTS:
                model, cfg = build(step, variant, comm, hidden, ffn, dtype)
                timer = time_cpu if small else time_gpu
                times[variant] = {t: slowest(comm, v) for t, v in timer(comm, model, cfg, tokens_list, args.iters,
                                                                      args.rounds).items()}
                del model
            for t in tokens_list:
                for variant in VARIANTS:
                    us = times[variant][t]
                    rows.append({"step": step, "tokens": t, "variant": variant, "us_per_step": us,
                                 "comm_us": us - times["local"][t]})
                    if comm.rank == 0:
                        print(f"  {step:<5} {t:>7} {variant:<8} {us:>10.1f} {us - times['local'][t]:>10.1f}", flush=True)
        if args.json and comm.rank == 0:
            Path(args.json).write_text(json.dumps({"world_size": comm.world_size, "device": str(device),
                                                   "hidden": hidden, "ffn": ffn, "dtype": str(dtype),
                                                   "iters": args.iters, "rounds": args.rounds, "rows": rows}, indent=1))
    finally:
        comm.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
