"""Gradients through symcomm's operations over gloo at 2 and 3 ranks.

Each rank's inputs and output gradients are drawn from seeds every rank knows, so every rank can
compute the same function on one process, with the full inputs of every rank, and let torch's
autograd differentiate L = sum over ranks s of <g_s, y_s>: rank r's gradient must equal the
reference's gradient with respect to rank r's inputs. Then torch.autograd.gradcheck in float64
on the global function, the errors for what has no gradient, check mode in backward, and the
same backward under torch.compile(fullgraph=True).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import symcomm
from _spawn import run_world

F64 = torch.float64


def rand(shape, seed, dtype=F64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def sizes_for(world):
    return [2, 0, 3, 1][:world]  # uneven, one rank with no rows


# name -> (symcomm forward on this rank's x, single-process forward of every rank's x -> every rank's y,
#          this rank's input shape)
def _specs(comm):
    w = comm.world_size
    sz = sizes_for(w)
    return {
        "all_reduce sum": (lambda x: comm.all_reduce(x), lambda xs: [sum(xs)] * w, lambda q: (3, 5)),
        "all_reduce avg": (lambda x: comm.all_reduce(x, op="avg"), lambda xs: [sum(xs) / w] * w, lambda q: (4,)),
        "all_gather": (lambda x: comm.all_gather(x), lambda xs: [torch.cat(xs)] * w, lambda q: (2, 3)),
        "reduce_scatter sum": (lambda x: comm.reduce_scatter(x), lambda xs: list(sum(xs).chunk(w)),
                               lambda q: (2 * w, 3)),
        "reduce_scatter avg": (lambda x: comm.reduce_scatter(x, op="avg"), lambda xs: list((sum(xs) / w).chunk(w)),
                               lambda q: (w, 2)),
        "all_gatherv": (lambda x: comm.all_gatherv(x, sz), lambda xs: [torch.cat(xs)] * w, lambda q: (sz[q], 3)),
        "reduce_scatterv": (lambda x: comm.reduce_scatterv(x, sz), lambda xs: list(sum(xs).split(sz)),
                            lambda q: (sum(sz), 2)),
        "all_to_allv": (lambda x: comm.all_to_allv(x, _a2a_counts(w)[comm.rank], [r[comm.rank] for r in _a2a_counts(w)]),
                        lambda xs: _a2a_reference(xs, _a2a_counts(w)), lambda q: (sum(_a2a_counts(w)[q]), 3)),
        # out=: the result is copied into the caller's tensor, which autograd follows
        "all_reduce out=": (lambda x: comm.all_reduce(x * 2, out=torch.empty_like(x)),
                            lambda xs: [2 * sum(xs)] * w, lambda q: (5,)),
        "all_reduce in place": (lambda x: _in_place(comm, x), lambda xs: [sum(3 * v for v in xs)] * w,
                                lambda q: (2, 2)),
        "all_gather out=": (lambda x: comm.all_gather(x, out=torch.empty(w * 2, 3, dtype=x.dtype)),
                            lambda xs: [torch.cat(xs)] * w, lambda q: (2, 3)),
    }


def _a2a_counts(world):
    """Rows rank r sends to rank p: uneven, zeros included, rank r's to itself too."""
    return [[(r + 2 * p) % 3 for p in range(world)] for r in range(world)]


def _a2a_reference(xs, counts):
    pieces = [x.split(row) for x, row in zip(xs, counts)]
    return [torch.cat([pieces[r][p] for r in range(len(xs))]) for p in range(len(xs))]


def _in_place(comm, x):
    y = x * 3  # a non-leaf: in place is allowed for autograd
    return comm.all_reduce(y, out=y)


def _reference_grad(fn_ref, xs, gs, rank):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    ys = fn_ref(xs)
    loss = sum((y * g).sum() for y, g in zip(ys, gs))
    return torch.autograd.grad(loss, xs[rank])[0]


