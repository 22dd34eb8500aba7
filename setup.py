"""Builds csrc/ into symcomm/_native/libsymcomm.so with nvcc when nvcc is found.

The library is a plain C ABI loaded with ctypes and never links libtorch, so one build serves
any torch. Without nvcc the package still installs; symmetric memory then reports itself
unavailable and every collective runs on plain NCCL or torch.distributed.
"""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Translation units only: csrc/*.cuh and symcomm.h are headers they include.
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cc"))
# sm_90 machine code for Hopper plus compute_90 PTX so newer GPUs can JIT it.
DEFAULT_ARCHS = "-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


class NvccBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        nvcc = find_nvcc()
        if nvcc is None:
            warnings.warn("nvcc not found: symcomm installs without its native library "
                          "(symmetric memory and custom kernels will be unavailable)")
            return
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        # Editable installs copy the library into the source tree afterwards; the folder is
        # git-ignored, so make sure it exists.
        (ROOT / "symcomm" / "_native").mkdir(exist_ok=True)
        archs = os.environ.get("SYMCOMM_CUDA_ARCHS", DEFAULT_ARCHS).split()
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *archs,
               *ext.sources, "-o", str(target)]
        print(" ".join(cmd), file=sys.stderr)
        subprocess.check_call(cmd, cwd=ROOT)


setup(
    ext_modules=[Extension("symcomm._native.libsymcomm", sources=SOURCES)],
    cmdclass={"build_ext": NvccBuild},
)
