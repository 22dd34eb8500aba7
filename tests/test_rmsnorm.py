"""all_reduce_rmsnorm on the CPU: the torch reference against float64, csrc/rmsnorm.cu's math
(run on the host) bit for bit against the reference, the FP8 / NVFP4 outputs against torch's
cast and symcomm's codec, every argument rule, and the op over gloo at two ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import symcomm
from _spawn import run_world
from symcomm import _native, fp4
from symcomm import rmsnorm as fn
from symcomm.backends.composite import reference_norm, unfused_norm
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT
from symcomm.dispatch import INF, DispatchTable, Router
from symcomm.operations import ALL_REDUCE, ALL_REDUCE_RMSNORM
from symcomm.rmsnorm import OP as NORM_KEY
from symcomm.errors import ArgumentError, DtypeError

DTYPES = (torch.bfloat16, torch.float16)
needs_native = pytest.mark.needs_native
CPU = torch.device("cpu")


def rows(tokens: int, hidden: int, dtype: torch.dtype, seed: int, spread: float = 1.0) -> torch.Tensor:
    """Random non-zero values, |x| in [0.5, 1.5) * spread, random signs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(tokens, hidden, generator=g) + 0.5
    sign = torch.randint(0, 2, (tokens, hidden), generator=g) * 2 - 1
    return (mag * sign * spread).to(dtype)


def weight_for(hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return rows(1, hidden, dtype, seed + 1000)[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.uint8)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"


def float64_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h64 = h.double()
    return h64 * torch.rsqrt(h64.pow(2).mean(dim=1, keepdim=True) + eps) * w.double()


# ------------------------------------------------------------------------ reference vs float64
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 2048), (7, 7168), (3, 8192), (5, 24)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_against_float64(dtype, tokens, hidden, with_residual):
    a = rows(tokens, hidden, dtype, 1, spread=3.0)
    r = rows(tokens, hidden, dtype, 2) if with_residual else None
    w = weight_for(hidden, dtype, 3)
    ref = fn.reference_add_rmsnorm(a, w, r, 1e-6)
    # h: the exact sum rounded once to the dtype. fp32 holds at least 2p + 2 bits of a bf16/fp16
    # sum, so rounding the exact (float64) sum directly gives the same bits as the contract's
    # fp32 add followed by one rounding.
    want_h = a if r is None else (a.double() + r.double()).to(dtype)
    assert_bitwise(ref.residual, want_h, "h")
    # y: from the rounded h in float64. The fp32 sum of squares in the kernel's order is within
    # (hidden / 256 + 8 + 13) * 2^-24 relative (under 2^-17 for these sizes), the rsqrt and the
    # two products add a few 2^-24, and rounding to the dtype adds half an ulp: eps / 2
    # relative. So eps / 2 + 2^-14 relative bounds the error with a wide margin for fp32 and
    # none to spare for a wrong rounding point (that would cost a whole rounding of h: eps / 2 more).
    y64 = float64_norm(want_h, w, 1e-6)
    bound = (torch.finfo(dtype).eps / 2 + 2.0**-14) * y64.abs()
    err = (ref.out.double() - y64).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_within_one_ulp_of_torchs_own_order(dtype):
    a, w = rows(7, 7168, dtype, 4, spread=2.0), weight_for(7168, dtype, 4)
    ref = fn.reference_add_rmsnorm(a, w, None, 1e-5)
    plain = torch.nn.functional.rms_norm(a.float(), (7168,), w.float(), 1e-5).to(dtype)
    steps = (bits(ref.out).int() - bits(plain).int()).abs()  # same sign: ulps apart
    assert int(steps.max()) <= 1


def test_reference_sqrt_is_correctly_rounded():
    # torch's vectorised CPU sqrt is off by an ulp for some inputs; the kernel's is not.
    import numpy as np
    x = torch.cat([torch.rand(1 << 16) * 4 + 1e-3, torch.rand(1 << 12) * 1e-38, torch.tensor([0.0, 1.0, 4.0])])
    assert np.array_equal(fn._sqrt_rn(x).numpy(), np.sqrt(x.numpy()))


