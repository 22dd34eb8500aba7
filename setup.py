"""Builds csrc/ into symcomm/_native/libsymcomm*.so with nvcc, when an nvcc is found.

The library is a plain C ABI loaded with ctypes and never links libtorch or a shared CUDA
runtime (cudart is linked statically), so one build serves any torch and a wheel built on a
machine with nvcc installs and loads on one without (docs/install.md).

Without nvcc the package installs all the same: symmetric memory and symcomm's kernels are then
off and every collective runs on NCCL or torch.distributed. The build's outcome (built, or why
not) goes to symcomm/_native/build.json, which `python -m symcomm` and symcomm-bench's preamble
print, since pip shows a build's own output only with -v.

nvcc is looked for in $CUDA_HOME/bin, $CUDA_PATH/bin, on PATH, in NVIDIA's nvidia-cuda-nvcc
wheel installed in the build environment, then in /usr/local/cuda/bin unless CUDA_HOME or
CUDA_PATH is set. Each translation unit compiles in its own nvcc process, as many at once as
there are cores, slowest first; object files are cached in build/nvcc-cache/ under a key of the
nvcc version, the flags and the contents of the unit and of every csrc/ header it includes, so a
rebuild compiles only what changed. A unit that fails to compile fails the install: a library
left over from an earlier build must never pass for this source. SYMCOMM_CUDA_ARCHS=none builds
no library even where nvcc is found.

Only setup() runs when setuptools executes this file; the functions above it are importable
(tests/test_build.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
# Translation units only: csrc/*.cuh and symcomm.h are headers they include.
SOURCES = sorted(str(p.relative_to(ROOT)) for p in CSRC.iterdir() if p.suffix in (".cu", ".cc"))
# sm_90 machine code for Hopper plus compute_90 PTX so newer GPUs can JIT it.
DEFAULT_ARCHS = "-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"
# A host-only call from a __host__ __device__ function is only a warning by default, and the device
# code it leaves computes garbage: made an error. -ffp-contract=off: the host twins of the kernels
# (the CPU paths of MoE combine and the norm) must round each multiply and add as the device's
# __fmul_rn / __fadd_rn do, and GCC fuses `t = w * y; acc + t` into an FMA wherever the target has
# one (aarch64 hosts such as Grace, or x86 built with -mfma), across statements after inlining.
# On x86-64 as built here the objects' code is identical with and without it (bench/NOTES.md).
FLAGS = ["-O3", "-std=c++17", "-Werror", "cross-execution-space-call", "-Xcompiler", "-fPIC",
         "-Xcompiler", "-ffp-contract=off"]
CACHE = ROOT / "build" / "nvcc-cache"
STATUS_FILE = "build.json"
# Seconds each unit took to compile alone with nvcc 13.0 on one core (bench/NOTES.md, issue 24).
# Only the order uses them: on few cores the slowest unit must start first, or the build waits
# for it at the end. Units not listed start after these, largest file first.
SLOWEST_FIRST = {"rmsnorm.cu": 9.7, "ep.cu": 8.9, "custom_ar.cu": 5.3, "peer_gather.cu": 3.1, "fp4.cu": 2.6,
                 "pool_alloc.cc": 0.7}
# Where NVIDIA's CUDA 13 wheels (nvidia-cuda-nvcc, -cccl, -runtime, -crt, nvidia-nvvm) put the
# toolkit inside site-packages. Its nvcc.profile looks for libraries in lib64/, the wheels ship
# lib/: the link step is told.
WHEEL_TOOLKIT = Path("nvidia") / "cu13"
# Where NVIDIA's installers put the toolkit (a link to /usr/local/cuda-X.Y).
DEFAULT_TOOLKIT = Path("/usr/local/cuda")


def log(message: str) -> None:
    print(f"symcomm build: {message}", file=sys.stderr, flush=True)


def find_nvcc() -> tuple[str | None, str]:
    """(nvcc, where it was found), or (None, why none was)."""
    named = False
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        named = named or bool(home)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc"), f"${var}"
    found = shutil.which("nvcc")
    if found:
        return found, "PATH"
    for entry in sys.path:
        candidate = Path(entry or ".") / WHEEL_TOOLKIT / "bin" / "nvcc"
        if candidate.is_file():
            return str(candidate), "the nvidia-cuda-nvcc wheel"
    # The toolkit's installers put it here and leave PATH alone, so a machine with CUDA often
    # has no nvcc on PATH. Only a guess: where CUDA_HOME or CUDA_PATH names a toolkit, that
    # is the one meant, and a different one found here could be another CUDA version.
    if not named and (DEFAULT_TOOLKIT / "bin" / "nvcc").is_file():
        return str(DEFAULT_TOOLKIT / "bin" / "nvcc"), str(DEFAULT_TOOLKIT / "bin")
    guessed = "" if named else f", in {DEFAULT_TOOLKIT / 'bin'}"
    return None, ("nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, on PATH, for the "
                  f"nvidia-cuda-nvcc wheel{guessed})")


def nvcc_version(nvcc: str) -> str:
    """The whole of `nvcc --version`: part of the cache key, so another toolkit recompiles."""
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def release(version_text: str) -> str:
    match = re.search(r"release [\d.]+, V([\d.]+)", version_text)
    return match.group(1) if match else "unknown"


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def local_headers(unit: Path) -> list[Path]:
    """The csrc/ headers ``unit`` includes, directly or through other headers."""
    seen: dict[Path, None] = {}
    todo = [unit]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_text(encoding="utf-8")):
            header = (CSRC / name).resolve()
            if header.is_file() and header not in seen:
                seen[header] = None
                todo.append(header)
    return sorted(seen)


def object_key(unit: Path, compile_flags: list[str], version_text: str) -> str:
    digest = hashlib.sha256()
    for part in (version_text, "\0".join(compile_flags)):
        digest.update(part.encode() + b"\0")
    for path in (unit, *local_headers(unit)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_order(units: list[Path]) -> list[Path]:
    return sorted(units, key=lambda u: (-SLOWEST_FIRST.get(u.name, -1.0), -u.stat().st_size, u.name))


class CompileError(RuntimeError):
    pass


def compile_units(nvcc: str, units: list[Path], compile_flags: list[str], cache: Path,
                  jobs: int) -> list[Path]:
    """An object file per unit, from the cache or from one nvcc process each, ``jobs`` at once.
    Raises CompileError with the compiler's output if a unit fails; the others are stopped."""
    cache.mkdir(parents=True, exist_ok=True)
    version_text = nvcc_version(nvcc)
    objects = {u: cache / f"{u.name}-{object_key(u, compile_flags, version_text)}.o" for u in units}
    todo = [u for u in build_order(units) if not objects[u].exists()]
    cached = len(units) - len(todo)
    log(f"{len(units)} units: {cached} from the cache, {len(todo)} to compile, {min(jobs, len(todo) or 1)} at once")
    running: set[subprocess.Popen] = set()
    lock = threading.Lock()
    failed = threading.Event()
    done = [cached]

    def one(unit: Path) -> None:
        if failed.is_set():
            return
        tmp = objects[unit].with_suffix(f".{os.getpid()}.tmp")
        start = time.perf_counter()
        with lock:
            proc = subprocess.Popen([nvcc, *compile_flags, "-c", str(unit), "-o", str(tmp)], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.add(proc)
        output, _ = proc.communicate()
        with lock:
            running.discard(proc)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                if not failed.is_set():
                    failed.set()
                    for other in running:
                        other.terminate()
                    raise CompileError(f"{unit.relative_to(ROOT)} failed to compile:\n{output}")
                return
            os.replace(tmp, objects[unit])  # atomic: a cut-off build leaves no half object
            done[0] += 1
            log(f"[{done[0]}/{len(units)}] {unit.relative_to(ROOT)} compiled in {time.perf_counter() - start:.1f} s")
            if output.strip():
                print(output, file=sys.stderr, end="")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(one, u) for u in todo]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    # One object per unit is kept: the cache holds the current build, not every past one.
    for unit, obj in objects.items():
        for old in cache.glob(f"{unit.name}-*.o"):
            if old != obj:
                old.unlink(missing_ok=True)
    return [objects[u] for u in units]


