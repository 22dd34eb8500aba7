"""FlashInfer's fused all-reduce + residual add + RMSNorm against symcomm's, in the same run.

    torchrun --nproc-per-node=N bench/flashinfer_norm.py [--tokens 1,4,16,...] [--hidden 8192]
                                                          [--rounds 3] [--json out.json]

FlashInfer (the ``flashinfer-python`` package, its ``flashinfer.comm.trtllm_allreduce_fusion``,
the kernel sglang uses) is the strongest public fused all-reduce + norm; the issue that asked
for symcomm's norm op names it as the anchor. It is not a dependency of symcomm: this script
needs it installed (on the GPU machine, which has no network, as bench/flashinfer_pack.sh's
trimmed archive with the kernel compiled ahead), and says so and stops where it is not.

Columns, per token count, bf16 [tokens, hidden] on every rank, CUDA-graph replay (20 calls per
graph, 10 replays), median of --rounds interleaved rounds, slowest rank, microseconds:

- ``nccl+torch``: NCCL all-reduce (symcomm's plain NCCL path), then ``a + residual`` and
  ``F.rms_norm``;
- ``symcomm``: ``comm.all_reduce_rmsnorm`` (auto: its all-reduce on the path the table picks,
  then csrc/rmsnorm.cu);
- ``fi-oneshot``, ``fi-twoshot``: FlashInfer's kernel with use_oneshot forced each way, PDL on,
  fp32 accumulation (the kernel's own heuristic picks one of these two);
- a second table, the all-reduce alone on the same x: ``ar-symcomm`` (``comm.all_reduce``, auto)
  and ``ar-fi-oneshot`` / ``ar-fi-twoshot``, FlashInfer's kernel with nothing fused (pattern
  kAllReduce), the custom all-reduce FlashInfer, vLLM and sglang ship.

The last columns: the path auto picked, and 'vs best fi', symcomm auto's time over the faster
FlashInfer column's (below 1.00: symcomm is faster).

Checks, every token count: FlashInfer's h and y against symcomm's within bf16 rounding (they
sum and normalise in fp32 but round in different places), so a column that computes something
else cannot pass for fast.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import symcomm
from symcomm.bench.timing import Timer

EPS = 1e-6


def table_lines(rows: list[dict], columns: list[str], ours: str, fi_columns: tuple[str, str],
                with_auto: bool) -> list[str]:
    """One table: the header, then per row each column's time, [the path auto took,] the time of
    ``ours`` over the faster of ``fi_columns``, and whether both FlashInfer columns matched
    symcomm's results."""
    lines = [f"{'tokens':>6s} {'bytes':>9s} " + " ".join(f"{c:>14s}" for c in columns)
             + (f" {'auto':>14s}" if with_auto else "") + f" {'vs best fi':>10s}  fi_ok"]
    for r in rows:
        us = r["us"]
        best_fi = min(us.get(c, float("inf")) for c in fi_columns)
        cells = " ".join(f"{us[c]:14.2f}" if c in us else f"{'-':>14s}" for c in columns)
        auto = f" {r['auto']:>14s}" if with_auto else ""
        ok = all(r.get(f"{c}_ok", True) for c in fi_columns)
        ratio = f"{us[ours] / best_fi:10.2f}" if best_fi < float("inf") else f"{'-':>10s}"
        lines.append(f"{r['tokens']:6d} {r['bytes']:9d} {cells}{auto} {ratio}  {ok}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,128,256,512,1024,2048")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(var, value)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import flashinfer
        import flashinfer.comm as fi
    except ImportError as exc:
        raise SystemExit(f"flashinfer is not importable here: {exc}") from exc
    tokens_list = [int(t) for t in args.tokens.split(",")]
    hidden, max_tokens = args.hidden, max(tokens_list)
    comm = symcomm.Communicator(symmetric_capacity=512 << 20)
    # The workspace holds every rank's max_tokens rows several times over (its lamport buffers).
    handles, workspace, metadata = fi.trtllm_create_ipc_workspace_for_all_reduce_fusion(
        rank, world, max_tokens, hidden, group=dist.group.WORLD, create_metadata=True)
    timer = Timer(torch.device("cuda", local), iters=20, warmup=3, graph_replays=10, capture=comm.graph_capture)
    gen = torch.Generator(device="cuda").manual_seed(23 + rank)
    same = torch.Generator(device="cuda").manual_seed(5)  # residual and weight: equal on every rank
    rows_out = []
    for tokens in tokens_list:
        with symcomm.use_symmetric_memory(comm):
            x = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        x.copy_(torch.randn(tokens, hidden, device="cuda", generator=gen))
        residual = torch.randn(tokens, hidden, device="cuda", generator=same).to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=same)).to(torch.bfloat16)
        a, h, y = (torch.empty_like(x) for _ in range(3))

        def nccl_torch():
            comm.all_reduce(x, out=a, algo="nccl")
            torch.add(a, residual, out=h)
            return F.rms_norm(h, (hidden,), weight, EPS)

        def symcomm_call(algo):
            return lambda: comm.all_reduce_rmsnorm(x, weight, residual=residual, eps=EPS, out=y,
                                                   residual_out=h, algo=algo)

        def fi_call(oneshot, fused=True):
            # fused=False: the same kernel with nothing fused, FlashInfer's plain all-reduce.
            outputs = (dict(allreduce_out=None, residual_in=residual, residual_out=h, norm_out=y, rms_gamma=weight)
                       if fused else dict(allreduce_out=a, residual_in=None, residual_out=None, norm_out=None,
                                          rms_gamma=None))
            pattern = fi.AllReduceFusionPattern.kARResidualRMSNorm if fused else fi.AllReduceFusionPattern.kAllReduce
            return lambda: fi.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=world, world_rank=rank, token_num=tokens, hidden_dim=hidden,
                workspace_ptrs=workspace, launch_with_pdl=True, trigger_completion_at_end=True,
                fp32_acc=True, pattern_code=pattern, use_oneshot=oneshot, quant_out=None, scale_out=None,
                rms_eps=EPS, scale_factor=None, layout_code=None, metadata=metadata, **outputs)

        calls = {"nccl+torch": nccl_torch, "symcomm": symcomm_call("auto"),
                 "fi-oneshot": fi_call(True), "fi-twoshot": fi_call(False),
                 "ar-symcomm": lambda: comm.all_reduce(x, out=a),
                 "ar-fi-oneshot": fi_call(True, fused=False), "ar-fi-twoshot": fi_call(False, fused=False)}
        row = {"tokens": tokens, "bytes": x.nbytes, "auto": comm.select(
            "all_reduce_rmsnorm", x, weight=weight, residual=residual).algo, "errors": {}}
        outputs = {}
        for name, call in list(calls.items()):
            try:  # both refuse a call they cannot serve before any communication, on every rank alike
                call()
            except (symcomm.ArgumentError, AssertionError) as exc:  # FlashInfer's two-shot asserts tokens > world
                row["errors"][name] = str(exc).split(": ", 1)[-1][:120]
                del calls[name]
                continue
            torch.cuda.synchronize()
            outputs[name] = (a.clone(),) if name.startswith("ar-") else (h.clone(), y.clone())
        ref_a, = outputs["ar-symcomm"]
        for name in ("ar-fi-oneshot", "ar-fi-twoshot"):
            if name in outputs:  # both sum in fp32 and round once; the orders may differ
                got_a, = outputs[name]
                row[f"{name}_err"] = float((got_a.float() - ref_a.float()).abs().max())
                row[f"{name}_ok"] = bool(torch.allclose(got_a.float(), ref_a.float(), rtol=2**-7, atol=2**-6))
        ref_h, ref_y = outputs["symcomm"]
        for name in ("fi-oneshot", "fi-twoshot"):
            if name in outputs:  # both normalise in fp32; h and y differ by a bf16 rounding or two
                got_h, got_y = outputs[name]
                row[f"{name}_h_err"] = float((got_h.float() - ref_h.float()).abs().max())
                row[f"{name}_y_err"] = float((got_y.float() - ref_y.float()).abs().max())
                row[f"{name}_ok"] = bool(torch.allclose(got_h.float(), ref_h.float(), rtol=2**-6, atol=2**-5)
                                         and torch.allclose(got_y.float(), ref_y.float(), rtol=2**-6, atol=2**-5))
        samples = {name: [] for name in calls}
        for _ in range(args.rounds):  # interleaved: a slow spell lands on one sample of each column
            for name, call in calls.items():
                samples[name].append(timer.measure(call))
        row["us"] = {name: statistics.median(s) for name, s in samples.items()}
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        if rank == 0:
            merged = dict(per_rank[0])
            merged["us"] = {k: max(r["us"][k] for r in per_rank) for k in merged["us"]}
            for key in [k for k in merged if k.endswith("_ok")]:
                merged[key] = all(r[key] for r in per_rank)
            rows_out.append(merged)
            print(f"tokens {tokens} done", flush=True)
    if rank == 0:
        columns = ["nccl+torch", "symcomm", "fi-oneshot", "fi-twoshot"]
        print(f"# all-reduce + residual + RMSNorm, world {world}, {torch.cuda.get_device_name()}, hidden {hidden}, "
              f"bf16, torch {torch.__version__}, flashinfer {flashinfer.__version__}; graph replay, 20 calls "
              f"per graph, 10 replays, median of {args.rounds} rounds, slowest rank; us")
        print("\n".join(table_lines(rows_out, columns, "symcomm", ("fi-oneshot", "fi-twoshot"), with_auto=True)))
        print("# all-reduce alone (FlashInfer's kernel with pattern kAllReduce; symcomm's all_reduce, auto): us; "
              "'vs best fi' = symcomm / the faster FlashInfer column")
        print("\n".join(table_lines(rows_out, ["ar-symcomm", "ar-fi-oneshot", "ar-fi-twoshot"], "ar-symcomm",
                                     ("ar-fi-oneshot", "ar-fi-twoshot"), with_auto=False)))
        for r in rows_out:
            if r["errors"]:
                print(f"# tokens {r['tokens']}: refused: {r['errors']}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": world, "device": torch.cuda.get_device_name(), "hidden": hidden,
                           "flashinfer": flashinfer.__version__, "torch": torch.__version__,
                           "rows": rows_out}, fh, indent=1)
    dist.barrier()
    fi.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles, dist.group.WORLD)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
