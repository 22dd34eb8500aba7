"""NVFP4 codec on the CPU: the reference against hand-computed vectors, csrc/fp4.cu's math (run
on the host) bit for bit against the reference, and all_gatherv_fp4 over gloo."""
from __future__ import annotations

import math

import pytest
import torch

import symcomm
from _spawn import run_world
from symcomm import fp4

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
needs_native = pytest.mark.needs_native


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def _one_block(values, global_scale=1.0, dtype=torch.float32):
    x = torch.tensor([values], dtype=dtype)
    packed, scales = fp4.quantize_reference(x, global_scale)
    codes = []
    for byte in _bytes(packed):
        codes += [byte & 0xF, byte >> 4]
    return codes, _bytes(scales)[0]


def _next_f32(v: float, toward: float) -> float:
    """The fp32 neighbour of v (math.nextafter would step in fp64, lost in the cast)."""
    return torch.nextafter(torch.tensor(v), torch.tensor(toward)).item()


# ------------------------------------------------------------------------ hand-computed vectors
def test_every_code_with_scale_one():
    # amax 6 and global scale 1: s = 6 / 6 = 1, e4m3 0x38, so each value is its own code.
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    values = grid + [-v for v in grid]
    for dtype in FLOATS:
        codes, scale = _one_block(values, dtype=dtype)
        assert scale == 0x38
        assert codes == list(range(8)) + [0] + list(range(9, 16)), dtype  # -0.0 is code 0
    packed, _ = fp4.quantize_reference(torch.tensor([values]), 1.0)
    assert _bytes(packed) == [0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE]  # even element low


def test_ties_round_to_the_even_code():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    codes, scale = _one_block([6.0] + ties + [-t for t in ties] + [-6.0])
    assert scale == 0x38
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 15]


def test_one_ulp_either_side_of_each_tie():
    for tie, below, above in ((0.25, 0, 1), (0.75, 1, 2), (1.25, 2, 3), (1.75, 3, 4), (2.5, 4, 5),
                              (3.5, 5, 6), (5.0, 6, 7)):
        lo, hi = _next_f32(tie, 0.0), _next_f32(tie, 7.0)
        codes, _ = _one_block([6.0, lo, hi, -lo, -hi] + [0.0] * 11)
        assert codes[1:5] == [below, above, below | (8 if below else 0), above | 8], tie


def test_saturation_and_tiny_negatives():
    # s = 6.375 / 6 = 1.0625 is a tie between e4m3 1.0 and 1.125: even mantissa, 1.0. The
    # amax element then sits at q = 6.375 and saturates to 6; -0.1 rounds to +0.
    codes, scale = _one_block([6.375, -6.375, 6.2, -0.1, -0.0] + [0.0] * 11)
    assert scale == 0x38
    assert codes[:5] == [7, 15, 7, 0, 0]
    # s = 1.1875 ties between 1.125 and 1.25: 1.25 (mantissa 010) wins.
    assert _one_block([6 * 1.1875] + [0.0] * 15)[1] == 0x3A


def test_e4m3_scale_saturates_at_448():
    # s = 6000 / 6 = 1000 > 448: clamped, not NaN. Then q = x / 448.
    codes, scale = _one_block([6000.0, -2688.0, 2240.0, 448.0] + [0.0] * 12)
    assert scale == 0x7E
    assert codes[:4] == [7, 15, 6, 2]  # 13.4 -> 6, -6, 5 -> 4 (tie), 1 -> 1
    values = fp4.dequantize_reference(*fp4.quantize_reference(torch.tensor([[6000.0] + [0.0] * 15]), 1.0),
                                      1.0, torch.float32)
    assert values[0, 0].item() == 6 * 448


def test_subnormal_and_zero_scales():
    # e4m3 subnormals step by 2^-9: s = 2^-9 is code 1; s = 2^-10 ties between 0 and 2^-9 and
    # rounds to 0, and a block whose scale is 0 encodes as zeros, not as 0/0.
    assert _one_block([6 * 2.0**-9] + [0.0] * 15) == ([7] + [0] * 15, 0x01)
    assert _one_block([6 * 1.5 * 2.0**-10] + [0.0] * 15)[1] == 0x01
    assert _one_block([6 * 2.0**-10, -3 * 2.0**-10] + [0.0] * 14) == ([0] * 16, 0x00)