def _vjp_world(rank, world):
    comm = symcomm.Communicator(check=True)  # backward collectives must pass check mode too
    for i, (name, (fn, fn_ref, shape)) in enumerate(_specs(comm).items()):
        xs = [rand(shape(q), 1000 * i + q) for q in range(world)]
        x = xs[rank].clone().requires_grad_()
        y = fn(x)
        assert y.requires_grad, name
        shapes = [t.shape for t in fn_ref(xs)]  # every rank's output
        gs = [rand(shapes[q], 5000 + 1000 * i + q) for q in range(world)]
        y.backward(gs[rank])
        want = _reference_grad(fn_ref, xs, gs, rank)
        assert x.grad.shape == want.shape and torch.allclose(x.grad, want, rtol=1e-12, atol=1e-12), (
            name, x.grad, want)
    comm.close()


def _tp_pair(rank, world):
    """A tensor-parallel MLP: the input and the loss are replicated (the same on every rank), so
    the input's gradient is counted once: copy_to_tp_region all-reduces the ranks' partial
    gradients, reduce_from_tp_region passes the replicated one through. Against one process
    with the full weights."""
    comm = symcomm.Communicator(check=True)
    hidden, ffn = 4, 3 * world
    x_full = rand((5, hidden), 1)
    w1, w2 = rand((ffn, hidden), 2), rand((hidden, ffn), 3)
    cols = slice(rank * 3, rank * 3 + 3)
    x = x_full.clone().requires_grad_()
    w1_r, w2_r = w1[cols].clone().requires_grad_(), w2[:, cols].clone().requires_grad_()
    h = torch.tanh(symcomm.copy_to_tp_region(comm, x) @ w1_r.t())
    y = symcomm.reduce_from_tp_region(comm, h @ w2_r.t())
    y.pow(2).sum().backward()

    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x_full, w1, w2))
    yr = torch.tanh(xr @ w1r.t()) @ w2r.t()
    yr.pow(2).sum().backward()
    assert torch.allclose(y, yr)
    assert torch.allclose(x.grad, xr.grad, rtol=1e-12), (x.grad, xr.grad)
    assert torch.allclose(w1_r.grad, w1r.grad[cols], rtol=1e-12) and torch.allclose(w2_r.grad, w2r.grad[:, cols])

    # A second derivative keeps the rule: each function's backward is the other one (a plain
    # all-reduce there made this Hessian-vector product `world` times too large).
    v = rand((5, hidden), 4)
    x2, xr2 = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
    y2 = symcomm.reduce_from_tp_region(comm, torch.tanh(symcomm.copy_to_tp_region(comm, x2) @ w1_r.detach().t())
                                       @ w2_r.detach().t())
    (gx,) = torch.autograd.grad(y2.pow(2).sum(), x2, create_graph=True)
    (gx * v).sum().backward()
    (gr,) = torch.autograd.grad((torch.tanh(xr2 @ w1.t()) @ w2.t()).pow(2).sum(), xr2, create_graph=True)
    (gr * v).sum().backward()
    assert torch.allclose(gx, gr, rtol=1e-12) and torch.allclose(x2.grad, xr2.grad, rtol=1e-10), (x2.grad, xr2.grad)
    comm.close()


