"""setup.py's build logic on CPU, with a stand-in nvcc: where nvcc is looked for, the object
cache's key (a header change recompiles its includers only), the slowest-first order, a failed
unit failing the build, and an install without nvcc recording why."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


FAKE_NVCC = """#!{python}
import sys, time
args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 13.0, V13.0.88")
    sys.exit(0)
unit, out = args[args.index("-c") + 1], args[args.index("-o") + 1]
with open("{log}", "a") as log:
    log.write(unit + "\\n")
if "bad" in unit:
    print(unit + "(1): error: this unit does not compile")
    sys.exit(1)
time.sleep(0.2)
open(out, "w").write("object of " + unit)
"""


@pytest.fixture
def fake(tmp_path, setup_py, monkeypatch):
    """A csrc/ of three units and a header, and an nvcc that logs what it compiles."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "shared.cuh").write_text("// shared\n")
    (csrc / "a.cu").write_text('#include "shared.cuh"\n')
    (csrc / "b.cu").write_text("// no includes\n")
    (csrc / "c.cc").write_text('#include "shared.cuh"\n')
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    log = tmp_path / "compiled.log"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable, log=log))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(setup_py, "CSRC", csrc)
    monkeypatch.setattr(setup_py, "ROOT", tmp_path)

    def compiled() -> list[str]:
        names = [Path(line).name for line in log.read_text().split()] if log.exists() else []
        log.unlink(missing_ok=True)
        return sorted(names)
    return setup_py, csrc, str(nvcc), tmp_path / "cache", compiled


def test_units_compile_once_and_a_header_change_recompiles_its_includers(fake):
    setup_py, csrc, nvcc, cache, compiled = fake
    units = sorted(csrc.glob("*.c[cu]"))
    objects = setup_py.compile_units(nvcc, units, ["-O3"], cache, jobs=3)
    assert [o.read_text() for o in objects] == [f"object of {u}" for u in units]
    assert compiled() == ["a.cu", "b.cu", "c.cc"]
    assert setup_py.compile_units(nvcc, units, ["-O3"], cache, jobs=3) == objects
    assert compiled() == []  # warm: everything from the cache
    (csrc / "shared.cuh").write_text("// shared, changed\n")
    setup_py.compile_units(nvcc, units, ["-O3"], cache, jobs=3)
    assert compiled() == ["a.cu", "c.cc"]
    setup_py.compile_units(nvcc, units, ["-O2"], cache, jobs=3)
    assert compiled() == ["a.cu", "b.cu", "c.cc"]  # other flags: other objects
    # one object per unit stays in the cache
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.o")) == ["a.cu", "b.cu", "c.cc"]


def test_a_unit_that_fails_fails_the_build_with_its_output(fake):
    setup_py, csrc, nvcc, cache, compiled = fake
    (csrc / "bad.cu").write_text("// broken\n")
    with pytest.raises(setup_py.CompileError, match=r"bad.cu failed to compile:\n.*does not compile"):
        setup_py.compile_units(nvcc, sorted(csrc.glob("*.c[cu]")), ["-O3"], cache, jobs=1)
    assert not list(cache.glob("bad.cu-*"))


def test_headers_are_followed_through_includes(fake):
    setup_py, csrc, *_ = fake
    (csrc / "outer.cuh").write_text('#include "shared.cuh"\n#include <cuda.h>\n')
    (csrc / "d.cu").write_text('#include "outer.cuh"\n')
    assert [p.name for p in setup_py.local_headers(csrc / "d.cu")] == ["outer.cuh", "shared.cuh"]


def test_the_slowest_unit_starts_first(setup_py):
    units = [ROOT / "csrc" / name for name in ("pool_alloc.cc", "fp4.cu", "ep.cu", "rmsnorm.cu")]
    assert [u.name for u in setup_py.build_order(units)] == ["rmsnorm.cu", "ep.cu", "fp4.cu", "pool_alloc.cc"]


def test_nvcc_is_found_in_cuda_home_on_path_or_in_nvidias_wheel(setup_py, tmp_path, monkeypatch):
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.setattr(setup_py, "DEFAULT_TOOLKIT", tmp_path / "no-toolkit")
    nvcc, why = setup_py.find_nvcc()
    assert nvcc is None and "nvcc not found" in why
    wheel = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc"
    wheel.parent.mkdir(parents=True)
    wheel.write_text("")
    assert setup_py.find_nvcc() == (str(wheel), "the nvidia-cuda-nvcc wheel")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert setup_py.find_nvcc() == (str(home / "bin" / "nvcc"), "$CUDA_HOME")


def test_nvcc_is_found_in_the_default_toolkit_when_nothing_names_one(setup_py, tmp_path, monkeypatch):
    """NVIDIA's installers put the toolkit in /usr/local/cuda without touching PATH: an install
    there must build the kernels, unless CUDA_HOME or CUDA_PATH names another toolkit."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    toolkit = tmp_path / "usr-local-cuda"
    monkeypatch.setattr(setup_py, "DEFAULT_TOOLKIT", toolkit)
    nvcc, why = setup_py.find_nvcc()
    assert nvcc is None and f"in {toolkit / 'bin'}" in why
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("")
    assert setup_py.find_nvcc() == (str(toolkit / "bin" / "nvcc"), str(toolkit / "bin"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "another-cuda"))
    nvcc, why = setup_py.find_nvcc()
    assert nvcc is None and "nvcc not found" in why and str(toolkit) not in why


def test_the_default_toolkit_is_where_nvidias_installers_put_it(setup_py):
    assert setup_py.DEFAULT_TOOLKIT == Path("/usr/local/cuda")


def test_the_release_is_read_from_nvcc_version(setup_py):
    text = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
    assert setup_py.release(text) == "13.0.88"
    assert setup_py.release("something else") == "unknown"


def test_an_install_without_nvcc_records_why(tmp_path, monkeypatch):
    """pip install of a copy of the package with nvcc hidden: it succeeds, builds no library
    and writes the reason where `python -m symcomm` reads it."""
    import shutil
    import subprocess

    copy = tmp_path / "src"
    top_level_only = {".git", "build", ".ci-venv", "bench", "tests", "examples", "docs", "scripts"}

    def skipped(folder: str, names: list[str]) -> set[str]:
        here = {n for n in names if n.endswith((".so", ".egg-info")) or n in ("__pycache__", "build.json")}
        return here | (top_level_only & set(names) if Path(folder) == ROOT else set())
    shutil.copytree(ROOT, copy, ignore=skipped)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    # A CUDA_HOME without nvcc also stops the guess at /usr/local/cuda, which a machine with a
    # toolkit has whatever PATH says.
    env["CUDA_HOME"] = str(tmp_path / "no-toolkit")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(copy)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    import zipfile

    wheel = next((tmp_path / "dist").glob("symcomm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".so")]
    record = json.loads(zipfile.ZipFile(wheel).read("symcomm/_native/build.json"))
    assert record["built"] is False and "nvcc not found" in record["reason"]
    # Every module of the package is in the wheel: a package left out of pyproject's list
    # breaks every install but an editable one.
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "symcomm").rglob("*.py")}
    assert modules - set(names) == set()