# ------------------------------------------------------------------------ host entry point vs reference
CASES = [(1, 2048), (7, 7168), (2, 8192), (3, 8), (130, 48), (0, 64)]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_host_entry_point_matches_reference_bitwise(dtype, tokens, hidden, with_residual):
    a = rows(tokens, hidden, dtype, 5, spread=2.0)
    r = rows(tokens, hidden, dtype, 6) if with_residual else None
    w = weight_for(hidden, dtype, 7)
    ref = fn.reference_add_rmsnorm(a, w, r, 1e-6)
    host = fn.rmsnorm_host(a, w, r, 1e-6)
    assert_bitwise(host.residual, ref.residual, "h")
    assert_bitwise(host.out, ref.out, "y")
    for scale in (2.0**-5, 0.37, 1e-4):  # in range; rounding between codes; saturating at 448
        got = fn.rmsnorm_host(a, w, r, 1e-6, quant="fp8", scale=scale)
        assert_bitwise(got.out, fn.reference_add_rmsnorm(a, w, r, 1e-6, quant="fp8", scale=scale).out, "fp8")
        assert_bitwise(got.out, torch_fp8(ref.out.float() / scale), "fp8 vs torch's cast")
        assert got.residual.equal(ref.residual)
    if hidden % 16 == 0:
        for swizzle in (False, True):
            got = fn.rmsnorm_host(a, w, r, 1e-6, quant="nvfp4", scale=300.0, swizzle=swizzle)
            packed, scales = fp4.quantize(ref.out, 300.0, swizzle)  # the codec, on the CPU: its reference
            assert_bitwise(got.out, packed, f"nvfp4 payload swizzle={swizzle}")
            assert_bitwise(got.scales, scales, f"nvfp4 scales swizzle={swizzle}")
            host_packed, host_scales = fp4.quantize_host(ref.out, 300.0, swizzle)
            assert_bitwise(got.scales, host_scales, "nvfp4 scales vs the codec's host entry point")
            assert_bitwise(got.out, host_packed, "nvfp4 payload vs the codec's host entry point")


def torch_fp8(v: torch.Tensor) -> torch.Tensor:
    """torch's own e4m3 rounding of v, saturated first: torch 2.13 saturates in the cast, but
    older releases (2.11, on the GPU image) give NaN above the top code, so the saturation is
    stated here and the cast checks the rounding alone."""
    return v.clamp(-fn.FP8_MAX, fn.FP8_MAX).to(torch.float8_e4m3fn)


@needs_native
def test_fp8_saturates_and_keeps_subnormals_like_torch():
    a, w = rows(4, 256, torch.bfloat16, 8, spread=4.0), weight_for(256, torch.bfloat16, 8)
    y = fn.reference_add_rmsnorm(a, w).out.float()
    for scale in (1e-6, 1e-3, 2.0**-9, 50.0, 200.0, 5000.0):
        got = fn.rmsnorm_host(a, w, quant="fp8", scale=scale).out
        assert_bitwise(got, torch_fp8(y / scale), f"scale {scale}")
    top = fn.rmsnorm_host(a, w, quant="fp8", scale=1e-6).out.float()
    assert bool((top.abs() == 448).all())  # every y / scale is far above the top of e4m3
    tiny = fn.rmsnorm_host(a, w, quant="fp8", scale=200.0).out.float().abs()
    assert bool(((tiny < 2.0**-6) & (tiny > 0)).any())  # subnormal codes occur and survive


@needs_native
def test_nan_row_encodes_as_positive_nan_and_leaves_other_rows_alone():
    a, w = rows(3, 64, torch.float16, 9), weight_for(64, torch.float16, 9)
    a[1, 5] = float("nan")
    ref = fn.reference_add_rmsnorm(a, w, quant="fp8", scale=0.1)
    host = fn.rmsnorm_host(a, w, quant="fp8", scale=0.1)
    assert_bitwise(host.out, ref.out, "fp8 with a NaN row")
    assert bits(host.out)[1].eq(0x7F).all() and not bits(host.out)[[0, 2]].eq(0x7F).any()


