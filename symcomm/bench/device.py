"""``--device auto | cpu | cuda``: which device the ranks on this machine use.

auto takes cuda when every rank on this machine gets a GPU of its own and otherwise runs the
ranks on the CPU over gloo, saying why in the preamble, so that one command line works on a
laptop, a one-GPU box and a GPU server alike. An explicit ``--device cuda`` never falls back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import BenchError

CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    device: str                  # "cpu" or "cuda"
    fallback: str | None = None  # why auto took the cpu although GPUs are visible
    why: str | None = None       # why the cpu at all: --device cpu, no GPU, or the fallback

    @property
    def note(self) -> str | None:
        """The preamble line saying why the ranks run on the CPU; None on cuda."""
        if self.device != "cpu":
            return None
        hint = "; pass --device cuda to insist" if self.fallback else ""
        return f"Device: cpu (gloo): {self.fallback or self.why or '--device cpu'}{hint}"


def _no_gpu() -> str:
    if torch.version.cuda is None:
        return f"no CUDA device visible (torch {torch.__version__} is a CPU build)"
    return f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda})"


def resolve(requested: str, local_ranks: int | None) -> DeviceChoice:
    """``local_ranks``: the ranks this machine runs, one GPU each; None where a launcher does
    not say, and then auto takes cuda whenever a GPU is visible.

    Every rank of one machine resolves alike (same GPUs, same count), which matters: ranks
    that chose different devices would start different backends and wait on each other forever.
    """
    if requested == "cpu":
        return DeviceChoice("cpu", why="--device cpu")
    has_cuda = torch.cuda.is_available()
    if requested == "cuda":
        if not has_cuda:
            raise BenchError(f"--device cuda, but {_no_gpu()}: run --device cpu for ranks over gloo")
        return DeviceChoice("cuda")
    if requested != "auto":
        raise BenchError(f"--device {requested!r}: choose from {', '.join(CHOICES)}")
    if not has_cuda:
        return DeviceChoice("cpu", why=_no_gpu())
    visible = torch.cuda.device_count()
    if local_ranks is None or local_ranks <= visible:
        return DeviceChoice("cuda")
    fallback = f"{local_ranks} ranks need {local_ranks} GPUs, {visible} visible"
    return DeviceChoice("cpu", fallback, fallback)


def require_gpus(ranks: int) -> None:
    """``--device cuda -g ranks``: one GPU per rank, or an error that says what would run."""
    visible = torch.cuda.device_count()
    if ranks > visible:
        raise BenchError(f"-g {ranks} needs {ranks} GPUs, but only {visible} visible: run -g {visible}, "
                         f"or --device cpu for {ranks} ranks over gloo")