def test_all_zero_and_negative_zero_blocks():
    assert _one_block([0.0] * 16) == ([0] * 16, 0)
    assert _one_block([-0.0] * 16) == ([0] * 16, 0)
    out = fp4.dequantize_reference(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 1).to(torch.float8_e4m3fn), 1.0)
    assert _bytes(out) == [0] * 32


def test_code_8_decodes_to_negative_zero():
    packed = torch.tensor([[0x88, 0x21] + [0] * 6], dtype=torch.uint8)
    scales = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = fp4.dequantize_reference(packed, scales, 4.0, torch.float32)[0]
    assert math.copysign(1.0, out[0].item()) == -1.0 and out[0].item() == 0.0
    assert out[2:4].tolist() == [0.5 * 2 / 4, 1.0 * 2 / 4]  # value * scale / global_scale


def test_non_finite_input():
    codes, scale = _one_block([float("nan"), 1.0] + [0.0] * 14)
    assert (codes, scale) == ([0] * 16, 0x7F)
    codes, scale = _one_block([float("inf"), -float("inf"), 448.0] + [0.0] * 13)
    assert (codes[:3], scale) == ([7, 15, 2], 0x7E)


def test_global_scale_scales_the_block_scale():
    # s = gs * amax / 6 = 0.5 * 12 / 6 = 1; q = x * gs / 1.
    codes, scale = _one_block([12.0, 1.0, -3.0] + [0.0] * 13, global_scale=0.5)
    assert scale == 0x38 and codes[:3] == [7, 1, 11]
    x = torch.randn(4, 32)
    as_tensor = fp4.quantize_reference(x, torch.tensor([0.75]))
    as_float = fp4.quantize_reference(x, 0.75)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(as_tensor, as_float))