@needs_native
def test_reduction_order_is_the_kernels_not_torchs(monkeypatch):
    """Rows built so that summation order matters: the host entry point must equal the
    reference (the kernel's order) exactly, and the reference with torch's order of the sum of
    squares gives other bits for these rows, so the comparison can tell the orders apart."""
    hidden = 4096
    # Magnitudes over four decades, so that partial sums round differently in another order.
    a = (rows(64, hidden, torch.float32, 14) * torch.logspace(-2, 2, hidden)).to(torch.float16)
    w = torch.ones(hidden, dtype=torch.float16)
    want = fn.reference_add_rmsnorm(a, w).out
    assert_bitwise(fn.rmsnorm_host(a, w).out, want, "y")
    monkeypatch.setattr(fn, "_kernel_order_sumsq", lambda hf: (hf * hf).sum(1))
    torch_order = fn.reference_add_rmsnorm(a, w).out
    assert not torch.equal(torch_order.view(torch.int16), want.view(torch.int16)), "the orders should differ here"


# ------------------------------------------------------------------------ argument rules
def _args(**over):
    x = rows(3, 64, torch.bfloat16, 10)
    base = dict(x=x, weight=weight_for(64, torch.bfloat16, 10), residual=None, eps=1e-6, out=None,
                residual_out=None, quant=None, scale=None, swizzle=False)
    base.update(over)
    return base


def _check(**over):
    a = _args(**over)
    return fn.check_args(CPU, a["x"], a["weight"], a["residual"], a["eps"], a["out"], a["residual_out"], a["quant"],
                         a["scale"], a["swizzle"])


X = rows(3, 64, torch.bfloat16, 10)
SHARED = torch.empty(3 * 64 * 2, dtype=torch.uint8)  # an fp8 out laid over a bf16 x
BAD = [
    (dict(x=X[:, :60].contiguous(), weight=torch.ones(60, dtype=torch.bfloat16)), ArgumentError,
     "hidden (x.shape[1] = 60) must be a positive multiple of 8"),
    (dict(x=X.float()), DtypeError, "x must be bfloat16 or float16"),
    (dict(x=X.reshape(3, 8, 8)), ArgumentError, "x must be 2-D"),
    (dict(x=X.t()), ArgumentError, "x must be contiguous"),
    (dict(x=torch.empty(3, 0, dtype=torch.bfloat16)), ArgumentError, "hidden"),
    (dict(x=torch.empty(1, 32776, dtype=torch.bfloat16)), ArgumentError, "at most 32768"),
    (dict(x=X[:, :56].contiguous(), quant="nvfp4", scale=1.0), ArgumentError, "multiple of 16"),
    (dict(x=X[:, :56].contiguous()), ArgumentError, "weight must have shape (56,)"),
    (dict(weight=torch.ones(63, dtype=torch.bfloat16)), ArgumentError, "weight must have shape (64,)"),
    (dict(weight=torch.ones(64, dtype=torch.float16)), DtypeError, "weight must have x's dtype"),
    (dict(weight=[1.0] * 64), ArgumentError, "weight must be a torch.Tensor"),
    (dict(residual=torch.ones(3, 32, dtype=torch.bfloat16)), ArgumentError, "residual has shape"),
    (dict(residual=torch.ones(3, 64, dtype=torch.float16)), DtypeError, "residual must be torch.bfloat16"),
    (dict(eps=-1.0), ArgumentError, "eps"),
    (dict(eps=float("nan")), ArgumentError, "eps"),
    (dict(eps="1e-6"), ArgumentError, "eps must be a float"),
    (dict(eps=10**400), ArgumentError, "eps must be finite"),  # an int past float's range
    (dict(quant="fp4"), ArgumentError, "quant must be None, 'fp8' or 'nvfp4'"),
    (dict(quant="fp8"), ArgumentError, "quant='fp8' needs scale="),
    (dict(quant="nvfp4"), ArgumentError, "quant='nvfp4' needs scale="),
    (dict(scale=0.5), ArgumentError, "scale was given without quant"),
    (dict(quant="fp8", scale=0.0), ArgumentError, "scale must be finite and > 0"),
    (dict(quant="fp8", scale=torch.ones(1, dtype=torch.float64)), DtypeError, "scale must be a float32 tensor"),
    (dict(quant="fp8", scale=torch.ones(2)), ArgumentError, "scale must have one element"),
    (dict(swizzle=True), ArgumentError, "swizzle=True"),
    (dict(quant="fp8", scale=1.0, swizzle=True), ArgumentError, "swizzle=True"),
    (dict(swizzle=1), ArgumentError, "swizzle must be a bool"),
    (dict(out=torch.empty(3, 64, dtype=torch.float16)), DtypeError, "out must be torch.bfloat16"),
    (dict(out=torch.empty(3, 32, dtype=torch.bfloat16)), ArgumentError, "out has shape"),
    (dict(quant="fp8", scale=1.0, out=torch.empty(3, 64, dtype=torch.bfloat16)), DtypeError,
     "out must be torch.float8_e4m3fn"),
    (dict(quant="nvfp4", scale=1.0, out=torch.empty(3, 32, dtype=torch.uint8)), ArgumentError, "(payload, scales) pair"),
    (dict(quant="nvfp4", scale=1.0, out=(torch.empty(3, 32, dtype=torch.uint8), torch.empty(3, 4, dtype=torch.uint8))),
     DtypeError, "out[1] must be torch.float8_e4m3fn"),
    (dict(quant="nvfp4", scale=1.0, swizzle=True,
          out=(torch.empty(3, 32, dtype=torch.uint8), torch.empty(3, 4, dtype=torch.float8_e4m3fn))),
     ArgumentError, "out[1] has shape (3, 4), expected (128, 4)"),
    (dict(quant="nvfp4", scale=1.0, out=(torch.empty(3, 64, dtype=torch.uint8),
                                          torch.empty(3, 4, dtype=torch.float8_e4m3fn))), ArgumentError, "out[0] has shape"),
    (dict(residual_out=torch.empty(3, 64, dtype=torch.float16)), DtypeError, "residual_out must be torch.bfloat16"),
    (dict(x=X, residual_out=X), ArgumentError, "residual_out overlaps x"),
    (dict(x=X, out=X[1:2]), ArgumentError, "out has shape"),
    (dict(x=SHARED.view(torch.bfloat16).view(3, 64), quant="fp8", scale=1.0,
          out=SHARED[:192].view(torch.float8_e4m3fn).view(3, 64)), ArgumentError, "out overlaps x"),
]


