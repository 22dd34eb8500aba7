"""Probe for Nsight Compute: symcomm_rmsnorm at decode sizes (1 and 64 tokens of 7168, with a
residual), bf16 / FP8 / NVFP4 output (the scale read on the device, then passed by value),
three launches each, in the order printed. Run under ncu -k regex:rmsnorm_kernel ...; it times
nothing itself."""
import ctypes

import torch

from symcomm import _native

lib = _native.load().lib
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
for tokens in (1, 64):
    a = torch.randn(tokens, 7168, generator=g, device=dev).to(torch.bfloat16)
    r = torch.randn_like(a)
    w = (1 + 0.1 * torch.randn(7168, generator=g, device=dev)).to(torch.bfloat16)
    h = torch.empty_like(a)
    outs = {0: torch.empty_like(a), 1: torch.empty(tokens, 7168, dtype=torch.uint8, device=dev),
            2: torch.empty(tokens, 3584, dtype=torch.uint8, device=dev)}
    scales = torch.empty(tokens, 448, dtype=torch.uint8, device=dev)
    scale = {0: None, 1: torch.tensor([2.0 ** -5], device=dev), 2: torch.tensor([336.0], device=dev)}
    for quant, by_value in ((0, False), (1, False), (1, True), (2, False), (2, True)):
        ptr = None if scale[quant] is None or by_value else scale[quant].data_ptr()
        value = float(scale[quant].item()) if by_value else 0.0
        print(f"tokens {tokens} quant {quant} scale {'by value' if by_value else 'on the device'}", flush=True)
        args = _native.RmsnormArgs(r.data_ptr(), w.data_ptr(), _native.DTYPE_CODES[torch.bfloat16], tokens, 7168,
                                   1e-6, h.data_ptr(), quant, outs[quant].data_ptr(),
                                   scales.data_ptr() if quant == 2 else None, ptr, value, 0)
        for _ in range(3):
            assert lib.symcomm_rmsnorm(a.data_ptr(), ctypes.byref(args), torch.cuda.current_stream().cuda_stream) == 0
        torch.cuda.synchronize()
print("done")
