"""Probe: in which shapes does an unwaiting dependent behind the norm read stale with early signals on?"""
import torch
from symcomm import _native, rmsnorm

lib = _native.load().lib
sms = torch.cuda.get_device_properties(0).multi_processor_count


def stale(rows, hidden, residual, early, trials=30):
    prev = lib.symcomm_set_early_dependents(int(early))
    try:
        g = torch.Generator(device="cuda").manual_seed(11)
        a = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
        res = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16) if residual else None
        w = torch.randn(hidden, device="cuda", generator=g).to(torch.bfloat16)
        want = rmsnorm.add_rmsnorm(a, w, residual=res, impl="kernel").out
        out, seen = torch.empty_like(a), torch.empty_like(a)
        rout = torch.empty_like(a) if residual else None
        n = 0
        for _ in range(trials):
            out.fill_(float("nan")); seen.zero_(); torch.cuda.synchronize()
            if residual:
                rmsnorm.add_rmsnorm(a, w, residual=res, out=out, residual_out=rout, impl="kernel")
            else:
                rmsnorm.add_rmsnorm(a, w, out=out, impl="kernel")
            lib.symcomm_debug_unwaiting_copy(seen.data_ptr(), out.data_ptr(), out.nbytes, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
            n += not torch.equal(seen.view(torch.int16), want.view(torch.int16))
        return n
    finally:
        lib.symcomm_set_early_dependents(prev)


for rows, hidden, residual in [(sms // 4, 32768, False), (sms, 16384, True), (sms, 16384, False), (sms // 2, 8192, True),
                               (sms, 8192, True), (sms, 4096, True), (1, 16384, True), (sms // 4, 16384, True)]:
    on, off = stale(rows, hidden, residual, True), stale(rows, hidden, residual, False)
    print(f"rows {rows} hidden {hidden} residual {residual}: stale on {on}/30 off {off}/30", flush=True)