# ------------------------------------------------------------------------ round trip and layouts
def _random(shape, dtype, seed, spread=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if spread:  # magnitudes from 10^-spread to 10^spread, per row
        x *= torch.logspace(-spread, spread, shape[0]).unsqueeze(1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_round_trip_error_is_within_half_a_grid_step(dtype):
    x = _random((64, 256), dtype, 1, spread=2.0)
    gs = fp4.global_scale_for(x)
    packed, scales = fp4.quantize_reference(x, gs)
    y = fp4.dequantize_reference(packed, scales, gs, torch.float32)
    xf = x.float()
    sf = scales.float().repeat_interleave(16, dim=1)
    assert bool((sf > 0).all()), "test data should keep every scale normal"
    q = (xf.double() * gs.double() / sf.double()).abs()
    # RNE on the e2m1 grid: at most half the local gap (0.5 / 1 / 2), or the overshoot past 6.
    half_gap = torch.where(q < 2, 0.25, torch.where(q < 4, 0.5, 1.0))
    bound = torch.where(q <= 6, half_gap, q - 6) * sf.double() / gs.double()
    err = (y.double() - xf.double()).abs()
    bound += xf.double().abs() * 2.0**-21  # fp32 rounding of scale / global_scale and of the product
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    rel = (err.pow(2).sum() / xf.double().pow(2).sum()).sqrt().item()
    assert 0.02 < rel < 0.15, rel  # NVFP4 on Gaussian data: about 9% RMS error
    # dequantize in the input dtype is the fp32 result rounded once more
    assert torch.equal(fp4.dequantize_reference(packed, scales, gs, dtype), y.to(dtype))


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (5, 3), (127, 4), (128, 4), (129, 9), (300, 448)])
def test_swizzle_round_trip_and_padding(rows, cols):
    s = torch.randint(1, 127, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
    sw = fp4.swizzle_scales(s)
    prows, pcols = fp4.swizzled_shape(rows, cols)
    assert sw.shape == (prows, pcols) and prows % 128 == 0 and pcols % 4 == 0
    assert torch.equal(fp4.unswizzle_scales(sw, rows, cols).view(torch.uint8), s.view(torch.uint8))
    assert sum(1 for b in _bytes(sw) if b == 0) == prows * pcols - rows * cols  # padding is zeros


def test_swizzle_places_scales_by_hand():
    rows, cols = 130, 5
    s = torch.arange(rows * cols, dtype=torch.int64).remainder(251).add(1).to(torch.uint8).reshape(rows, cols)
    flat = fp4.swizzle_scales(s.view(torch.float8_e4m3fn)).view(torch.uint8).flatten()
    # tile (0, 0): (r % 32) * 16 + (r // 32) * 4 + c
    assert flat[1 * 16 + 1 * 4 + 2].item() == s[33, 2].item()
    # row 129, col 4: tile (1, 1) of 2 column tiles = tile 3
    assert flat[3 * 512 + 1 * 16 + 0].item() == s[129, 4].item()
    assert flat[3].item() == s[0, 3].item() and flat[4].item() == s[32, 0].item()


def test_quantize_swizzle_matches_swizzled_linear():
    """On the CPU quantize(swizzle=True) is the reference's swizzle_scales of the linear scales
    (so comparing those two would compare the function with itself): the packed bytes must not
    change, and the swizzled scales must decode to the linear ones' values. The native swizzle
    is held to the reference in test_native_host_code_matches_reference_on_random_data."""
    x = _random((200, 96), torch.bfloat16, 3)
    packed, linear = fp4.quantize(x, 3.0)
    packed_sw, sw = fp4.quantize(x, 3.0, swizzle=True)
    assert torch.equal(packed, packed_sw)
    back = fp4.dequantize(packed_sw, sw, 3.0, torch.float32, swizzled=True)
    assert torch.equal(back, fp4.dequantize(packed, linear, 3.0, torch.float32))


def test_quantize_into_out_and_global_scale_for():
    x = _random((9, 64), torch.float16, 4)
    packed, scales = torch.full((9, 32), 0xAB, dtype=torch.uint8), torch.empty(9, 4, dtype=torch.float8_e4m3fn)
    got = fp4.quantize(x, 2.0, out=(packed, scales))
    assert got[0] is packed and got[1] is scales
    ref = fp4.quantize_reference(x, 2.0)
    assert torch.equal(packed, ref[0]) and torch.equal(scales.view(torch.uint8), ref[1].view(torch.uint8))
    gs = fp4.global_scale_for(x)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert gs.item() == pytest.approx(448 * 6 / x.float().abs().max().item(), rel=1e-6)
    _, scales = fp4.quantize(x, gs)
    assert scales.float().max().item() == 448.0  # the largest block lands on e4m3's top
    assert fp4.global_scale_for(torch.zeros(3, 16)).item() == 1.0
    assert fp4.global_scale_for(torch.zeros(0, 16)).item() == 1.0


# ------------------------------------------------------------------------ bad input
BAD = [
    (lambda: fp4.quantize(torch.ones(2, 24), 1.0), symcomm.ArgumentError, "multiple of 16"),
    (lambda: fp4.quantize(torch.ones(2, 0), 1.0), symcomm.ArgumentError, "multiple of 16"),
    (lambda: fp4.quantize(torch.ones(32), 1.0), symcomm.ArgumentError, "2-D"),
    (lambda: fp4.quantize(torch.ones(2, 16, dtype=torch.float64), 1.0), symcomm.DtypeError, "x must be bfloat16"),
    (lambda: fp4.quantize(torch.ones(2, 16, dtype=torch.int32), 1.0), symcomm.DtypeError, "x must be"),
    (lambda: fp4.quantize(torch.ones(32, 16).t(), 1.0), symcomm.ArgumentError, "contiguous"),
    (lambda: fp4.quantize([[1.0] * 16], 1.0), symcomm.ArgumentError, "x must be a torch.Tensor"),
    (lambda: fp4.quantize(torch.ones(2, 16), float("nan")), symcomm.ArgumentError, "global_scale must be finite"),
    (lambda: fp4.quantize(torch.ones(2, 16), float("inf")), symcomm.ArgumentError, "global_scale must be finite"),
    (lambda: fp4.quantize(torch.ones(2, 16), 1e39), symcomm.ArgumentError, "global_scale must be finite"),
    (lambda: fp4.quantize(torch.ones(2, 16), 0.0), symcomm.ArgumentError, "> 0"),
    (lambda: fp4.quantize(torch.ones(2, 16), -2), symcomm.ArgumentError, "> 0"),
    (lambda: fp4.quantize(torch.ones(2, 16), 1e-50), symcomm.ArgumentError, "> 0"),
    (lambda: fp4.quantize(torch.ones(2, 16), True), symcomm.ArgumentError, "global_scale must be a float"),
    (lambda: fp4.quantize(torch.ones(2, 16), "1"), symcomm.ArgumentError, "global_scale must be a float"),
    (lambda: fp4.quantize(torch.ones(2, 16), torch.tensor([1.0], dtype=torch.float64)), symcomm.DtypeError,
     "global_scale must be a float32"),
    (lambda: fp4.quantize(torch.ones(2, 16), torch.ones(2)), symcomm.ArgumentError, "one element"),
    (lambda: fp4.quantize(torch.ones(2, 16), torch.tensor([0.0])), symcomm.ArgumentError, "global_scale must be finite"),
    (lambda: fp4.quantize(torch.ones(2, 16, device="meta"), torch.ones(1)), symcomm.ArgumentError,
     "global_scale is on cpu"),
    (lambda: fp4.quantize(torch.ones(2, 16), 1.0, out=(torch.empty(2, 8, dtype=torch.uint8),)), symcomm.ArgumentError,
     "pair"),
    (lambda: fp4.quantize(torch.ones(2, 16), 1.0, out=(torch.empty(2, 7, dtype=torch.uint8),
                                                       torch.empty(2, 1, dtype=torch.float8_e4m3fn))),
     symcomm.ArgumentError, "out[0] has shape"),
    (lambda: fp4.quantize(torch.ones(2, 16), 1.0, out=(torch.empty(2, 8, dtype=torch.uint8),
                                                       torch.empty(2, 1, dtype=torch.uint8))),
     symcomm.DtypeError, "out[1] must be torch.float8_e4m3fn"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0),
     symcomm.DtypeError, "packed must be uint8"),
    (lambda: fp4.dequantize(torch.zeros(2, 12, dtype=torch.uint8), torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0),
     symcomm.ArgumentError, "multiple of 16"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2).to(torch.float8_e4m3fn), 1.0),
     symcomm.ArgumentError, "scales has shape"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0,
                            swizzled=True), symcomm.ArgumentError, "expected (128, 4)"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), 1.0), symcomm.DtypeError,
     "scales must be torch.float8_e4m3fn"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0,
                            torch.int8), symcomm.DtypeError, "dtype must be"),
    (lambda: fp4.unswizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), 129, 4), symcomm.ArgumentError,
     "expected (256, 4)"),
    (lambda: fp4.global_scale_for(torch.ones(3, dtype=torch.int64)), symcomm.DtypeError, "bfloat16"),
    # A string is truthy: "False" would have swizzled.
    (lambda: fp4.quantize(torch.ones(2, 16), 1.0, swizzle="False"), symcomm.ArgumentError, "swizzle must be a bool"),
    (lambda: fp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0,
                            swizzled="no"), symcomm.ArgumentError, "swizzled must be a bool"),
    # Outputs that share memory: the second write would spoil the first.
    (lambda: fp4.quantize(torch.ones(4, 32), 1.0, out=_overlapping_pair()), symcomm.ArgumentError,
     "out[0] overlaps out[1]"),
    (lambda: _decode_over_its_input(), symcomm.ArgumentError, "out overlaps packed"),
]


