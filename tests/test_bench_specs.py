"""symcomm.bench's op specs: one per Communicator collective, their sizes and bus factors, and
static guards that keep per-op branching out of the harness.

The specs tell ops apart by their type and fields; no module compares an op's name, so the
scan below exempts none.
"""
import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import symcomm
from symcomm.bench import ops
from symcomm.bench.config import BenchError
from symcomm.operations import OPERATIONS
from symcomm.bench.spec import Buffers

BENCH = Path(ops.__file__).resolve().parent
ALL_REDUCES = ("all_reduce", "all_reduce_rmsnorm")  # every rank holds the whole message
TWO_WAY = ("moe",)  # rows go out (dispatch) and come back (combine): twice a one-way share
SPEC_MODULES = ("spec", "collectives", "torch_symm", "fp4_spec", "norm_spec", "moe_spec", "ops")
# What runs the specs; a spec module importing one of these would put op knowledge back there.
CONSUMERS = ("runner", "report", "tune", "baseline", "cli", "plot", "timing", "device")


def communicator_collectives() -> set[str]:
    """Every operation a Communicator runs (symcomm.operations.OPERATIONS), each with its method."""
    names = {op.name for op in OPERATIONS}
    assert all(inspect.isfunction(getattr(symcomm.Communicator, name)) for name in names)
    return names


def _named_spec(reference: str):
    module, attr = reference.split(":")
    return getattr(importlib.import_module(module), attr)


def test_every_communicator_collective_has_exactly_one_spec():
    """Each operation's descriptor names its spec (``bench``), and every spec is some operation's:
    moe_dispatch and moe_combine share one (a step is both), all_to_allv is measured inside it."""
    covered = {}
    for op in OPERATIONS:
        assert op.name in communicator_collectives()
        if op.bench is not None:
            covered[op.name] = _named_spec(op.bench)
    assert {op.name for op in OPERATIONS} - set(covered) == {"all_to_allv"}
    assert {id(spec) for spec in covered.values()} == set(map(id, ops.SPECS.values()))
    assert all(ops.spec(name).name == name for name in ops.NAMES)
    assert len(set(map(id, ops.SPECS.values()))) == len(ops.NAMES)


def test_unknown_op_is_a_value_error():
    with pytest.raises(ValueError, match="unknown op 'broadcastish'"):
        ops.spec("broadcastish")


