"""The local kernels on one GPU against same-run baselines: add + RMSNorm (csrc/rmsnorm.cu) and
NVFP4 quantize (csrc/fp4.cu).

    python bench/local_kernels.py [--tokens 1,4,16,...] [--hidden 7168] [--calls 50] [--replays 7]
        [--quant-mib 1,4,16,64,256] [--lib NAME=PATH ...] [--no-compile] [--json out.json]

Every time is per call: a CUDA graph of --calls back-to-back calls on the same buffers, replayed
--replays times (after two untimed replays), each replay timed with events; the tables print the
median and the JSON keeps every sample. All columns come from one process, so only ratios
between them mean anything.

Norm table, bf16, rows of --hidden values, per token count:
  copy floor   the bytes symcomm's kernel moves (a and the residual read, h and y written) at the
               device-copy rate measured in the same run (a 256 MiB copy_, read + write)
  eager        h = a + r; y = F.rms_norm(h): torch's own kernels
  compiled     the same function under torch.compile (one kernel writing h and y)
  symcomm      symcomm_rmsnorm writing h and y
  y-only       no residual: compiled F.rms_norm(a) against symcomm_rmsnorm writing y alone
  fp8, nvfp4   symcomm_rmsnorm with a residual, writing h and FP8 / NVFP4 y (scale read on the
               device), against its own bf16 column
Small token counts run in L2 (the same buffers every call), for every column alike.

Quantize table, bf16 [rows, 8192], per input size: torch's copy_ of the input against
symcomm_fp4_quantize (linear scales), as bandwidth counting bytes read + written (quantize:
the input, the codes and the scales). "hot" reuses one input (in L2 up to about 16 MiB); "cold"
cycles through enough inputs (and outputs) to leave L2 on every call.

--lib NAME=PATH adds a build of the native library (loaded with ctypes, called through the same
entry points) as extra symcomm columns; its outputs are compared bit for bit with the installed
library's and the tables say where they differ.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from symcomm import _native

EPS = 1e-6
QUANT_COLS = 8192
COPY_BYTES = 256 << 20
L2_SPAN = 3 * (50 << 20)  # bytes a cold sweep cycles through: several times H100's 50 MB L2
NORM_CASES = ("hy", "y", "fp8", "nvfp4")  # symcomm columns: with residual (h + y), without, quantized


def parse_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def parse_lib(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lib wants NAME=PATH, got {text!r}")
    return name, path


def load_lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    _native.bind(lib, path)  # refuses a build of another ABI
    return lib


def time_graph(call: Callable[[int], object], calls: int, replays: int) -> list[float]:
    """Per-call microseconds of each replay of a graph holding call(0) .. call(calls - 1)."""
    call(0)  # outside capture: lazy setup and compilation never happen inside it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    for _ in range(2):
        graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return samples


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NormBuffers:
    """Inputs and outputs of one token count; every column reads the same a, r and w."""

    def __init__(self, tokens: int, hidden: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = torch.device("cuda")
        self.a = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
        self.r = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
        self.w = (1 + 0.1 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
        self.h = torch.empty_like(self.a)
        self.y = torch.empty_like(self.a)
        self.fp8 = torch.empty(tokens, hidden, dtype=torch.uint8, device=dev)
        self.codes = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=dev)
        self.scales = torch.empty(tokens, hidden // 16, dtype=torch.uint8, device=dev)
        self.fp8_scale = torch.tensor([2.0 ** -5], device=dev)
        self.global_scale = torch.tensor([448.0 * 6 / 8.0], device=dev)


def norm_call(lib: ctypes.CDLL, b: NormBuffers, case: str) -> Callable[[int], None]:
    tokens, hidden = b.a.shape
    residual = None if case == "y" else b.r
    h = None if case == "y" else b.h
    quant = {"fp8": 1, "nvfp4": 2}.get(case, 0)
    out = {"fp8": b.fp8, "nvfp4": b.codes}.get(case, b.y)
    scales = b.scales if case == "nvfp4" else None
    scale = {"fp8": b.fp8_scale, "nvfp4": b.global_scale}.get(case)
    dtype = _native.DTYPE_CODES[torch.bfloat16]
    args = _native.RmsnormArgs(ptr(residual), b.w.data_ptr(), dtype, tokens, hidden, EPS, ptr(h), quant,
                               out.data_ptr(), ptr(scales), ptr(scale), 0.0, 0)

    def call(_: int) -> None:
        rc = lib.symcomm_rmsnorm(b.a.data_ptr(), ctypes.byref(args), stream())
        if rc != 0:
            raise RuntimeError(f"symcomm_rmsnorm returned {rc}")
    return call


def norm_outputs(b: NormBuffers, case: str) -> list[torch.Tensor]:
    return {"hy": [b.h, b.y], "y": [b.y], "fp8": [b.h, b.fp8], "nvfp4": [b.h, b.codes, b.scales]}[case]


def add_norm(a: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = a + r
    return h, F.rms_norm(h, (h.shape[-1],), w, EPS)


def norm_only(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(a, (a.shape[-1],), w, EPS)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def copy_rate(calls: int, replays: int) -> tuple[float, list[float]]:
    """Bytes per microsecond (read + write) of torch's copy_ of COPY_BYTES, and its samples."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    samples = time_graph(lambda _: dst.copy_(src), max(calls // 5, 5), replays)
    return 2 * COPY_BYTES / median(samples), samples