def _overlapping_pair() -> tuple[torch.Tensor, torch.Tensor]:
    memory = torch.zeros(64, dtype=torch.uint8)
    return memory[:64].view(4, 16), memory[8:16].view(torch.float8_e4m3fn).view(4, 2)


def _decode_over_its_input() -> torch.Tensor:
    out = torch.zeros(2, 16)
    packed = out.view(torch.uint8).view(-1)[:16].view(2, 8)  # the first bytes of out
    return fp4.dequantize(packed, torch.zeros(2, 1).to(torch.float8_e4m3fn), 1.0, torch.float32, out=out)


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_raises_naming_the_argument(case):
    call, exc_type, fragment = BAD[case]
    with pytest.raises(exc_type) as info:
        call()
    assert fragment in str(info.value), info.value
    assert isinstance(info.value, symcomm.SymcommError)


# ------------------------------------------------------------------------ csrc/fp4.cu on the host
def _special_rows(dtype) -> torch.Tensor:
    """Rows that sit on every rounding edge: e2m1 ties and their neighbours, e4m3 ties, zero
    and subnormal scales, -0, saturation, NaN and infinities."""
    rows = []
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = [v for t in ties for v in (t, _next_f32(t, 0.0), _next_f32(t, 9.0))]
    for chunk in range(0, len(near), 15):
        part = near[chunk:chunk + 15]
        rows.append([6.0] + part + [-v for v in part][: 15 - len(part)] + [0.0] * (15 - 2 * len(part)))
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    mids = [(a + b) / 2 for a, b in zip(e4m3, e4m3[1:])]
    for s in e4m3 + mids + [m * (1 + 2**-20) for m in mids] + [m * (1 - 2**-20) for m in mids]:
        rows.append([6.0 * s, -2.5 * s, 0.3 * s, -0.0] + [s * (i - 6) / 2 for i in range(12)])
    rows.append([-0.0] * 16)
    rows.append([float("nan")] + [1.0] * 15)
    rows.append([float("inf"), -float("inf")] + [3.0] * 14)
    rows.append([1e30, -1e-30] + [0.0] * 14)
    rows.append([1e-38, -5e-39] + [0.0] * 14)  # with a global scale of 1e37, global_scale / scale overflows
    x = torch.tensor(rows, dtype=torch.float32)
    return x.to(dtype)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
    assert diff == 0, f"{what}: {diff} bytes differ"


