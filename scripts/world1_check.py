"""Every public op at world 1 on one GPU: eager, inside use_symmetric_memory, under CUDA-graph
capture (replay bitwise equal to eager, with and without graph communicators), FP4, select()
and capabilities(), the collectives' backward (gradients from the pool when the inputs were),
a clean close, then 50 open/capture/close rounds that must not leak.

    torchrun --nproc-per-node=1 scripts/world1_check.py

At world 1 every collective is a copy (or the identity for a sum), so each result must equal
its input bit for bit, which makes the check exact. Prints one line per check and
`world1: N checks passed` last; exits 1 at the first failure.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import symcomm
from symcomm import _native, fp4

CHECKS: list[str] = []


def ok(what: str, cond: bool, detail: object = "") -> None:
    if not cond:
        print(f"FAIL {what} {detail}", flush=True)
        sys.exit(1)
    CHECKS.append(what)
    print(f"ok   {what}", flush=True)


def rand(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * 3 + 0.25).to(dtype)


def every_op(comm: symcomm.Communicator, x: torch.Tensor, tag: str) -> list[torch.Tensor]:
    rows = x.shape[0]
    outs = [comm.all_reduce(x), comm.all_gather(x), comm.all_gatherv(x, [rows]),
            comm.reduce_scatter(x), comm.reduce_scatterv(x, [rows])]
    for name, out in zip(("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv"), outs):
        ok(f"{tag} {name} {tuple(x.shape)} {x.dtype}", torch.equal(out.view(torch.uint8), x.view(torch.uint8)))
    return outs


def graphs(comm: symcomm.Communicator, tag: str) -> None:
    """Capture every op twice, replay in mixed order with fresh inputs, bitwise vs eager; and
    check which NCCL communicator each launch named: with graph_communicators=True every
    captured launch goes to a graph communicator of its own, otherwise none is opened."""
    launches: list[tuple[str, str, int, bool]] = []

    class Recording:  # forwards every NCCL call unchanged, noting its communicator
        def __init__(self, lib, path: str) -> None:
            self._lib, self._path = lib, path

        def __getattr__(self, name: str):
            fn = getattr(self._lib, name)
            if not name.startswith("nccl") or name.startswith("ncclGroup"):
                return fn

            def call(*args):
                launches.append((self._path, name, args[-2], torch.cuda.is_current_stream_capturing()))
                return fn(*args)
            return call

    nccl_paths = [comm.path(name) for name in ("nccl", "nccl-symm")]
    for p in nccl_paths:
        p._lib = Recording(p._lib, p.name)

    y = rand((128, 32), torch.float16, 11)
    static = y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        every_op(comm, static, f"{tag} warm-up")
    torch.cuda.current_stream().wait_stream(side)
    captured, results = [], []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(g):
            res = [comm.all_reduce(static), comm.all_gather(static), comm.all_gatherv(static, [128]),
                   comm.reduce_scatter(static), comm.reduce_scatterv(static, [128])]
        captured.append(g)
        results.append(res)
    for step, which in enumerate((1, 0, 0, 1)):
        fresh = rand((128, 32), torch.float16, 100 + step)
        static.copy_(fresh)
        captured[which].replay()
        torch.cuda.synchronize()
        eager = [comm.all_reduce(fresh), comm.all_gather(fresh), comm.all_gatherv(fresh, [128]),
                 comm.reduce_scatter(fresh), comm.reduce_scatterv(fresh, [128])]
        ok(f"{tag} graph {which} replay {step} bitwise equal to eager",
           all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(results[which], eager)))

    comms = {p.name: (p.comm, p.graph_comm) for p in nccl_paths}
    enabled = comm.capabilities()["nccl_graph_communicator"]["enabled"]
    print(f"{tag} communicators (eager, graph):", comms, flush=True)
    if enabled:
        ok(f"{tag} graph_capture() opened a graph communicator per NCCL path",
           all(g and g != e for e, g in comms.values()), comms)
    else:
        ok(f"{tag} no graph communicator unless asked for", all(not g for _, g in comms.values()), comms)
    wrong = [l for l in launches if l[2] != comms[l[0]][1 if l[3] and enabled else 0]]
    ok(f"{tag} {sum(l[3] for l in launches)} captured launches, {sum(not l[3] for l in launches)} eager ones, "
       f"each on its communicator", not wrong and launches, wrong[:5])
    print(f"{tag} memory:", comm.capabilities()["memory"], flush=True)
    for p in nccl_paths:
        p._lib = p._lib._lib


def backward(comm: symcomm.Communicator) -> None:
    """Every collective's backward at world 1, where each is the identity: the gradient must be
    the output's bit for bit. Eager, a leaf from the symmetric pool gets its gradient from the
    pool (the backward collective allocated it there); one outside gets it outside. Captured
    (forward and backward in one graph), the gradient comes from the graph's pool and the
    replay equals eager."""
    ops = {"all_reduce": lambda t: comm.all_reduce(t), "all_gather": lambda t: comm.all_gather(t),
           "all_gatherv": lambda t: comm.all_gatherv(t, [t.shape[0]]),
           "reduce_scatter": lambda t: comm.reduce_scatter(t), "reduce_scatterv": lambda t: comm.reduce_scatterv(t, [t.shape[0]])}
    for shape, dtype in (((64, 32), torch.bfloat16), ((33, 129), torch.float32)):
        g = rand(shape, dtype, 500)
        for name, fn in ops.items():
            for symmetric in (False, True):
                with symcomm.use_symmetric_memory(comm, disabled=not symmetric):
                    x = rand(shape, dtype, 501)
                x.requires_grad_()
                y = fn(x)
                y.backward(g)
                ok(f"backward of {name} {shape} {dtype} {'pool' if symmetric else 'plain'} input: gradient bitwise, "
                   f"in the pool iff the input was", torch.equal(x.grad.view(torch.uint8), g.view(torch.uint8))
                   and comm.is_symmetric(x.grad) == symmetric, (comm.is_symmetric(x.grad), symmetric))
    with symcomm.use_symmetric_memory(comm):
        x = rand((128, 64), torch.bfloat16, 502).requires_grad_()
    static_g = rand((128, 64), torch.bfloat16, 503)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_gather(comm.all_reduce(x)).backward(static_g)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        comm.all_gather(comm.all_reduce(x)).backward(static_g)
    captured_grad = x.grad
    ok("captured backward: the gradient comes from the graph's pool, not the symmetric one",
       not comm.is_symmetric(captured_grad))
    for step in range(2):
        static_g.copy_(rand((128, 64), torch.bfloat16, 600 + step))
        graph.replay()
        torch.cuda.synchronize()
        ok(f"captured forward + backward replay {step} bitwise equal to the gradient",
           torch.equal(captured_grad.view(torch.uint8), static_g.view(torch.uint8)))
    del graph, captured_grad, x


def pool_context_and_norm(comm: symcomm.Communicator) -> None:
    """use_symmetric_memory does not nest (torch routes a pool once), and says so in symcomm's
    words; all_reduce_rmsnorm with and without a residual and residual_out gives add_rmsnorm's
    bits (at world 1 the all-reduce of x is x)."""
    nested = None
    with symcomm.use_symmetric_memory(comm):
        try:
            with symcomm.use_symmetric_memory(comm):
                pass
        except symcomm.SymmetricMemoryError as exc:
            nested = str(exc)
        inside = torch.empty(4096, device="cuda")
    after = torch.empty(4096, device="cuda")
    ok("a nested use_symmetric_memory raises SymmetricMemoryError; the open one still routes to the pool",
       nested is not None and "already open" in nested and comm.is_symmetric(inside)
       and not comm.is_symmetric(after), nested)
    x, res, w = rand((8, 4096), torch.bfloat16, 91), rand((8, 4096), torch.bfloat16, 92), rand(4096, torch.bfloat16, 93)
    want, plain = symcomm.rmsnorm.add_rmsnorm(x, w, residual=res), symcomm.rmsnorm.add_rmsnorm(x, w)
    given = torch.empty_like(x)
    got = [comm.all_reduce_rmsnorm(x, w, residual=res), comm.all_reduce_rmsnorm(x, w),
           comm.all_reduce_rmsnorm(x, w, residual=res, residual_out=given),
           comm.all_reduce_rmsnorm(x, w, residual_out=torch.empty_like(x))]
    ok("all_reduce_rmsnorm at world 1: add_rmsnorm's bits with and without a residual and residual_out",
       torch.equal(got[0].out, want.out) and torch.equal(got[0].residual, want.residual)
       and torch.equal(got[2].out, want.out) and got[2].residual is given and torch.equal(given, want.residual)
       and torch.equal(got[1].out, plain.out) and torch.equal(got[1].residual, x)
       and torch.equal(got[3].out, plain.out) and torch.equal(got[3].residual, x))


def memory_loop(rounds: int) -> None:
    """Open, capture on, and close a communicator ``rounds`` times: device memory must come
    back each time (NCCL's own one-time state settles after the first round)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = []
    for i in range(rounds):
        c = symcomm.Communicator(symmetric_capacity=16 << 20, graph_communicators=bool(i % 2))
        x = rand((64, 64), torch.bfloat16, i)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        with c.graph_capture(), torch.cuda.graph(g):
            c.all_reduce(x)
        g.replay()
        torch.cuda.synchronize()
        del g, x
        c.close()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free.append(torch.cuda.mem_get_info()[0])
    growth = (free[1] - free[-1]) / 2**20  # MiB lost between round 2 and the last
    print(f"memory loop: free MiB per round {[round(f / 2**20) for f in free[:4]]} ... "
          f"{round(free[-1] / 2**20)}; growth after round 1: {growth:.1f} MiB", flush=True)
    ok(f"{rounds} open/capture/close rounds leak no device memory (< 4 MiB)", growth < 4, growth)


def main() -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
    comm = symcomm.Communicator(symmetric_capacity=64 << 20)
    caps = comm.capabilities()
    print("paths:", {k: v.get("reason", "enabled") for k, v in caps["paths"].items()}, flush=True)
    ok("device is cuda", comm.device.type == "cuda", comm.device)
    ok("nccl open", "nccl" in comm.algorithms(), caps["paths"]["nccl"])
    ok("nccl-symm open", "nccl-symm" in comm.algorithms(), caps["paths"]["nccl-symm"])
    early = caps["nccl"]["early_dependent_launch"]
    ok(f"NCCL {caps['nccl']['version']}: symcomm's kernels signal dependents early = {early}",
       bool(_native.load().lib.symcomm_set_early_dependents(int(early))) == early)
    ok("custom kernels off at world 1 with a reason",
       "world size 1" in caps["paths"]["custom-oneshot"].get("reason", ""), caps["paths"]["custom-oneshot"])

    # odd sizes, sizes that are not whole 16-byte vectors, and empty tensors
    for i, (shape, dtype) in enumerate([((7, 3), torch.bfloat16), ((1000, 16), torch.float16),
                                        ((0, 5), torch.float32), ((33, 129), torch.float32),
                                        ((4096, 8), torch.bfloat16)]):
        every_op(comm, rand(shape, dtype, i), "eager plain")
        with symcomm.use_symmetric_memory(comm):
            xs = rand(shape, dtype, i)
            out = torch.empty_like(xs)
        ok(f"symmetric allocation {shape}", comm.is_symmetric(xs) or xs.numel() == 0)
        with symcomm.use_symmetric_memory(comm):
            every_op(comm, xs, "eager symmetric")  # outputs allocated in the pool too
        for algo in ("nccl", "nccl-symm"):
            ok(f"forced {algo} all_reduce {shape}", torch.equal(comm.all_reduce(xs, out=out, algo=algo), xs))

    with symcomm.use_symmetric_memory(comm):
        x = rand((256, 64), torch.bfloat16, 9)
        out = torch.empty_like(x)
    choice = comm.select("all_reduce", x, out=out)
    print("select:", choice, flush=True)
    ok("select names a path and explains the rest", bool(choice.algo) and bool(choice.rejected))

    pool_context_and_norm(comm)
    graphs(comm, "default")
    backward(comm)

    # FP4: the gather at world 1 must equal a local quantization bit for bit
    h = 64
    for rows in (0, 1, 37):
        xf = rand((rows, h), torch.bfloat16, 50 + rows)
        gs = fp4.global_scale_for(xf if rows else torch.ones(1, h, dtype=torch.bfloat16, device="cuda"), comm)
        ids = torch.arange(rows * 2, device="cuda", dtype=torch.int32).view(rows, 2)
        got = comm.all_gatherv_fp4(xf, [rows], gs, extra=[ids], dequantize=True)
        packed, scales = fp4.quantize(xf, gs)
        ok(f"fp4 gather {rows} rows bitwise", torch.equal(got.packed, packed)
           and torch.equal(got.scales.view(torch.uint8), scales.view(torch.uint8))
           and torch.equal(got.extra[0], ids)
           and torch.equal(got.values, fp4.dequantize(packed, scales, gs, torch.bfloat16)))
    with symcomm.use_symmetric_memory(comm):
        xf = rand((16, h), torch.bfloat16, 77)
    got = comm.all_gatherv_fp4(xf, [16], fp4.global_scale_for(xf, comm), swizzle=True)
    ok("fp4 swizzled scales", got.scales.shape == fp4.swizzled_shape(16, h // fp4.BLOCK))

    del x, out, xs, xf, got
    comm.close()
    ok("closed", comm.closed and comm.group is None)

    second = symcomm.Communicator(symmetric_capacity=16 << 20, graph_communicators=True)
    graphs(second, "graph-comms")
    second.close()
    memory_loop(50)
    dist.destroy_process_group()
    print(f"world1: {len(CHECKS)} checks passed", flush=True)


if __name__ == "__main__":
    main()