def _several_and_unused(rank, world):
    """all_gatherv of two tensors where only the first output is used: the second input still
    gets its (zero) gradient through a collective every rank runs; a leaf that does not require
    grad gets none."""
    comm = symcomm.Communicator(check=True)
    sz = sizes_for(world)
    a = rand((sz[rank], 2), 10 + rank).requires_grad_()
    b = rand((sz[rank], 3), 20 + rank).requires_grad_()
    c = rand((sz[rank], 1), 30 + rank)
    ga, gb, _ = comm.all_gatherv([a, b, c], sz)
    (ga * (rank + 1)).sum().backward()
    rows = slice(sum(sz[:rank]), sum(sz[:rank + 1]))
    weight = sum(q + 1 for q in range(world))
    assert torch.equal(a.grad, torch.full_like(a, float(weight))[: rows.stop - rows.start])
    assert torch.equal(b.grad, torch.zeros_like(b)) and c.grad is None

    # An output whose gradient arrives as None (a Function that returns none for it): the input's
    # is zeros, through the collective every rank still runs, on one rank or on all.
    class NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.sum()

        @staticmethod
        def backward(ctx, g):
            return None

    calls = [lambda t: comm.all_reduce(t), lambda t: comm.all_gather(t), lambda t: comm.reduce_scatter(t),
             lambda t: comm.reduce_scatterv(t, [2] * world)]
    for i, call in enumerate(calls):
        for none_on in (range(world), (0,)):
            t = rand((2 * world, 3), 40 + rank).requires_grad_()
            out = call(t)
            (NoGrad.apply(out) if rank in none_on else out.sum()).backward()
            assert t.grad is not None and t.grad.shape == t.shape, (i, none_on)
            if len(none_on) == world:
                assert torch.equal(t.grad, torch.zeros_like(t)), (i, t.grad)
            elif i == 0:  # every rank's x gets the sum of the output gradients: ones from world - 1 ranks
                assert torch.equal(t.grad, torch.full_like(t, world - 1.0)), t.grad
    # The same for the norm, whose two outputs (y, h) may both get none.
    xb = rand((4, 16), 50 + rank).bfloat16().requires_grad_()
    res = comm.all_reduce_rmsnorm(xb, torch.ones(16, dtype=torch.bfloat16))
    (NoGrad.apply(res.out + res.residual) if rank == 0 else (res.out.sum() + res.residual.sum())).backward()
    assert xb.grad is not None and xb.grad.shape == xb.shape
    assert comm.all_reduce(torch.ones(2)).tolist() == [world, world]  # still in step
    comm.close()


def _no_gradient_errors(rank, world):
    comm = symcomm.Communicator()
    x = rand((4,), rank).requires_grad_()
    for op in ("max", "min", "prod"):
        y = comm.all_reduce(x, op=op)  # the forward works: only a backward is refused
        with pytest.raises(symcomm.ArgumentError, match=rf"all_reduce\(op='{op}'\) has no gradient"):
            y.sum().backward()
        with pytest.raises(symcomm.ArgumentError, match=rf"reduce_scatter\(op='{op}'\) has no gradient"):
            comm.reduce_scatter(rand((world,), rank).requires_grad_(), op=op).sum().backward()
    # MoE dispatch and combine have no backward: refused before anything is sent, rather than a
    # gradient silently dropped
    ids, weights = torch.zeros(3, 1, dtype=torch.int64), rand((3, 1), 7, torch.float32)
    tokens = rand((3, 8), rank, torch.bfloat16)
    with pytest.raises(symcomm.ArgumentError, match="moe_dispatch has no gradient"):
        comm.moe_dispatch(tokens.requires_grad_(), ids, weights, world, max_tokens=3)
    with pytest.raises(symcomm.ArgumentError, match="moe_dispatch has no gradient"):
        comm.moe_dispatch(tokens.detach(), ids, weights.requires_grad_(), world, max_tokens=3)
    with pytest.raises(symcomm.ArgumentError, match="moe_dispatch has no gradient"):  # by name too
        comm.run("moe_dispatch", tokens.detach(), ids, weights, world, max_tokens=3)
    d = comm.moe_dispatch(tokens.detach(), ids, weights.detach(), world, max_tokens=3)
    with pytest.raises(symcomm.ArgumentError, match="moe_combine has no gradient"):
        comm.moe_combine(d.x.float().to(d.x.dtype).requires_grad_(), d.handle)
    assert comm.moe_combine(d.x, d.handle).shape == tokens.shape
    # no_grad, or a tensor that needs none: nothing is recorded, the fast path runs
    with torch.no_grad():
        assert not comm.all_reduce(x).requires_grad
    assert not comm.all_gather(x.detach()).requires_grad
    comm.close()