def _assert_same_values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise, except that any NaN matches any NaN (CUDA's and torch's NaN bits differ)."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), what
    _assert_same(torch.where(nan, 0, a), torch.where(nan, 0, b), what)


@needs_native
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("swizzle", (False, True))
def test_native_host_code_matches_reference_on_random_data(dtype, swizzle):
    shapes = [(0, 16), (1, 16), (3, 32), (7, 48), (130, 512), (33, 7168)]
    for i, shape in enumerate(shapes):
        x = _random(shape, dtype, 10 + i, spread=4.0 if dtype == torch.float32 else 2.0)
        for gs in (float(fp4.global_scale_for(x).item()), 1.0, 3.0e4):
            ref = fp4.quantize_reference(x, gs, swizzle)
            got = fp4.quantize_host(x, gs, swizzle)
            what = f"{shape} {dtype} gs={gs} swizzle={swizzle}"
            _assert_same(got[0], ref[0], "packed " + what)
            _assert_same(got[1], ref[1], "scales " + what)
            for out_dtype in FLOATS:
                _assert_same_values(fp4.dequantize_host(*ref, gs, out_dtype, swizzled=swizzle),
                                    fp4.dequantize_reference(*ref, gs, out_dtype, swizzled=swizzle),
                                    f"dequantize to {out_dtype} " + what)


@needs_native
@pytest.mark.parametrize("dtype", FLOATS)
def test_native_host_code_matches_reference_on_rounding_edges(dtype):
    x = _special_rows(dtype)
    for gs in (1.0, 0.7, 2.0**-12, 2.0**100, 1e37):
        ref = fp4.quantize_reference(x, gs)
        got = fp4.quantize_host(x, gs)
        _assert_same(got[0], ref[0], f"packed gs={gs}")
        _assert_same(got[1], ref[1], f"scales gs={gs}")
        _assert_same_values(fp4.dequantize_host(*ref, gs, dtype), fp4.dequantize_reference(*ref, gs, dtype),
                            f"dequantize gs={gs}")
    # Every e4m3 byte, both signs, NaN included, through the decoder.
    scales = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).reshape(256, 1)
    packed = torch.arange(256 * 8, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(256, 8)
    for out_dtype in FLOATS:
        _assert_same_values(fp4.dequantize_host(packed, scales, 0.37, out_dtype),
                            fp4.dequantize_reference(packed, scales, 0.37, out_dtype), f"decoder {out_dtype}")


# ------------------------------------------------------------------------ all_gatherv_fp4 on gloo
H = 64


def _rank_x(rank, rows, dtype, seed):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(rows, H, generator=gen) * (rank + 1)).to(dtype)


def _rank_extra(rank, rows, seed):
    gen = torch.Generator().manual_seed(77 * seed + rank)
    return [torch.randint(0, 256, (rows, 4), generator=gen, dtype=torch.int32),
            torch.rand(rows, 4, generator=gen)]