def norm_row(args, tokens: int, libs: dict[str, ctypes.CDLL], rate: float, compiled: tuple | None) -> dict:
    b = NormBuffers(tokens, args.hidden, seed=tokens)
    row = {"bytes_hy": 4 * b.a.numel() * 2, "bytes_y": 2 * b.a.numel() * 2}
    sample = {"eager_hy": time_graph(lambda _: add_norm(b.a, b.r, b.w), args.calls, args.replays),
              "eager_y": time_graph(lambda _: norm_only(b.a, b.w), args.calls, args.replays)}
    if compiled is not None:
        compiled_hy, compiled_y = compiled
        sample["compiled_hy"] = time_graph(lambda _: compiled_hy(b.a, b.r, b.w), args.calls, args.replays)
        sample["compiled_y"] = time_graph(lambda _: compiled_y(b.a, b.w), args.calls, args.replays)
    reference: dict[str, list[torch.Tensor]] = {}
    bitwise = {}
    for lib_name, lib in libs.items():
        for case in NORM_CASES:
            sample[f"{lib_name}:{case}"] = time_graph(norm_call(lib, b, case), args.calls, args.replays)
            outs = [t.clone() for t in norm_outputs(b, case)]
            if lib_name == "symcomm":
                reference[case] = outs
            else:
                bitwise[f"{lib_name}:{case}"] = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                                    for x, y in zip(outs, reference[case]))
    if compiled is not None:
        # symcomm's y against compiled torch's: within bf16 rounding (another reduction order).
        norm_call(libs["symcomm"], b, "hy")(0)
        _, y_ref = compiled[0](b.a, b.r, b.w)
        row["max_abs_diff_vs_compiled"] = float((b.y.float() - y_ref.float()).abs().max())
    row["samples_us"] = sample
    row["median_us"] = {k: median(v) for k, v in sample.items()}
    row["bitwise_vs_symcomm"] = bitwise
    row["copy_floor_us"] = row["bytes_hy"] / rate
    return row


def run_norm(args, libs: dict[str, ctypes.CDLL], rate: float) -> dict:
    compiled = None
    if not args.no_compile:
        for name in ("cache_size_limit", "recompile_limit"):  # one compiled graph per token count
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        compiled = (torch.compile(add_norm, dynamic=False), torch.compile(norm_only, dynamic=False))
    results = {}
    for tokens in args.tokens:
        results[str(tokens)] = norm_row(args, tokens, libs, rate, compiled)
        torch.cuda.empty_cache()
    return results