@contextlib.contextmanager
def counting_collectives(calls):
    """Appends to ``calls`` every collective symcomm's torch path starts inside (both of
    symcomm.peers' collective layers: the bounded one on CPU tensors, torch.distributed's on CUDA),
    by name, or "refusal" for the row a refused call posts in the CPU comparison (TorchPath.refuse:
    its first value is -1, where a call's signature starts with its op's name as text)."""
    from symcomm.peers import GroupCollectives, HostCollectives
    saved = {(cls, n): getattr(cls, n) for cls in (GroupCollectives, HostCollectives)
             for n in ("all_reduce", "all_gather", "all_to_all_single")}

    def counted(key):
        def wrapper(*args, **kwargs):
            sent = args[-1] if args else None
            refusal = (key[1] == "all_gather" and isinstance(sent, torch.Tensor) and sent.dtype == torch.int64
                       and sent.numel() and int(sent[0]) == -1)
            calls.append("refusal" if refusal else key[1])
            return saved[key](*args, **kwargs)
        return wrapper

    for key in saved:
        setattr(*key, counted(key))
    try:
        yield
    finally:
        for key, f in saved.items():
            setattr(*key, f)


def _recorded_bad_input(rank, world):
    """A call autograd records runs as its torch.library op; it must still raise eager's errors,
    before any of its data is sent: the op's schema alone gave torch's RuntimeError for a non-string
    argument, and its functional out= cast any dtype and broadcast any shape into the output."""
    comm = symcomm.Communicator()
    x = rand((2 * world, 3), rank).requires_grad_()
    xb = rand((2, 16), rank).bfloat16().requires_grad_()
    wb = torch.ones(16, dtype=torch.bfloat16)
    bad = [
        (lambda: comm.all_reduce(x, op=5), symcomm.ArgumentError, "op must be one of"),
        (lambda: comm.all_reduce(x, algo=5), symcomm.ArgumentError, "algo must be a string"),
        (lambda: comm.all_reduce(x, out=torch.empty(2 * world, 3, dtype=torch.float32)), symcomm.DtypeError,
         "out must be torch.float64"),
        (lambda: comm.all_reduce(x, out=torch.empty(1, 3, dtype=F64)), symcomm.ArgumentError, "out has shape (1, 3)"),
        (lambda: comm.all_gather(x, out=torch.empty(2 * world, 3, dtype=F64)), symcomm.ArgumentError, "out has shape"),
        (lambda: comm.reduce_scatter(x, out=torch.empty(1, 3, dtype=F64)), symcomm.ArgumentError, "out has shape (1, 3)"),
        (lambda: comm.reduce_scatterv(x, [2] * world, op=3), symcomm.ArgumentError, "op must be one of"),
        (lambda: comm.all_gatherv(x, [2 * world]), symcomm.ArgumentError, "one entry per rank"),
        (lambda: comm.all_gatherv([x, x.detach()], [2 * world] * world, out=[torch.empty(2 * world * world, 3, dtype=F64)] * 2),
         symcomm.ArgumentError, "out[0] overlaps out[1]"),
        (lambda: comm.run("all_reduce", x, op="bogus"), symcomm.ArgumentError, "op must be one of"),
        # torch refuses writing into a leaf that requires grad, but only after the collective ran.
        (lambda: comm.all_reduce(x, out=x), symcomm.ArgumentError, "out is a leaf tensor that requires grad"),
        (lambda: comm.all_gather(x, out=torch.zeros(2 * world * world + 1, 3, dtype=F64, requires_grad=True)[1:]),
         symcomm.ArgumentError, "out is a view of a leaf tensor that requires grad"),
        (lambda: comm.all_gatherv([x, x * 1], [2 * world] * world,
                                  out=[torch.empty(2 * world * world, 3, dtype=F64),
                                       torch.empty(2 * world * world, 3, dtype=F64, requires_grad=True)]),
         symcomm.ArgumentError, "out[1] is a leaf tensor"),
        (lambda: comm.all_reduce_rmsnorm(xb, wb, residual_out=torch.zeros_like(xb, requires_grad=True)),
         symcomm.ArgumentError, "residual_out is a leaf tensor"),
    ]
    with torch.inference_mode():
        made_in_inference = torch.empty(2 * world, 3, dtype=F64)
    bad.append((lambda: comm.all_reduce(x, out=made_in_inference), symcomm.ArgumentError, "inference_mode"))
    sent = []
    for i, (call, exc_type, fragment) in enumerate(bad):
        with pytest.raises(exc_type) as info, counting_collectives(sent):
            call()
        assert fragment in str(info.value), f"case {i}: {info.value!r}"
        # Only the refusal goes out, so that peers refusing differently learn why.
        assert sent == ["refusal"], f"case {i} reached torch.distributed ({sent}) before it raised"
        sent.clear()
    with counting_collectives(sent):
        assert comm.all_reduce(torch.ones(2)).tolist() == [world, world]
    assert sent, "the counter saw no collective, so it could not have seen one above"
    out = torch.empty(2 * world * world, 3, dtype=F64)
    assert comm.all_gather(x, out=out) is out and out.grad_fn is not None  # a good out= still records
    comm.close()