@pytest.mark.parametrize("name", ops.NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_bus_factor_is_nccl_tests(name, world):
    link_share = (world - 1) / world
    expected = 2 * link_share if name in ALL_REDUCES + TWO_WAY else link_share
    assert ops.spec(name).bus_factor(world) == pytest.approx(expected)


# (op, message bytes, itemsize, world) -> (size column, count column): nccl-tests' rounding to
# whole elements per rank; even splits count per rank, uneven ones count every rank's elements.
SIZES = [
    ("all_reduce", 1000, 4, 3, 1000, 250),
    ("all_reduce", 1024, 2, 8, 1024, 512),
    ("all_reduce", 7, 4, 2, 4, 1),
    ("all_gather", 1000, 4, 3, 996, 83),
    ("all_gather", 1024, 4, 4, 1024, 64),
    ("reduce_scatter", 1000, 4, 3, 996, 83),
    ("reduce_scatter", 65536, 2, 8, 65536, 4096),
    # 16-byte rows: 1000 B of float is 62 rows of 4, split 10/20/32 -> 248 elements
    ("all_gatherv", 1000, 4, 3, 992, 248),
    ("all_gatherv", 65536, 2, 4, 65536, 32768),
    ("reduce_scatterv", 1000, 4, 3, 992, 248),
    ("reduce_scatterv", 4096, 8, 2, 4096, 512),
    # 512-element rows: under one row is an empty message, one row goes to the last rank
    ("all_gatherv_fp4", 1000, 4, 2, 0, 0),
    ("all_gatherv_fp4", 1024, 2, 2, 1024, 512),
    ("all_gatherv_fp4", 65536, 4, 4, 65536, 16384),
    # whole tokens of 8192 values: under one token is an empty message
    ("all_reduce_rmsnorm", 3 * 16384 + 5, 2, 4, 3 * 16384, 3 * 8192),
    ("all_reduce_rmsnorm", 16383, 2, 2, 0, 0),
]


@pytest.mark.parametrize("name,nbytes,itemsize,world,size,count", SIZES)
def test_size_and_count_columns(name, nbytes, itemsize, world, size, count):
    spec = ops.spec(name)
    for rank in range(world):
        lay = spec.layout(nbytes, world, itemsize, rank)
        assert (lay.nbytes, lay.count) == (size, count)
        assert lay.total * itemsize == (size if name not in ALL_REDUCES else size * world)
        mine, everything = lay.parts[rank], lay.total
        if name in ALL_REDUCES:
            assert (lay.in_elems, lay.out_elems) == (count, count)
        elif spec.reduces:
            assert (lay.in_elems, lay.out_elems) == (everything, mine)
        else:
            assert (lay.in_elems, lay.out_elems) == (mine, everything)


@pytest.mark.parametrize("name", ops.NAMES)
def test_in_place_aliases_as_nccl_tests(name):
    if name in TWO_WAY:
        pytest.skip("moe has no in-place form (its cases give every in-place column N/A)")
    spec, world, rank = ops.spec(name), 4, 2
    lay = spec.layout(64 * 1024, world, 4, rank)
    bufs = Buffers(torch.zeros(lay.in_elems + 8), torch.zeros(lay.out_elems + 8), False)
    x, out = spec.views(lay, bufs, rank, inplace=True)
    own = lay.offset(rank) * 4  # bytes from the start of the full tensor to this rank's part
    if name == "all_reduce_rmsnorm":  # in place is the residual's: x and y never alias
        assert x.data_ptr() != out.data_ptr() and x.numel() == out.numel() == lay.count
    elif name == "all_reduce":
        assert x.data_ptr() == out.data_ptr() and x.numel() == out.numel() == lay.count
    elif spec.reduces:  # the output is the rank's slice of the input
        assert out.data_ptr() == x.data_ptr() + own and out.numel() == lay.parts[rank]
    else:  # the input is the rank's slice of the output
        assert x.data_ptr() == out.data_ptr() + own and x.numel() == lay.parts[rank]
    x, out = spec.views(lay, bufs, rank, inplace=False)
    assert x.data_ptr() == bufs.send.data_ptr() and out.data_ptr() == bufs.recv.data_ptr()


@pytest.mark.parametrize("name", ops.NAMES)
def test_labels(name):
    if name == "all_reduce_rmsnorm":  # it sums: another reduction is refused rather than labelled
        assert ops.spec(name).labels("bfloat16", "sum") == ("bfloat16", "sum", -1)
        with pytest.raises(BenchError, match="-o takes only sum"):
            ops.spec(name).labels("bfloat16", "max")
        return
    labels = ops.spec(name).labels("bfloat16", "max")
    assert labels == ("bfloat16", "max" if ops.spec(name).reduces else "none", -1)


def test_only_the_fp4_gather_the_norm_and_moe_have_variant_columns():
    assert {n: ops.spec(n).variants for n in ops.NAMES if ops.spec(n).variants} == {
        "all_gatherv_fp4": ("unquantized", "fp4", "fp4+dequant"),
        "all_reduce_rmsnorm": ("nccl+torch", "symm_mem+torch", "unfused", "auto", "auto+fp8", "auto+nvfp4"),
        "moe": ("all_to_all_single", "a2a-buckets", "a2a", "a2a+nvfp4", "peer-push", "peer-push+nvfp4", "peer-push+fp8",
                "peer-push:dispatch", "peer-push+nvfp4:dispatch")}


# -- static guards ------------------------------------------------------------------------------
def op_name_comparisons(source: str, names: set[str], aliases: set[str]) -> list[int]:
    """Lines that compare something with an op name: a literal, a literal collection holding
    one, or a name in ``aliases`` (constants bound to those, such as GATHER_OPS); ``match``
    cases on op names count too."""

    def names_an_op(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_an_op(e) for e in node.elts)
        if isinstance(node, ast.Name):
            return node.id in aliases
        if isinstance(node, ast.Attribute):
            return node.attr in aliases
        return False

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(names_an_op, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and names_an_op(node.value):
            lines.append(node.lineno)
    return sorted(lines)


def op_name_constants(source: str, names: set[str]) -> set[str]:
    """Module-level names bound to an op name or to a literal collection holding one."""
    found = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        holds = isinstance(value, ast.Constant) and value.value in names or \
            isinstance(value, (ast.Tuple, ast.List, ast.Set)) and any(
                isinstance(e, ast.Constant) and e.value in names for e in value.elts)
        if holds:
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def bench_sources() -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(BENCH.glob("*.py"))}


def test_the_scan_finds_per_op_branches():
    names = {"all_reduce", "all_gather"}
    src = ('GATHERS = ("all_gather", "x")\nFP4 = "all_gather"\n'
           'if op == "all_reduce": pass\n'
           'if op in GATHERS: pass\n'
           'if lay.op in ("x", "all_gather"): pass\n'
           'if op != sizes.FP4: pass\n'
           'match op:\n    case "all_reduce": pass\n'
           'if algo == "auto" or op == other: pass\n')
    aliases = op_name_constants(src, names)
    assert aliases == {"GATHERS", "FP4"}
    assert op_name_comparisons(src, names, aliases) == [3, 4, 5, 6, 8]


def test_no_module_branches_on_an_op_name():
    names = set(ops.NAMES)
    sources = bench_sources()
    aliases = set().union(*(op_name_constants(src, names) for src in sources.values()))
    found = {f"{module}.py:{line}" for module, src in sources.items()
             for line in op_name_comparisons(src, names, aliases)}
    assert not found, "per-op branch; put what differs into the op's spec instead: " + ", ".join(sorted(found))


def bench_imports() -> dict[str, set[str]]:
    """Bench module -> the bench modules it imports anywhere, function bodies included."""
    sources = bench_sources()
    graph = {}
    for module, src in sources.items():
        deps = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("symcomm.bench."):
                deps.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("symcomm.bench.")}
        graph[module] = {d for d in deps if d in sources} - {module}
    return graph