@pytest.mark.parametrize("over,exc,needle", BAD, ids=[n for _, _, n in BAD])
def test_each_argument_rule_raises_naming_the_argument(over, exc, needle):
    with pytest.raises(exc) as info:
        _check(**over)
    assert needle in str(info.value)


def test_memory_rules():
    res = rows(3, 64, torch.bfloat16, 11)
    call = _check(residual=res, residual_out=res)  # in place: allowed
    assert call.residual_out is res
    big = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="residual_out overlaps residual: .*not a part of it"):
        _check(residual=big[:3], residual_out=big[1:])
    with pytest.raises(ArgumentError, match="out overlaps residual_out"):
        _check(out=big[:3], residual_out=big[1:])
    with pytest.raises(ArgumentError, match="out overlaps weight"):
        w = torch.empty(3 * 64 + 64, dtype=torch.bfloat16)
        _check(weight=w[:64], out=w[:192].view(3, 64))
    flat = torch.empty(3 * 64 + 8, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="residual must start on a 16-byte boundary"):
        _check(residual=flat[1:193].view(3, 64))
    with pytest.raises(ArgumentError, match="weight must start on a 16-byte boundary"):
        _check(weight=flat[1:65])
    q = torch.empty(3 * 64 + 4, dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="out must start on a 8-byte boundary"):
        _check(quant="fp8", scale=1.0, out=q[4:196].view(torch.float8_e4m3fn).view(3, 64))


def test_fp8_scale_accepts_a_float32_tensor_and_rounds_a_float():
    call = _check(quant="fp8", scale=torch.tensor([0.1]))
    assert isinstance(call.scale, torch.Tensor)
    assert _check(quant="fp8", scale=0.1).scale == torch.tensor(0.1).item()  # fp32-rounded