def _replicated_in(x):
    """x, the same on every rank, whose gradient sums every rank's share (torch.distributed's
    all-reduce, so symcomm is not checked by itself)."""

    class Replicated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g)
            return g

    return Replicated.apply(x)


def _gather_split(y, world, rank):
    """Every rank's y, gathered with torch.distributed, whose backward keeps this rank's slice:
    a replicated output's gradient counted once. With _replicated_in this makes gradcheck's
    function the global one, the same on every rank."""

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.stack(parts)

        @staticmethod
        def backward(ctx, g):
            return g[rank]

    return Gather.apply(y)


def _gradcheck_world(rank, world):
    comm = symcomm.Communicator()
    checked = 0
    for i, (name, (fn, fn_ref, shape)) in enumerate(_specs(comm).items()):
        xs = [rand(shape(q), 77 * i + q) for q in range(world)]
        if len({x.shape for x in xs}) != 1 or len({y.shape for y in fn_ref(xs)}) != 1:
            continue  # the v-variants' shapes differ per rank; the reference check above covers them
        x_all = torch.stack(xs).requires_grad_()

        def global_fn(xa, fn=fn):
            # Every rank perturbs the same element of the same (replicated) x_all, so the
            # numerical Jacobian is the global function's; rank r feeds the collective its slice.
            return _gather_split(fn(_replicated_in(xa)[rank]), world, rank)

        assert torch.autograd.gradcheck(global_fn, (x_all,), check_batched_grad=False,
                                        check_undefined_grad=False), name
        checked += 1
    assert checked == 8 + (world == 3), checked  # all_to_allv's shapes agree at world 3 only
    comm.close()


