"""``symcomm-bench all_reduce_rmsnorm``: all-reduce + residual add + RMSNorm over [tokens, HIDDEN]
rows, one column per way of doing it, in the same run:

- ``nccl+torch``: the baseline every peer starts from: ``comm.all_reduce`` forced onto plain
  NCCL (torch.distributed on CPU, which has no NCCL), then ``a + residual`` and PyTorch's own
  ``F.rms_norm``;
- ``symm_mem+torch``: PyTorch's own symmetric memory, where the installed torch has it
  (``torch.ops.symm_mem.one_shot_all_reduce_out`` up to 512 KiB, ``two_shot_all_reduce_`` above,
  on a buffer from ``symm_mem.empty``, then the same add and ``F.rms_norm``: torch_symm.py);
  N/A elsewhere (CPU);
- ``unfused``: ``comm.all_reduce_rmsnorm(algo="unfused")``: symcomm's all-reduce on the path
  its table picks, then one launch of csrc/rmsnorm.cu (``algo="reference"``, the torch
  reference, on CPU);
- ``auto``: ``comm.all_reduce_rmsnorm`` with --algo's path (auto with --algo all): what a
  user gets;
- ``auto+fp8``, ``auto+nvfp4``: the same with a quantized y, whose cost against ``auto`` is
  the quantization's.

The size column counts x's bytes (the all-reduced tensor), so sizes and bus bandwidths line up
with all_reduce's; sizes round down to whole tokens of HIDDEN values. "In place" means the new
residual overwrites the old one (``residual_out=residual``). The check: h against a float64
sum of every rank's x and the residual, within the all-reduce's rounding; symcomm's y (and its
FP8 / NVFP4 bytes) bit for bit against the torch reference run on the CPU from the h the call
returned; the baseline's y against float64 within a tolerance, since torch's RMSNorm rounds
its own way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from symcomm import rmsnorm

from . import check, torch_symm
from .collectives import AllReduce, all_reduce_call
from .config import DATATYPES, BenchError
from .sizes import Layout
from .spec import Buffers, Case, Cases, Inputs, Refusal, Setup

HIDDEN = 8192  # one of the model sizes (7168 is the other): a hidden flag would go here
EPS = 1e-6
BASELINE = "nccl+torch"
SYMM_MEM = "symm_mem+torch"
# torch's symmetric-memory one-shot all-reduce up to here, two-shot above: torch leaves the
# choice to its caller, and bench/layer_step.py splits at the same size
SYMM_MEM_ONE_SHOT_MAX = 512 << 10
# column -> (the norm path it forces, or None for --algo's path; quant mode)
_COLUMNS = {"unfused": ("unfused", None), "auto": (None, None), "auto+fp8": (None, "fp8"),
            "auto+nvfp4": (None, "nvfp4")}
_QUANT = {column: quant for column, (_, quant) in _COLUMNS.items()}
VARIANTS = (BASELINE, SYMM_MEM, *_COLUMNS)
# y of random rows is within a few units: these keep FP8 codes and NVFP4 block scales in range.
FP8_SCALE = 2.0**-5
NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0
NORMABLE = ("bfloat16", "float16")


@dataclass(frozen=True)
class AllReduceRmsnorm(AllReduce):
    """An all_reduce of [tokens, HIDDEN] whose columns are VARIANTS rather than paths."""

    variants = VARIANTS

    def layout(self, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
        count = nbytes // itemsize // HIDDEN * HIDDEN
        return Layout(count * itemsize, count, count, count, (count,) * world, HIDDEN)

    def redop_label(self, redop: str) -> str:
        # The fused op sums (h = all_reduce(x) + residual): another -o would label a sum as it.
        if redop != "sum":
            raise BenchError(f"{self.name} sums (h = all_reduce(x) + residual): -o takes only sum, not {redop}")
        return redop

    def validate(self, datatype: str) -> None:
        if DATATYPES[datatype][1] not in NORMABLE:
            raise BenchError(f"{self.name} normalises bfloat16 or half rows, not {datatype}")

    def default_datatype(self, device: str) -> str:
        return "bfloat16"  # the norm takes model activations: bf16 or fp16 rows only

    def notes(self, world: int, itemsize: int, path: str) -> list[str]:
        return [f"RMSNorm: x is [tokens, {HIDDEN}] (size / {HIDDEN * itemsize} B = tokens), eps {EPS}; columns "
                f"{', '.join(VARIANTS)}; the auto columns take --algo {path}, the others force their norm path; "
                f"in place = residual_out is "
                f"residual; FP8 scale {FP8_SCALE}, NVFP4 global scale {NVFP4_GLOBAL_SCALE}",
                f"RMSNorm check: h against float64 within the all-reduce's rounding; symcomm's outputs bit for bit "
                f"against the torch reference from that h; {BASELINE}'s y against float64"]

    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): in place concerns the residual, so x and y never alias."""
        return bufs.send[:lay.count].view(-1, HIDDEN), bufs.recv[:lay.count].view(-1, HIDDEN)

    def cases(self, setup: Setup, lay: Layout, gen: Inputs) -> Cases:
        comm, dtype, device = setup.comm, setup.dtype, setup.device
        x, y = self.views(lay, setup.bufs, setup.rank, False)
        tokens = x.shape[0]
        mine = gen(setup.rank)
        # The residual and the weight are the same on every rank: seeded as ranks world, world+1.
        res0 = check.make_input(lay.count, dtype, device, setup.seed, setup.world, lay.nbytes, "sum", setup.world)
        weight = check.make_input(HIDDEN, dtype, device, setup.seed, setup.world + 1, HIDDEN, "none", setup.world)
        residual, h, a = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        quantized = {"fp8": torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device),
                     "nvfp4": (torch.empty((tokens, HIDDEN // 2), dtype=torch.uint8, device=device),
                               torch.empty((tokens, HIDDEN // 16), dtype=torch.float8_e4m3fn, device=device))}
        scales = {None: None, "fp8": FP8_SCALE, "nvfp4": NVFP4_GLOBAL_SCALE}
        exp_h = exp_y = None
        if setup.check:
            exp_h = check.reduction([*(gen(p) for p in range(setup.world)), res0], "sum", dtype, setup.world + 1)
            exp_y = _expected_y(exp_h, weight, dtype, setup.world)
        ar = "nccl" if "nccl" in comm.algorithms() else "torch"
        baseline_y: list[torch.Tensor] = [y]
        symm_cache: list[torch_symm.SymmBuffer] = []
        # What torch would refuse (the CPU, half rows) is refused before the rendezvous.
        symm_column = torch_symm.ONE_SHOT if x.nbytes <= SYMM_MEM_ONE_SHOT_MAX else torch_symm.TWO_SHOT
        symm_refusal = torch_symm.all_reduce_refusal(symm_column, dtype, x.nbytes, "sum", device)

        def symm() -> torch_symm.SymmBuffer:
            # Made when the symm_mem+torch column is first asked for (tune never asks): the
            # rendezvous is collective, and every rank asks for the columns in the same order.
            if not symm_cache:
                symm_cache.append(torch_symm.rendezvous_empty(x.shape, dtype, device))
            return symm_cache[0]

        def case(variant: str, inplace: bool) -> Case | Refusal | None:
            new_h = residual if inplace else h
            quant = _QUANT.get(variant)
            out = y if quant is None else quantized[quant]
            if variant == SYMM_MEM and not tokens:
                return None
            if variant == SYMM_MEM and symm_refusal is not None:
                return Refusal(symm_refusal)
            if variant == BASELINE:
                def call() -> object:
                    comm.all_reduce(x, out=a, algo=ar)
                    torch.add(a, residual, out=new_h)
                    baseline_y[0] = F.rms_norm(new_h, (HIDDEN,), weight, EPS)
                    return baseline_y[0]
            elif variant == SYMM_MEM:
                def call() -> object:
                    torch.add(_symm_mem_all_reduce(symm(), a), residual, out=new_h)
                    baseline_y[0] = F.rms_norm(new_h, (HIDDEN,), weight, EPS)
                    return baseline_y[0]
            else:
                # "unfused" forces that path, the auto columns run --algo's.
                norm_algo = _COLUMNS[variant][0] or setup.path
                if norm_algo == "unfused" and rmsnorm.kernel_available(device) is not None:
                    norm_algo = "reference"  # the same unfused path, with the torch reference for the kernel

                def call() -> object:
                    return comm.all_reduce_rmsnorm(x, weight, residual=residual, eps=EPS, out=out,
                                                   residual_out=new_h, quant=quant, scale=scales[quant],
                                                   algo=norm_algo)

            def load(fill: int = 0xFF) -> None:
                # Poison first: in place, the new residual is the input residual.
                for t in (new_h, y, a, baseline_y[0]):  # a: the baselines' all-reduce output
                    check.poison_fill(t)
                for t in _flat(quantized):
                    t.view(torch.uint8).fill_(fill)
                x.view(-1).copy_(mine)
                if variant == SYMM_MEM:
                    symm().tensor.copy_(x)  # as the GEMM before it would have written it
                residual.view(-1).copy_(res0)

            def count() -> int:
                wrong = check.count_wrong(new_h, exp_h)
                if variant in (BASELINE, SYMM_MEM):
                    return wrong + check.count_wrong(baseline_y[0], exp_y)
                return wrong + _wrong_bytes(new_h, weight, quant, scales[quant], out, lambda: _rerun(load, call))

            def corrupt() -> None:
                if quant is None:
                    check.corrupt(baseline_y[0] if variant in (BASELINE, SYMM_MEM) else y)
                else:
                    _flat(out)[0].view(torch.uint8).view(-1)[:1].bitwise_not_()

            return Case(call=call, load=load, count=count if setup.check else None, corrupt=corrupt)
        return case


def _symm_mem_all_reduce(buf: torch_symm.SymmBuffer, out: torch.Tensor) -> torch.Tensor:
    """torch's one-shot into ``out`` up to SYMM_MEM_ONE_SHOT_MAX, its two-shot above."""
    if buf.tensor.nbytes <= SYMM_MEM_ONE_SHOT_MAX:
        return torch_symm.one_shot_all_reduce(buf, out)
    return torch_symm.two_shot_all_reduce_(buf)  # in place: load() refills it


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    return list(out) if isinstance(out, tuple) else [out]


def _expected_y(exp_h: check.Expected, weight: torch.Tensor, dtype: torch.dtype, world: int) -> check.Expected:
    """y from the float64 h, with room for h's own error (bound) carried through the normalisation,
    and a few roundings of the output's dtype."""
    h64 = exp_h.value.view(-1, HIDDEN)
    w64 = weight.double()
    rinv = torch.rsqrt(h64.pow(2).mean(dim=1, keepdim=True) + EPS)
    value = h64 * rinv * w64
    rel = torch.finfo(dtype).eps * (world + 3)
    bound = exp_h.bound.view(-1, HIDDEN) * rinv * w64.abs() + rel * value.abs() + rel * rinv * w64.abs()
    return check.Expected(value.reshape(-1), bound.reshape(-1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One integer per element, so a wrong element counts once."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.uint8)


def _rerun(load: Callable[[int], None], call: Callable[[], object]) -> None:
    """The call again over outputs poisoned with the complementary bytes, so that a byte the call
    never writes differs from the right one in one of the two runs, whatever its right value."""
    load(0x00)
    call()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _wrong_bytes(h: torch.Tensor, weight: torch.Tensor, quant: str | None, scale: float | None, out: object,
                 rerun: Callable[[], None]) -> int:
    """Bytes of symcomm's output that differ from the torch reference computed on the CPU from the
    h this call returned. Quantized outputs are compared twice, over both poison fills (see _rerun)."""
    ref = rmsnorm.reference_add_rmsnorm(h.cpu(), weight.cpu(), eps=EPS, quant=quant, scale=scale)
    expect = [_bits(t) for t in (ref.out, ref.scales) if t is not None]

    def mismatch() -> list[torch.Tensor]:
        return [_bits(g.cpu()) != e for g, e in zip(_flat(out), expect)]

    first = mismatch()
    if quant is None:
        return int(sum(m.sum() for m in first))
    rerun()
    return int(sum((m1 | m2).sum() for m1, m2 in zip(first, mismatch())))


# The launch field is AllReduce's plain all-reduce; this spec's cases() make their own calls.
ALL_REDUCE_RMSNORM = AllReduceRmsnorm("all_reduce_rmsnorm", all_reduce_call)