@needs_native
def test_rows_split_over_blocks_only_where_h_aliases_nothing_the_kernel_reads():
    """csrc/rmsnorm.cuh's row_parts, through the testing hook, with addresses only compared: a
    decode row gets up to four blocks, but one wherever h overlaps a or the residual (the blocks
    of a row are not ordered, so one block's h could overwrite a vector another has yet to read).
    A GPU cannot show that race on demand; this rule is what prevents it."""
    parts = _native.load().lib.symcomm_norm_row_parts
    hidden, sms = 7168, 132
    size = 64 * hidden * 2
    a, res, h = 1 << 20, 1 << 30, 1 << 40  # far apart: no overlap
    assert parts(1, hidden, sms, a, res, h) == 4
    assert parts(1, hidden, sms, a, None, h) == 4
    assert parts(1, hidden, sms, a, res, None) == 4
    assert parts(1, hidden, sms, a, res, res) == 1  # in place
    assert parts(1, hidden, sms, h, res, h) == 1  # the all-reduce written into h
    assert parts(64, hidden, sms, a, res, res + size - 16) == 1  # any overlap, not only equality
    assert parts(64, hidden, sms, a, res, res + size) == 2  # adjacent is no overlap
    assert parts(33, hidden, sms, a, res, h) == 4  # 132 slots: 33 rows x 4
    assert parts(34, hidden, sms, a, res, h) == 2
    assert parts(67, hidden, sms, a, res, h) == 1
    assert parts(1, 2048, sms, a, res, h) == 1  # one 256 x 8 stretch a row: nothing to split
    assert parts(1, 4096, sms, a, res, h) == 2
    assert parts(1, 5120, sms, a, res, h) == 2  # three stretches: a fourth block would only sum


@needs_native
def test_native_enum_matches_python():
    from test_native_header import HEADER, parse_header
    enum = parse_header(HEADER.read_text()).enums["symcomm_norm_quant_t"]
    assert {k: v for k, v in enum.items() if not k.endswith("MAX_ENUM")} == {
        "SYMCOMM_NORM_NONE": _native.NORM_QUANT_CODES[None], "SYMCOMM_NORM_FP8": _native.NORM_QUANT_CODES["fp8"],
        "SYMCOMM_NORM_NVFP4": _native.NORM_QUANT_CODES["nvfp4"]}


def test_local_op_on_cpu_runs_the_reference_and_refuses_the_kernel():
    a, w, r = rows(2, 64, torch.float16, 12), weight_for(64, torch.float16, 12), rows(2, 64, torch.float16, 13)
    got = fn.add_rmsnorm(a, w, residual=r)
    want = fn.reference_add_rmsnorm(a, w, r)
    assert_bitwise(got.out, want.out, "y")
    assert_bitwise(got.residual, want.residual, "h")
    with pytest.raises(ArgumentError, match="impl='kernel': the standalone kernel runs on CUDA tensors"):
        fn.add_rmsnorm(a, w, impl="kernel")


# ------------------------------------------------------------------------ the op over gloo
def _expected(parts, r, w, eps, **q):
    """Single-process: with two ranks the all-reduce is the exact sum rounded once (any order)."""
    a = (parts[0].double() + parts[1].double()).to(parts[0].dtype)
    return a, fn.reference_add_rmsnorm(a, w, r, eps, **q)