def link(nvcc: str, objects: list[Path], target: Path) -> None:
    lib_dir = Path(nvcc).resolve().parent.parent / "lib"
    extra = [f"-L{lib_dir}"] if WHEEL_TOOLKIT.as_posix() in Path(nvcc).as_posix() else []
    tmp = target.with_name(target.name + ".tmp")
    subprocess.run([nvcc, "-shared", *map(str, objects), *extra, "-o", str(tmp)], cwd=ROOT, check=True)
    os.replace(tmp, target)


def write_status(folders: list[Path], status: dict) -> None:
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STATUS_FILE).write_text(json.dumps(status, indent=1) + "\n")


class NvccBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        # An editable install runs from the source tree: the outcome is recorded there too.
        source_dir = ROOT / "symcomm" / "_native"
        in_source = bool(self.editable_mode or self.inplace)
        folders = [target.parent] + ([source_dir] if in_source else [])
        archs_text = os.environ.get("SYMCOMM_CUDA_ARCHS", "").strip() or DEFAULT_ARCHS
        nvcc, where = find_nvcc()
        why_not = None
        if archs_text.lower() == "none":
            why_not = "SYMCOMM_CUDA_ARCHS=none at build time"
        elif nvcc is None:
            why_not = where
        if why_not is not None:
            if in_source:
                # A library from an earlier build must not outlive a build without one.
                for stale in source_dir.glob("libsymcomm*.so"):
                    stale.unlink()
            write_status(folders, {"built": False, "reason": why_not})
            log(f"native library NOT built: {why_not}. symcomm installs without its kernels; "
                "see docs/install.md")
            return
        archs = archs_text.split()
        started = time.perf_counter()
        log(f"nvcc {release(nvcc_version(nvcc))} from {where} ({nvcc}), {archs_text}")
        units = [ROOT / s for s in ext.sources]
        try:
            objects = compile_units(nvcc, units, [*FLAGS, *archs], CACHE, os.cpu_count() or 1)
        except CompileError as exc:
            print(exc, file=sys.stderr)
            raise SystemExit(f"symcomm build: csrc/ failed to compile with {nvcc}; fix it, or install "
                             "without the kernels (SYMCOMM_CUDA_ARCHS=none)") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        link(nvcc, objects, target)
        seconds = time.perf_counter() - started
        write_status(folders, {"built": True, "nvcc": nvcc, "found_in": where,
                               "nvcc_release": release(nvcc_version(nvcc)), "archs": archs_text,
                               "library": target.name, "seconds": round(seconds, 1)})
        log(f"native library built in {seconds:.1f} s: {target.name}")


if __name__ == "__main__":
    setup(
        # optional: an install without nvcc has no library to copy into an editable tree.
        ext_modules=[Extension("symcomm._native.libsymcomm", sources=SOURCES, optional=True)],
        cmdclass={"build_ext": NvccBuild},
    )