def test_bench_imports_form_a_dag_with_the_specs_below_their_users():
    graph = bench_imports()
    order: list[str] = []
    pending = dict(graph)
    while pending:
        ready = [m for m, deps in pending.items() if deps <= set(order)]
        assert ready, f"import cycle among {sorted(pending)}"
        order += sorted(ready)
        for m in ready:
            del pending[m]

    def reaches(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    for module in SPEC_MODULES:
        assert not reaches(module) & set(CONSUMERS), module


def test_bench_never_touches_the_environment():
    for module, src in bench_sources().items():
        tree = ast.parse(src)
        touched = [n.lineno for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "putenv")]
        assert not touched, f"{module}.py:{touched}: go through symcomm.settings"


def test_pool_reservation_counts_the_allocators_segments():
    """torch's caching allocator takes 2 MiB segments for tensors up to 1 MiB, 20 MiB below
    10 MiB, and rounds larger ones to 2 MiB: the bench's pool must hold each buffer's segment
    (a 1.75 MiB send buffer beside a 44 MiB receive one once overflowed a pool sized by bytes)."""
    from symcomm.bench.runner import pool_bytes
    from symcomm.pool import segment_bytes
    mib = 1 << 20
    assert [segment_bytes(n) for n in (1, mib, mib + 1, 10 * mib - 1, 10 * mib, 10 * mib + 1)] == [
        2 * mib, 2 * mib, 20 * mib, 20 * mib, 10 * mib, 12 * mib]
    send, recv = int(1.75 * mib), int(43.77 * mib)
    assert pool_bytes([send, recv]) >= 20 * mib + 44 * mib