def _gloo_world(rank, world):
    comm = symcomm.Communicator()
    eps = 1e-5
    for dtype in DTYPES:
        for tokens, hidden in ((1, 2048), (7, 7168), (0, 64), (2, 8192)):
            seed = tokens * 31 + hidden
            parts = [rows(tokens, hidden, dtype, seed + p) for p in range(world)]
            r, w = rows(tokens, hidden, dtype, seed + 100), weight_for(hidden, dtype, seed)
            a, want = _expected(parts, r, w, eps)
            got = comm.all_reduce_rmsnorm(parts[rank], w, residual=r, eps=eps)
            assert isinstance(got, symcomm.NormedResult) and got.scales is None
            assert_bitwise(got.residual, want.residual, "h")
            assert_bitwise(got.out, want.out, "y")
            if tokens:
                y64 = float64_norm(want.residual, w, eps)
                assert bool(((got.out.double() - y64).abs() <= torch.finfo(dtype).eps * y64.abs()).all())
            # no residual: h is the all-reduce itself
            bare = comm.all_reduce_rmsnorm(parts[rank], w, eps=eps)
            assert_bitwise(bare.residual, a, "h without residual")
            assert_bitwise(bare.out, fn.reference_add_rmsnorm(a, w, None, eps).out, "y without residual")
            # in place on the residual, into given outputs, forced onto the torch all-reduce
            res, y = r.clone(), torch.empty_like(r)
            done = comm.all_reduce_rmsnorm(parts[rank], w, residual=res, residual_out=res, out=y, eps=eps,
                                           algo="torch")
            assert done.residual is res and done.out is y
            assert_bitwise(res, want.residual, "in-place h")
            assert_bitwise(y, want.out, "y into out")
            for quant, scale, swizzle in (("fp8", 2.0**-4, False), ("nvfp4", 400.0, False), ("nvfp4", 400.0, True)):
                got = comm.all_reduce_rmsnorm(parts[rank], w, residual=r, eps=eps, quant=quant, scale=scale,
                                              swizzle=swizzle)
                _, want_q = _expected(parts, r, w, eps, quant=quant, scale=scale, swizzle=swizzle)
                assert_bitwise(got.out, want_q.out, f"{quant} out")
                assert_bitwise(got.residual, want.residual, f"{quant} h")
                if quant == "nvfp4":
                    assert_bitwise(got.scales, want_q.scales, "nvfp4 scales")
    x, w = rows(3, 64, torch.bfloat16, 1 + rank), weight_for(64, torch.bfloat16, 1)
    choice = comm.select("all_reduce_rmsnorm", x, weight=w)
    assert choice.algo == "reference" and "CUDA" in choice.rejected["unfused"]
    assert choice.all_reduce is not None and choice.all_reduce.algo == "torch"
    # a named path was asked for: the others were not ranked, and select says so
    forced = comm.select("all_reduce_rmsnorm", x, weight=w, algo="reference")
    assert forced.algo == "reference" and forced.rejected == {"unfused": "not requested (algo='reference')"}
    with pytest.raises(ArgumentError, match="algo='unfused' cannot serve this all_reduce_rmsnorm: .*CUDA"):
        comm.all_reduce_rmsnorm(x, w, algo="unfused")
    with pytest.raises(ArgumentError, match="algo='nccl' is unavailable"):
        comm.all_reduce_rmsnorm(x, w, algo="nccl")
    with pytest.raises(ArgumentError, match="algo must be 'auto', a norm path"):
        comm.all_reduce_rmsnorm(x, w, algo="fastest")
    # Every rank makes the same bad call and raises before communicating; the next good call
    # then pairs up with its peer as usual.
    with pytest.raises(ArgumentError, match="weight must have shape"):
        comm.all_reduce_rmsnorm(x, w[:32])
    after = comm.all_reduce_rmsnorm(x, w)
    a = rows(3, 64, torch.bfloat16, 1).double() + rows(3, 64, torch.bfloat16, 2).double()
    assert_bitwise(after.residual, a.to(torch.bfloat16), "the call after a refused one")
    comm.close()
    with pytest.raises(symcomm.CommClosedError):
        comm.all_reduce_rmsnorm(x, w)


def test_op_over_gloo_matches_single_process_computation():
    run_world(_gloo_world, 2)


# ----------------------------------------------------------------------- choosing a norm path
def _router_with(rules: dict) -> Router:
    """A Router holding all_reduce's three kernels (stand-ins that serve any call) and
    all_reduce_rmsnorm's real paths."""
    router = Router(DispatchTable(rules, "test"), {op.name: op for op in (ALL_REDUCE, ALL_REDUCE_RMSNORM)}, 0)
    for name in (FLAGFREE, ONESHOT, TWOSHOT):
        router.add(SimpleNamespace(name=name, ops=frozenset({"all_reduce"}), why_not=lambda call: None), None)
    setup = SimpleNamespace(dispatcher=router, device=CPU)
    for path in (unfused_norm(), reference_norm()):
        assert path.open(setup) is None
        router.add(path, None)
    return router