def quant_row(args, mib: int, libs: dict[str, ctypes.CDLL], gs: torch.Tensor, temp: str) -> dict:
    nbytes = mib << 20
    rows = nbytes // (2 * QUANT_COLS)
    sets = 1 if temp == "hot" else max(2, math.ceil(L2_SPAN / nbytes))
    g = torch.Generator(device="cuda").manual_seed(mib)
    xs = [torch.randn(rows, QUANT_COLS, generator=g, device="cuda").to(torch.bfloat16) for _ in range(sets)]
    copies = [torch.empty_like(x) for x in xs]
    packed = [torch.empty(rows, QUANT_COLS // 2, dtype=torch.uint8, device="cuda") for _ in xs]
    scales = [torch.empty(rows, QUANT_COLS // 16, dtype=torch.uint8, device="cuda") for _ in xs]
    gs.fill_(448.0 * 6 / float(xs[0].float().abs().max()))
    sample = {"copy": time_graph(lambda i: copies[i % sets].copy_(xs[i % sets]), args.calls, args.replays)}
    bitwise = {}
    reference = None
    for lib_name, lib in libs.items():
        sample[lib_name] = time_graph(quant_call(lib, xs, packed, scales, gs), args.calls, args.replays)
        outs = (packed[0].clone(), scales[0].clone())
        if reference is None:
            reference = outs
        else:
            bitwise[lib_name] = bool(torch.equal(outs[0], reference[0]) and torch.equal(outs[1], reference[1]))
    return {"sets": sets, "samples_us": sample, "median_us": {k: median(v) for k, v in sample.items()},
            "bitwise_vs_symcomm": bitwise}


def quant_call(lib: ctypes.CDLL, xs: list[torch.Tensor], packed: list[torch.Tensor],
               scales: list[torch.Tensor], gs: torch.Tensor) -> Callable[[int], None]:
    rows, cols = xs[0].shape
    dtype = _native.DTYPE_CODES[torch.bfloat16]

    def call(i: int) -> None:
        k = i % len(xs)
        rc = lib.symcomm_fp4_quantize(xs[k].data_ptr(), dtype, rows, cols, gs.data_ptr(), 0.0, packed[k].data_ptr(),
                                      scales[k].data_ptr(), 0, stream())
        if rc != 0:
            raise RuntimeError(f"symcomm_fp4_quantize returned {rc}")
    return call


def run_quantize(args, libs: dict[str, ctypes.CDLL]) -> dict:
    results = {}
    gs = torch.tensor([1.0], device="cuda")
    for mib in args.quant_mib:
        nbytes = mib << 20
        row = {"input_bytes": nbytes, "quant_bytes": nbytes + nbytes // 4 + nbytes // 32, "copy_bytes": 2 * nbytes}
        for temp in ("hot", "cold"):
            row[temp] = quant_row(args, mib, libs, gs, temp)
            torch.cuda.empty_cache()
        results[str(mib)] = row
    return results


def fmt(v: float | None) -> str:
    return "-" if v is None else (f"{v:8.2f}" if v < 1000 else f"{v:8.1f}")


def print_norm(res: dict, libs: list[str]) -> None:
    print("\n## add + RMSNorm, bf16, per call (µs, median); ratios are symcomm / the column named")
    head = ["tokens", "copy floor", "eager h+y", "compiled h+y", "symcomm h+y", "÷compiled",
            "compiled y", "symcomm y", "÷compiled", "fp8", "÷bf16", "nvfp4", "÷bf16"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for tokens, row in res.items():
        m = row["median_us"]
        chy, cy = m.get("compiled_hy"), m.get("compiled_y")
        hy, y, f8, f4 = (m[f"symcomm:{c}"] for c in NORM_CASES)
        cells = [tokens, fmt(row["copy_floor_us"]), fmt(m["eager_hy"]), fmt(chy), fmt(hy),
                 f"{hy / chy:.2f}" if chy else "-", fmt(cy), fmt(y), f"{y / cy:.2f}" if cy else "-",
                 fmt(f8), f"{f8 / hy:.2f}", fmt(f4), f"{f4 / hy:.2f}"]
        print("| " + " | ".join(cells) + " |")
    extra = [n for n in libs if n != "symcomm"]
    if not extra:
        return
    print("\n## other builds (--lib): h+y, y, fp8, nvfp4 (µs), h+y ÷ compiled h+y; * = bits differ from symcomm")
    head = ["tokens"] + [f"{n} {c}" for n in ["symcomm"] + extra for c in ("h+y", "y", "fp8", "nvfp4", "÷c")]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for tokens, row in res.items():
        m, same = row["median_us"], row["bitwise_vs_symcomm"]
        cells = [tokens]
        for n in ["symcomm"] + extra:
            for c in NORM_CASES:
                star = "" if same.get(f"{n}:{c}", True) else "*"
                cells.append(fmt(m[f"{n}:{c}"]) + star)
            chy = m.get("compiled_hy")
            cells.append(f"{m[f'{n}:hy'] / chy:.2f}" if chy else "-")
        print("| " + " | ".join(cells) + " |")


def print_quantize(res: dict, libs: list[str]) -> None:
    print("\n## NVFP4 quantize, bf16 [rows, 8192] -> codes + linear scales: µs, and bandwidth ÷ copy's (same input)")
    head = ["MiB", "temp", "copy µs", "copy GB/s"] + [f"{n} {c}" for n in libs for c in ("µs", "GB/s", "÷copy")]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for mib, row in res.items():
        for temp in ("hot", "cold"):
            m, same = row[temp]["median_us"], row[temp]["bitwise_vs_symcomm"]
            copy_bw = row["copy_bytes"] / m["copy"] / 1e3
            cells = [mib, temp, fmt(m["copy"]), f"{copy_bw:.0f}"]
            for n in libs:
                bw = row["quant_bytes"] / m[n] / 1e3
                cells += [fmt(m[n]) + ("" if same.get(n, True) else "*"), f"{bw:.0f}", f"{bw / copy_bw:.2f}"]
            print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=parse_list, default=parse_list("1,4,16,64,256,1024,2048,4096,16384"))
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--quant-mib", type=parse_list, default=parse_list("1,4,16,64,256"))
    p.add_argument("--lib", type=parse_lib, action="append", default=[], help="NAME=PATH of another build")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile columns")
    p.add_argument("--skip-norm", action="store_true")
    p.add_argument("--skip-quantize", action="store_true")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("local_kernels.py needs a CUDA GPU")
    native = _native.load()
    libs = {"symcomm": native.lib}
    libs.update({name: load_lib(path) for name, path in args.lib})
    rate, copy_samples = copy_rate(args.calls, args.replays)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "library": native.path, "libs": dict(args.lib),
            "args": {k: v for k, v in vars(args).items() if k != "lib"},
            "copy_bytes_per_us": rate, "copy_samples_us": copy_samples}
    print(f"{meta['device']}, torch {meta['torch']}: device copy {rate / 1e3:.0f} GB/s (read + write, 256 MiB)")
    out = {"meta": meta}
    if not args.skip_norm:
        out["norm"] = run_norm(args, libs, rate)
        print_norm(out["norm"], list(libs))
    if not args.skip_quantize:
        out["quantize"] = run_quantize(args, libs)
        print_quantize(out["quantize"], list(libs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