def _norm_and_fp4(rank, world):
    """all_reduce_rmsnorm (bf16) against autograd through a float64 reference; all_gatherv_fp4's
    straight-through gradient; and the quantized outputs refusing a gradient."""
    comm = symcomm.Communicator(check=True)
    t, hdim = 3, 32
    xs = [rand((t, hdim), 300 + q, torch.bfloat16) for q in range(world)]
    res = [rand((t, hdim), 400 + q, torch.bfloat16) for q in range(world)]
    ws = [1 + 0.1 * rand((hdim,), 500 + q, torch.bfloat16) for q in range(world)]
    gys = [rand((t, hdim), 600 + q, torch.bfloat16) for q in range(world)]
    ghs = [rand((t, hdim), 700 + q, torch.bfloat16) for q in range(world)]
    x, r, w = (v[rank].clone().requires_grad_() for v in (xs, res, ws))
    got = comm.all_reduce_rmsnorm(x, w, residual=r, eps=1e-5)
    torch.autograd.backward([got.out, got.residual], [gys[rank], ghs[rank]])

    xr, rr, wr = ([v.double().requires_grad_() for v in vs] for vs in (xs, res, ws))
    total = sum(xr)
    loss = 0
    for q in range(world):
        h = total + rr[q]
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * wr[q]
        loss = loss + (y * gys[q].double()).sum() + (h * ghs[q].double()).sum()
    loss.backward()
    for name, mine, ref in (("x", x, xr[rank]), ("residual", r, rr[rank]), ("weight", w, wr[rank])):
        err = (mine.grad.double() - ref.grad).abs().max().item()
        scale = ref.grad.abs().max().item()
        assert mine.grad.dtype == torch.bfloat16 and err <= 2e-2 * scale, (name, err, scale)

    # quantized output: no gradient through y, a clear error if one is asked for
    q = comm.all_reduce_rmsnorm(x, w, residual=r, quant="fp8", scale=1.0)
    with pytest.raises(symcomm.ArgumentError, match=r"quant='fp8'.*no gradient"):
        q.out.float().sum().backward()
    q = comm.all_reduce_rmsnorm(x, w, residual=r, quant="fp8", scale=1.0)
    x.grad = r.grad = None
    q.residual.sum().backward()  # the residual output (sum of the ranks' x, plus r) keeps its gradient
    assert torch.equal(r.grad, torch.ones_like(r)) and torch.equal(x.grad, torch.full_like(x, world))

    # FP4 gather: straight through the dequantized values, extras by reduce-scatterv
    sz = sizes_for(world)
    xf = rand((sz[rank], 32), 800 + rank, torch.bfloat16).requires_grad_()
    extra = rand((sz[rank], 2), 900 + rank, torch.float32).requires_grad_()
    ids = torch.arange(sz[rank] * 2, dtype=torch.int32).view(sz[rank], 2)
    g = comm.all_gatherv_fp4(xf, sz, 1.0, extra=[ids, extra], dequantize=True)
    gv = rand(g.values.shape, 1234, torch.bfloat16)  # the same on every rank
    ge = rand(g.extra[1].shape, 4321, torch.float32)
    torch.autograd.backward([g.values, g.extra[1]], [gv, ge])
    rows = slice(sum(sz[:rank]), sum(sz[:rank + 1]))
    assert torch.equal(xf.grad, (gv[rows].float() * world).to(torch.bfloat16))
    assert torch.equal(extra.grad, ge[rows] * world)
    g = comm.all_gatherv_fp4(xf, sz, 1.0)
    with pytest.raises(symcomm.ArgumentError, match="payload and block scales.*no gradient"):
        g.scales.float().sum().backward()
    # out= as eager fills it: the plain scales into out.scales, a swizzled copy returned, and
    # values made when out.values is None
    total = sum(sz)

    def given():
        return symcomm.Fp4Gathered(torch.empty(total, 16, dtype=torch.uint8),
                                   torch.empty(total, 2, dtype=torch.float8_e4m3fn), (), None, None)

    recorded_out, eager_out = given(), given()
    got = comm.all_gatherv_fp4(xf, sz, 1.0, dequantize=True, swizzle=True, out=recorded_out)
    want = comm.all_gatherv_fp4(xf.detach(), sz, 1.0, dequantize=True, swizzle=True, out=eager_out)
    assert got.values is not None and got.values.grad_fn is not None and torch.equal(got.values, want.values)
    assert got.scales.shape == want.scales.shape == (128, 4)
    for a, b in ((got.scales, want.scales), (recorded_out.scales, eager_out.scales), (got.packed, want.packed)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    comm.close()


def _pool_placement(rank, world):
    """Where backward allocates (logic only, so on gloo with a stand-in pool): inside the
    pool context when the forward's input was symmetric, not otherwise; a full pool (the context
    raising SymmetricMemoryError, as the real one does on exhaustion) makes the call run again
    outside it, with the right gradient."""
    from symcomm.communicator import Communicator
    from symcomm.operations import autograd

    entered = []

    class Pool:
        def __init__(self, comm, full):
            self.full = full

        def __enter__(self):
            entered.append(self.full)

        def __exit__(self, *exc):
            if self.full:
                raise symcomm.SymmetricMemoryError("symmetric pool exhausted (stand-in)")
            return False

    comm = symcomm.Communicator()
    symmetric = {"x": False}
    Communicator.symmetric_pool = property(lambda self: object())
    autograd.in_pool = lambda key, t: symmetric["x"]
    for full in (False, True):
        autograd.use_symmetric_memory = lambda c, full=full: Pool(c, full)
        for sym in (False, True):
            symmetric["x"] = sym
            entered.clear()
            x = rand((2, 3), rank).requires_grad_()
            comm.all_gather(x).backward(torch.ones(2 * world, 3, dtype=F64))
            assert torch.equal(x.grad, torch.full_like(x, float(world))), (full, sym, x.grad)
            assert entered == ([full] if sym else []), (full, sym, entered)
            # A backward whose shapes are this rank's own never goes to the pool: an uneven
            # gather's (its reduce-scatterv output has this rank's rows), all_to_allv's.
            for sizes in ([2] * world, [1 + r for r in range(world)]):
                entered.clear()
                x = rand((sizes[rank], 3), rank).requires_grad_()
                comm.all_gatherv(x, sizes).backward(torch.ones(sum(sizes), 3, dtype=F64))
                assert torch.equal(x.grad, torch.full_like(x, float(world))), (sizes, x.grad)
                even = len(set(sizes)) == 1
                assert entered == ([full] if sym and even else []), (full, sym, sizes, entered)
            entered.clear()
            x = rand((world, 3), rank).requires_grad_()
            comm.all_to_allv(x, [1] * world, [1] * world).backward(torch.ones(world, 3, dtype=F64))
            assert torch.equal(x.grad, torch.ones_like(x)) and entered == [], (full, sym, entered)
    comm.close()


def _compiled(rank, world):
    """An FSDP-like step under torch.compile(fullgraph=True): gather the weight shard, use it,
    and AOTAutograd's backward reduce-scatters its gradient, as eager does."""
    comm = symcomm.Communicator()
    shard = rand((2, 4), 40 + rank).requires_grad_()
    x = rand((3, 4), 50 + rank)

    def step(s, inp):
        w = comm.all_gather(s)  # [2 * world, 4]
        h = torch.tanh(inp @ w.t())
        return comm.all_reduce(h.sum(0, keepdim=True))

    eager = step(shard, x)
    eager.sum().backward()
    want = shard.grad.clone()
    shard.grad = None
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(shard, x)
    got.sum().backward()
    assert torch.allclose(got, eager) and torch.allclose(shard.grad, want, rtol=1e-10), (shard.grad, want)

    def tp(inp, col):
        return symcomm.reduce_from_tp_region(comm, torch.relu(symcomm.copy_to_tp_region(comm, inp) @ col.t()))

    inp = rand((3, 4), 60).requires_grad_()  # replicated
    col = rand((2, 4), 70 + rank).requires_grad_()
    tp(inp, col).sum().backward()
    want_inp, want_col = inp.grad.clone(), col.grad.clone()
    inp.grad = col.grad = None
    torch.compile(tp, fullgraph=True)(inp, col).sum().backward()
    assert torch.allclose(inp.grad, want_inp) and torch.allclose(col.grad, want_col)

    # Sizes that change between calls turn symbolic on the recompile: the backward must not hash
    # them (it raised TypeError on one rank, while the other waited in the collective).
    gatherv = torch.compile(lambda t, sizes: comm.all_gatherv(t, sizes), backend="aot_eager", fullgraph=True)
    for sizes in ([2, 2], [1, 2], [3, 1]):
        t = rand((sizes[rank], 3), 80 + rank).requires_grad_()
        (gatherv(t, sizes) * 2).sum().backward()
        assert torch.equal(t.grad, torch.full_like(t, 2.0 * world)), (sizes, t.grad)
    # The shape functions apply eager's rules, not an IndexError.
    with pytest.raises(Exception, match="at least one dimension"):
        torch.compile(lambda t: comm.all_gather(t), backend="aot_eager", fullgraph=True)(torch.ones(()))
    with pytest.raises(Exception, match="one entry per rank"):
        torch.compile(lambda t: comm.reduce_scatterv(t, [1]), backend="aot_eager", fullgraph=True)(torch.ones(1, 2))
    comm.close()


def _all(rank, world):
    # One world for every check: starting gloo ranks costs more than the checks.
    _vjp_world(rank, world)
    _tp_pair(rank, world)
    _several_and_unused(rank, world)
    _no_gradient_errors(rank, world)
    _recorded_bad_input(rank, world)
    _gradcheck_world(rank, world)
    _norm_and_fp4(rank, world)
    _pool_placement(rank, world)  # last: it patches the pool test into this process


@pytest.mark.parametrize("world", (2, 3))
def test_gradients_match_the_single_process_reference(world):
    run_world(_all, world, timeout_s=300)


def test_backward_under_torch_compile():
    run_world(_compiled, 2, timeout_s=400)