def _norm_call(tokens: int, hidden: int = 64):
    x = rows(tokens, hidden, torch.bfloat16, 3)
    return fn.check_args(CPU, x, weight_for(hidden, torch.bfloat16, 3), None, 1e-6, None, None, None, None, False)


def _choose(router, call, algo):
    path, choice = router.choose(ALL_REDUCE_RMSNORM, call, algo, explain=True)
    return path, call.inner_algo, choice.rejected


def test_the_kernel_serves_where_it_runs_and_the_reference_elsewhere(monkeypatch):
    # a table row for the op does not reorder its paths
    router = _router_with({"all_reduce": [(INF, (TWOSHOT, ONESHOT))], NORM_KEY: [(INF, ("reference", "unfused"))]})
    path, ar_algo, rejected = _choose(router, _norm_call(4), "auto")
    assert (path.name, ar_algo) == ("reference", "auto") and "CUDA" in rejected["unfused"]
    monkeypatch.setattr(fn, "kernel_available", lambda device: None)
    path, ar_algo, rejected = _choose(router, _norm_call(4), "auto")
    assert (path.name, ar_algo) == ("unfused", "auto")
    assert rejected == {"reference": "ranked below unfused in all_reduce_rmsnorm's order"}
    # naming an all-reduce path runs that all-reduce, then the same norm
    path, ar_algo, _ = _choose(router, _norm_call(4), ONESHOT)
    assert (path.name, ar_algo) == ("unfused", ONESHOT)


def test_the_all_reduce_lands_in_a_buffer_of_its_own_whatever_the_rank_passes():
    """Whether a rank passes residual_out, and whether in place (residual_out=residual), is its
    own business: it must not change which memory the inner all-reduce writes (pool or ordinary
    memory picks its path), so every rank reduces into a new buffer, never into the caller's
    residual_out; with neither a residual nor residual_out, that buffer is h. Each call's
    results match the reference (one rank: the all-reduce of x is x)."""
    seen = []

    def run(call):
        seen.append(call.outputs[0])
        call.outputs[0].copy_(call.inputs[0])

    router = Router(DispatchTable({"all_reduce": [(INF, (ONESHOT,))]}, "test"),
                    {op.name: op for op in (ALL_REDUCE, ALL_REDUCE_RMSNORM)}, 0)
    router.add(SimpleNamespace(name=ONESHOT, ops=frozenset({"all_reduce"}), why_not=lambda call: None, run=run), None)
    path = reference_norm()
    assert path.open(SimpleNamespace(dispatcher=router, device=CPU)) is None
    router.add(path, None)
    x, w = rows(3, 64, torch.bfloat16, 5), weight_for(64, torch.bfloat16, 5)
    for residual_given, in_place, given_out in ((True, True, False), (True, False, True), (True, False, False),
                                                (False, False, True), (False, False, False)):
        residual = rows(3, 64, torch.bfloat16, 6) if residual_given else None
        want = fn.reference_add_rmsnorm(x, w, residual)
        residual_out = residual if in_place else torch.empty_like(x) if given_out else None
        call = ALL_REDUCE_RMSNORM.build(SimpleNamespace(device=CPU), x, w, residual=residual,
                                        residual_out=residual_out)
        chosen, _ = router.choose(ALL_REDUCE_RMSNORM, call, "auto")
        seen.clear()
        chosen.run(call)
        what = f"residual {residual_given}, in place {in_place}, residual_out given {given_out}"
        assert len(seen) == 1, what
        if residual_given or given_out:  # never the caller's residual_out, nor the residual, nor x
            start, end = seen[0].data_ptr(), seen[0].data_ptr() + seen[0].nbytes
            others = [t for t in (x, call.h, residual) if t is not None]
            assert all(t.data_ptr() + t.nbytes <= start or end <= t.data_ptr() for t in others), what
        else:  # no residual and no residual_out: h is the all-reduce's own buffer
            assert seen[0] is call.h, what
        got = ALL_REDUCE_RMSNORM.result(call)
        assert_bitwise(got.residual, want.residual, what)
        assert_bitwise(got.out, want.out, what)
        if residual_out is not None:
            assert got.residual is residual_out, what
