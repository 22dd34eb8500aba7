"""csrc/symcomm.h and csrc/symcomm_testing.h against their ctypes twin, symcomm/_native.py.

A ctypes declaration that drifts from C does not fail loudly: a wrong integer width or a
missing argument passes garbage. So the header is parsed here and every function, argument,
return type and enum value is compared with the Python side, in both directions. CPU only.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from symcomm import _native
from symcomm.errors import CudaError

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "symcomm.h"
TESTING_HEADER = ROOT / "csrc" / "symcomm_testing.h"
BUILT = sorted((ROOT / "symcomm" / "_native").glob("libsymcomm*.so"))
needs_library = pytest.mark.needs_native

_c = ctypes
# On LP64 Linux, ctypes makes size_t, uint64_t and uintptr_t one class (c_ulong), so those
# can stand in for each other unnoticed; they have the same width, so the ABI agrees anyway.
_SCALARS = {
    "int": _c.c_int, "size_t": _c.c_size_t, "uintptr_t": _c.c_size_t, "int64_t": _c.c_int64,
    "uint64_t": _c.c_uint64, "uint32_t": _c.c_uint32, "int32_t": _c.c_int32, "float": _c.c_float, "double": _c.c_double,
}


class Header(NamedTuple):
    functions: dict[str, tuple[list, object]]  # name -> (argtypes, restype), as ctypes types
    enums: dict[str, dict[str, int]]            # typedef name ("" for anonymous) -> values
    structs: dict[str, list[tuple[str, object]]]  # typedef name -> [(field, ctypes type)]


def _enum_values(body: str) -> dict[str, int]:
    values = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        name, _, value = (s.strip() for s in item.partition("="))
        assert value, f"enumerator {name} needs an explicit value (it is ABI)"
        values[name] = int(value.strip("()"), 0)
    return values


def parse_header(text: str) -> Header:
    """One header's declarations. A struct type in a signature is matched by name with
    _native.STRUCTS (its fields are compared separately, in test_structs_match_the_header)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    text = text.replace('extern "C" {', " ")

    enums: dict[str, dict[str, int]] = {}
    enum_re = r"(typedef\s+)?enum\s*\{(.*?)\}\s*(\w*)\s*;"
    for typedef, body, name in re.findall(enum_re, text, flags=re.S):
        enums.setdefault(name if typedef else "", {}).update(_enum_values(body))
    text = re.sub(enum_re, " ", text, flags=re.S)

    struct_bodies = dict((name, body) for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;",
                                                                   text, flags=re.S))
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    handles = set(re.findall(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;", text))
    aliases = dict((new, old) for old, new in re.findall(r"typedef\s+(\w+)\s+(\w+)\s*;", text))
    aliases.update((name, "int") for name in enums if name)
    text = re.sub(r"typedef[^;]*;", " ", text)

    def ctype(decl: str, is_return: bool = False):
        tokens = re.findall(r"\w+|\*", decl.replace("const", " "))
        if not is_return:
            assert len(tokens) >= 2 and tokens[-1] != "*", f"unnamed parameter {decl!r}"
            tokens = tokens[:-1]
        base, stars = aliases.get(tokens[0], tokens[0]), tokens.count("*")
        assert len(tokens) == 1 + stars, f"cannot read type {decl!r}"
        if base in handles or (base == "void" and stars):
            pointee, stars = _c.c_void_p, stars - (base == "void")
        elif base in struct_bodies:
            pointee = _native.STRUCTS[base]
        elif base == "char" and stars == 1:
            return _c.c_char_p
        elif base == "void" and is_return:
            return None
        elif base in _SCALARS:
            pointee = _SCALARS[base]
        else:
            raise AssertionError(f"no ctypes mapping for {decl!r}: extend _SCALARS")
        for _ in range(stars):
            pointee = _c.POINTER(pointee)
        return pointee

    structs = {name: [(field.split()[-1].lstrip("*"), ctype(field)) for field in map(str.strip, body.split(";"))
                      if field] for name, body in struct_bodies.items()}
    functions = {}
    for ret, name, params in re.findall(r"([\w\s\*]+?)\b(symcomm_\w+)\s*\(([^)]*)\)\s*;", text):
        params = params.strip()
        argtypes = [] if params in ("", "void") else [ctype(p) for p in params.split(",")]
        assert name not in functions, f"{name} declared twice"
        functions[name] = (argtypes, ctype(ret, is_return=True))
    return Header(functions, enums, structs)


def _name(t) -> str:
    return "void" if t is None else t.__name__


def compare(header: dict, table: dict) -> list[str]:
    """Every disagreement between two name -> (argtypes, restype) tables, as text."""
    problems = [f"{n}: in symcomm.h, missing from _native.SIGNATURES" for n in header.keys() - table.keys()]
    problems += [f"{n}: in _native.SIGNATURES, not declared in symcomm.h" for n in table.keys() - header.keys()]
    for name in sorted(header.keys() & table.keys()):
        (h_args, h_ret), (t_args, t_ret) = header[name], table[name]
        if len(h_args) != len(t_args):
            problems.append(f"{name}: {len(h_args)} arguments in symcomm.h, {len(t_args)} in ctypes")
        problems += [f"{name}: argument {i} is {_name(h)} in symcomm.h, {_name(t)} in ctypes"
                     for i, (h, t) in enumerate(zip(h_args, t_args)) if h is not t]
        if h_ret is not t_ret:
            problems.append(f"{name}: returns {_name(h_ret)} in symcomm.h, {_name(t_ret)} in ctypes")
    return sorted(problems)


@pytest.fixture(scope="module")
def header() -> Header:
    return parse_header(HEADER.read_text())


@pytest.fixture(scope="module")
def testing_header(header) -> Header:
    # The testing header includes symcomm.h; its own text is parsed with symcomm.h's types known.
    types = re.findall(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;|typedef[^;{]*;|typedef\s+enum\s*\{.*?\}\s*\w*\s*;",
                       re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S), flags=re.S)
    return parse_header("\n".join(types) + TESTING_HEADER.read_text())


def test_ctypes_table_matches_header(header):
    assert len(header.functions) >= 20  # the parser found the declarations at all
    assert compare(header.functions, _native.SIGNATURES) == []


def test_testing_table_matches_the_testing_header(testing_header):
    assert len(testing_header.functions) >= 8
    assert compare(testing_header.functions, _native.TESTING_SIGNATURES) == []


def test_structs_match_the_header(header):
    assert set(header.structs) == set(_native.STRUCTS) and header.structs
    for name, fields in header.structs.items():
        ours = [(f, t) for f, t in _native.STRUCTS[name]._fields_]
        assert [f for f, _ in fields] == [f for f, _ in ours], name
        for (field, theirs), (_, mine) in zip(fields, ours):
            assert theirs is mine or (theirs.__name__ == mine.__name__), f"{name}.{field}: {theirs} vs {mine}"


def test_abi_versions_agree():
    version = int(re.search(r"#define SYMCOMM_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
    assert version == _native.ABI_VERSION


def test_comparison_reports_each_kind_of_drift(header):
    table = dict(_native.SIGNATURES)
    args, ret = table.pop("symcomm_fp4_quantize")
    table["symcomm_not_in_header"] = ([], _c.c_int)
    table["symcomm_ar_run"] = (table["symcomm_ar_run"][0][:-1], _c.c_int)  # stream dropped
    table["symcomm_pool_add_region"] = ([_c.c_int, _c.c_int, _c.c_size_t], _c.c_int)  # base narrowed
    table["symcomm_pool_bytes_in_use"] = ([_c.c_int], _c.c_int)  # size_t result as int
    table["symcomm_ar_probe_read"] = ([_c.c_void_p, _c.POINTER(_c.c_uint64)], _c.c_int)  # wrong pointee
    problems = "\n".join(compare(header.functions, table))
    for name in ("symcomm_fp4_quantize", "symcomm_not_in_header", "symcomm_ar_run",
                 "symcomm_pool_add_region", "symcomm_pool_bytes_in_use", "symcomm_ar_probe_read"):
        assert name in problems


def test_comparison_sees_header_edits():
    text = HEADER.read_text()
    # symcomm_fp4_quantize's rows (argument 2) turned into an int: its declaration alone.
    start = text.index("symcomm_status_t symcomm_fp4_quantize(")
    end = text.index(";", start)
    edited = text[:start] + text[start:end].replace("int64_t rows", "int rows") + text[end:]
    assert edited != text
    problems = compare(parse_header(edited).functions, _native.SIGNATURES)
    assert any("symcomm_fp4_quantize" in p and "argument 2 is c_int in symcomm.h" in p for p in problems), problems


def test_enums_match_python(header):
    dtypes = {getattr(torch, name.removeprefix("SYMCOMM_").lower()): value
              for name, value in header.enums["symcomm_dtype_t"].items() if not name.endswith("_MAX_ENUM")}
    assert dtypes == _native.DTYPE_CODES
    assert header.enums[""]["SYMCOMM_SUCCESS"] == _native.SUCCESS
    from symcomm.backends import custom_ar
    algos = {name.removeprefix("SYMCOMM_AR_").lower(): value
             for name, value in header.enums["symcomm_ar_algo_t"].items() if not name.endswith("_MAX_ENUM")}
    assert algos == {name.removeprefix("custom-"): value for name, value in custom_ar.ALGO_CODES.items()}


def test_header_is_self_contained_c():
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)', HEADER.read_text(), flags=re.M)
    assert sorted(includes) == ["stddef.h", "stdint.h"]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    for header_file in (HEADER, TESTING_HEADER):
        result = subprocess.run([cc, "-std=c99", "-pedantic", "-Wall", "-Werror", "-fsyntax-only", "-x", "c",
                                 "-I", str(HEADER.parent), str(header_file)], capture_output=True, text=True)
        assert result.returncode == 0, f"{header_file.name}: {result.stderr}"


@needs_library
def test_library_exports_exactly_the_header(header, testing_header):
    lib = ctypes.CDLL(str(BUILT[0]))
    declared = {**header.functions, **testing_header.functions}
    for name in declared:
        assert hasattr(lib, name), f"{BUILT[0].name} does not export {name}"
    assert lib.symcomm_abi_version() == _native.ABI_VERSION
    nm = shutil.which("nm")
    if nm is not None:  # the other direction: nothing exported that the header does not declare
        out = subprocess.run([nm, "-D", "--defined-only", str(BUILT[0])], capture_output=True, text=True).stdout
        exported = set(re.findall(r"\bT\s+(symcomm_\w+)$", out, flags=re.M))
        assert exported == set(declared)


@needs_library
def test_check_raises_with_the_library_text():
    lib = _native.load().lib
    _native.check(lib, "nothing", 0)
    with pytest.raises(CudaError, match="invalid argument") as info:
        _native.check(lib, "symcomm_fp4_quantize", 1)
    assert info.value.code == 1 and info.value.what == "symcomm_fp4_quantize"
    with pytest.raises(CudaError, match="unaligned region"):
        _native.check(lib, "symcomm_pool_add_region", -1)
