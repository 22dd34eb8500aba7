"""csrc/fp4.cu's quantize kernels on one GPU, bit for bit against symcomm.fp4.quantize_reference
(torch, on the CPU): the 16-bit kernel (bf16 / fp16), the fp32 kernel and the scalar fallback
for misaligned views, both scale layouts, the global scale as a value and as a device tensor,
graph replay. tests/gpu/test_fp4_gpu.py covers the same
kernels under torchrun on several GPUs; these run on one.

Skips without a GPU (conftest.py); SYMCOMM_REQUIRE_GPU=1 turns the skip into a failure.
"""
from __future__ import annotations

import pytest
import torch

from symcomm import fp4

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Empty, one block, an odd number of blocks, odd rows, the width, many rows of one block,
# a wide row.
SHAPES = ((0, 16), (1, 16), (7, 48), (33, 7168), (129, 4096), (4097, 16), (3, 65536))


def _data(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows scaled over 10^-3..10^3 (finite in fp16 too), a zero block and a -0 block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, max(shape[0], 1))[:shape[0]].unsqueeze(1)
    if shape[0]:
        x[0, :16] = 0.0
        x[-1, -16:] = -0.0
    return x.to(dtype)


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    for name, g, w in zip(("codes", "scales"), got, want):
        g, w = g.cpu().view(torch.uint8), w.view(torch.uint8)
        assert g.shape == w.shape, f"{what}: {name} shape {tuple(g.shape)} vs {tuple(w.shape)}"
        diff = g != w
        assert not bool(diff.any()), f"{what}: {name}: {int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"


@pytest.mark.parametrize("swizzle", (False, True))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference(dtype, shape, swizzle):
    x = _data(shape, dtype, shape[0] * 31 + shape[1])
    gs = float(fp4.global_scale_for(x)) if shape[0] else 1.0
    want = fp4.quantize_reference(x, gs, swizzle)
    xd = x.cuda()
    for arg in (gs, torch.tensor([gs], device="cuda")):
        got = fp4.quantize(xd, arg, swizzle)
        torch.cuda.synchronize()
        _check(got, want, f"{dtype} {shape} swizzle={swizzle} scale as {type(arg).__name__}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_every_16_bit_value(dtype):
    """All 65536 patterns (NaNs and infinities included) at global scales from tiny to huge."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).reshape(4096, 16)
    x = x[torch.randperm(4096, generator=torch.Generator().manual_seed(1))]  # mix blocks of values
    for gs in (1.0, 0.7, 448.0 * 6 / 3.0e38, 1e-30, 1e37):
        _check(fp4.quantize(x.cuda(), gs), fp4.quantize_reference(x, gs), f"{dtype} every value gs={gs}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_views(dtype):
    """Input off 16 bytes, codes off 8 bytes (both the scalar kernel), and codes 8- but not 16-byte
    aligned (the vector kernels)."""
    n, h = 37, 96
    x = _data((n, h), dtype, 8)
    want = fp4.quantize_reference(x, 5.0)
    for x_off, p_off in ((1, 0), (0, 8), (0, 3)):
        flat = torch.empty(n * h + 8, dtype=dtype, device="cuda")
        xd = flat[x_off:x_off + n * h].view(n, h).copy_(x)
        pbuf = torch.empty(n * h // 2 + 16, dtype=torch.uint8, device="cuda")
        packed = pbuf[p_off:p_off + n * h // 2].view(n, h // 2)
        scales = torch.empty(n, h // 16, dtype=torch.float8_e4m3fn, device="cuda")
        fp4.quantize(xd, 5.0, out=(packed, scales))
        torch.cuda.synchronize()
        _check((packed, scales), want, f"{dtype} input +{x_off} elements, codes +{p_off} bytes")


def test_graph_replay_matches_eager():
    x = _data((300, 2048), torch.bfloat16, 4).cuda()
    gs = torch.tensor([10.0], device="cuda")
    packed = torch.empty(300, 1024, dtype=torch.uint8, device="cuda")
    scales = torch.empty(fp4.swizzled_shape(300, 128), dtype=torch.float8_e4m3fn, device="cuda")
    fp4.quantize(x, gs, swizzle=True, out=(packed, scales))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4.quantize(x, gs, swizzle=True, out=(packed, scales))
    packed.fill_(0xEE)
    scales.view(torch.uint8).fill_(0xEE)
    graph.replay()
    torch.cuda.synchronize()
    _check((packed, scales), fp4.quantize_reference(x.cpu(), 10.0, swizzle=True), "replay")