def _gather_cases(rank, world):
    comm = symcomm.Communicator()
    patterns = ([3, 0, 5][:world], [0] * (world - 1) + [4], [0] * world, [2] * world, [1, 7, 2][:world])
    for seed, sizes in enumerate(patterns):
        for dtype in (torch.bfloat16, torch.float32):
            xs = [_rank_x(r, sizes[r], dtype, seed) for r in range(world)]
            gs = fp4.global_scale_for(xs[rank], comm)  # the max over ranks: same everywhere
            expect_gs = fp4.global_scale_for(torch.cat(xs))
            assert torch.equal(gs, expect_gs), (gs, expect_gs)
            extras = [_rank_extra(r, sizes[r], seed) for r in range(world)]
            got = comm.all_gatherv_fp4(xs[rank], sizes, gs, extra=extras[rank], dequantize=True)
            ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs).reshape(-1, H), gs)
            what = f"sizes={sizes} {dtype}"
            assert torch.equal(got.packed, ref_packed), what
            assert torch.equal(got.scales.view(torch.uint8), ref_scales.view(torch.uint8)), what
            assert got.packed.shape == (sum(sizes), H // 2) and got.scales.shape == (sum(sizes), H // 16)
            for i in range(2):
                assert torch.equal(got.extra[i], torch.cat([e[i] for e in extras])), f"extra[{i}] {what}"
            assert got.values.dtype == dtype
            assert torch.equal(got.values, fp4.dequantize_reference(ref_packed, ref_scales, gs, dtype)), what
            if sum(sizes):
                assert got.packed.any() and got.scales.float().max() > 0, "non-trivial data"
    # Swizzled scales, a float global scale, no extras, preallocated outputs.
    sizes = [5, 0, 130][:world]
    xs = [_rank_x(r, sizes[r], torch.float16, 9) for r in range(world)]
    out = symcomm.Fp4Gathered(torch.empty(sum(sizes), H // 2, dtype=torch.uint8),
                              torch.empty(sum(sizes), H // 16, dtype=torch.float8_e4m3fn), (),
                              torch.empty(sum(sizes), H, dtype=torch.float16), None)
    got = comm.all_gatherv_fp4(xs[rank], sizes, 40.0, dequantize=True, swizzle=True, out=out)
    ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), 40.0)
    assert got.packed is out.packed and got.values is out.values and got.extra == ()
    assert torch.equal(got.packed, ref_packed)
    assert torch.equal(got.scales.view(torch.uint8), fp4.swizzle_scales(ref_scales).view(torch.uint8))
    assert torch.equal(got.values, fp4.dequantize_reference(ref_packed, ref_scales, 40.0, torch.float16))
    assert comm.all_reduce(torch.ones(2)).tolist() == [world, world]
    comm.close()


@pytest.mark.parametrize("world", (2, 3))
def test_all_gatherv_fp4_over_gloo_matches_reference(world):
    run_world(_gather_cases, world, timeout_s=120)


def _gather_errors(rank, world):
    comm = symcomm.Communicator()
    x = torch.ones(2, H)
    bad = [
        (lambda: comm.all_gatherv_fp4(x, [3, 3], 1.0), symcomm.ArgumentError, "x has 2 rows"),
        (lambda: comm.all_gatherv_fp4(x, [2], 1.0), symcomm.ArgumentError, "one entry per rank"),
        (lambda: comm.all_gatherv_fp4(torch.ones(2, 24), [2, 2], 1.0), symcomm.ArgumentError, "multiple of 16"),
        (lambda: comm.all_gatherv_fp4(x.double(), [2, 2], 1.0), symcomm.DtypeError, "x must be"),
        (lambda: comm.all_gatherv_fp4(torch.ones(2, H, device="meta"), [2, 2], 1.0), symcomm.ArgumentError,
         "x is on meta"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 0.0), symcomm.ArgumentError, "global_scale"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, extra=torch.ones(2)), symcomm.ArgumentError, "extra must be"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, extra=[torch.ones(3)]), symcomm.ArgumentError,
         "extra[0] has 3 rows"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, out=(1, 2)), symcomm.ArgumentError, "Fp4Gathered"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, algo="fast"), symcomm.ArgumentError, "algo must be"),
    ]
    # Outputs given that share memory: with each other, with x, or an extra not at this rank's
    # slice. raw holds the payload (4 rows of H/2 bytes), then the scales (4 rows of H/16).
    raw = torch.zeros(16 * H, dtype=torch.uint8)
    packed = raw[:2 * H].view(4, H // 2)
    scales = raw[2 * H:2 * H + H // 4].view(4, H // 16).view(torch.float8_e4m3fn)
    scales_over_packed = raw[2 * H - 8:2 * H - 8 + H // 4].view(4, H // 16).view(torch.float8_e4m3fn)
    ids = torch.zeros(4, 4, dtype=torch.int32)
    other_slice = ids[2 * (1 - rank):2 * (1 - rank) + 2]  # the peer's rows, on both ranks

    def given(extra=(), values=None, p=packed, s=scales):
        return symcomm.Fp4Gathered(p, s, extra, values, None)

    bad += [
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, out=given(s=scales_over_packed)),
         symcomm.ArgumentError, "out.packed overlaps out.scales"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, dequantize=True, out=given(values=raw.view(torch.float32).view(4, H))),
         symcomm.ArgumentError, "out.packed overlaps out.values"),
        (lambda: comm.all_gatherv_fp4(raw[:4 * H].view(torch.bfloat16).view(2, H), [2, 2], 1.0, out=given()),
         symcomm.ArgumentError, "out.packed overlaps x"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, extra=[other_slice], out=given((ids,))),
         symcomm.ArgumentError, "extra[0] overlaps out.extra[0] but is not this rank's slice"),
        (lambda: comm.all_gatherv_fp4(x, [2, 2], 1.0, extra=[torch.zeros(2, 4, dtype=torch.int32)],
                                      out=given((raw[2 * H:2 * H + 64].view(torch.int32).view(4, 4),))),
         symcomm.ArgumentError, "out.extra[0] overlaps out.scales"),
    ]
    for i, (call, exc_type, fragment) in enumerate(bad):
        with pytest.raises(exc_type) as info:
            call()
        assert fragment in str(info.value), f"case {i}: {info.value!r}"
    assert comm.all_reduce(torch.ones(2)).tolist() == [world, world]  # nothing was sent
    # An extra that is this rank's slice of its output is gathered in place.
    ids[2 * rank:2 * rank + 2] = torch.arange(8, dtype=torch.int32).view(2, 4) + 10 * rank
    got = comm.all_gatherv_fp4(x, [2, 2], 1.0, extra=[ids[2 * rank:2 * rank + 2]], out=given((ids,)))
    assert got.extra[0] is ids and ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13], [14, 15, 16, 17]]
    comm.close()

    checked = symcomm.Communicator(check=True)
    # One rank's call fails its own checks: it raises that, its peers raise instead of waiting.
    mine = torch.ones(2, 24) if rank == 1 else x
    expected = (symcomm.ArgumentError, "multiple of 16") if rank == 1 else (symcomm.PeerMismatchError, "rejected")
    with pytest.raises(expected[0], match=expected[1]):
        checked.all_gatherv_fp4(mine, [2, 2], 1.0)
    with pytest.raises(symcomm.PeerMismatchError, match="global_scale"):
        checked.all_gatherv_fp4(x, [2, 2], 1.0 + rank)
    # Global scale 6: s = amax, so rows of 1s and 2s get exact scales and decode exactly.
    got = checked.all_gatherv_fp4(x * (rank + 1), [2, 2], torch.tensor([6.0]), dequantize=True)
    assert got.values[:2].eq(1).all() and got.values[2:].eq(2).all()
    checked.close()
    with pytest.raises(symcomm.CommClosedError):
        checked.all_gatherv_fp4(x, [2, 2], 1.0)


def test_all_gatherv_fp4_bad_input_raises_before_communication():
    run_world(_gather_errors, 2, timeout_s=90)


@pytest.mark.parametrize("scale", (2.5, "tensor"))
def test_codec_under_torch_compile_is_its_library_ops_bitwise(scale):
    """Dynamo cannot trace the CUDA kernels' ctypes launch, so under torch.compile the codec runs
    as symcomm::fp4_quantize / fp4_dequantize: the traced graph must hold them (not the torch
    reference inlined), and give eager's bits, out= included."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gs = torch.tensor([2.5]) if scale == "tensor" else scale
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def roundtrip(t, g):
        packed, scales = fp4.quantize(t, g, swizzle=True)
        out = torch.empty(t.shape, dtype=torch.float32)
        return packed, scales, fp4.dequantize(packed, scales, g, torch.float32, swizzled=True, out=out)

    torch._dynamo.reset()
    got = torch.compile(roundtrip, backend=backend, fullgraph=True)(x, gs)
    want = roundtrip(x, gs)
    assert any("symcomm.fp4_quantize" in g and "symcomm.fp4_dequantize" in g for g in graphs), graphs
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
