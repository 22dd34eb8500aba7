"""The validated settings of one benchmark run, shared by the CLI and the runner.

Plain data with no imports from the rest of the bench, so that every module (the op specs
included) can depend on it.
"""
from __future__ import annotations

from typing import Any

import re
from dataclasses import dataclass, field

# --algo takes any path name (or a comma-separated list of them and of the op's comparison
# columns): the set (nccl, nccl-symm, torch, custom-*) depends on the build and the machine, so
# the runner checks each against the communicator's algorithms(). This only rejects what cannot
# be a name at all.
ALGO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# What `tune` measures; the even ops also yield their in-place columns ("all_reduce:inplace", ...),
# recorded beside the out-of-place ones that rank the op's row.
# The v-variants are measured with the benchmark's uneven split (sizes.Rows), so that
# their rows rank the paths that serve uneven counts (custom-push, one-shot, NCCL's schedules)
# as DP attention uses them; without such a row they fall back to the even op's.
TUNE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_gatherv", "reduce_scatterv")
REDOPS = ("sum", "prod", "max", "min", "avg")

# nccl-tests' -d names (and common aliases) -> (name printed in the table, torch dtype attribute).
DATATYPES: dict[str, tuple[str, str]] = {
    "int8": ("int8", "int8"), "char": ("int8", "int8"),
    "uint8": ("uint8", "uint8"),
    "int32": ("int32", "int32"), "int": ("int32", "int32"),
    "int64": ("int64", "int64"),
    "half": ("half", "float16"), "float16": ("half", "float16"), "fp16": ("half", "float16"),
    "float": ("float", "float32"), "float32": ("float", "float32"), "fp32": ("float", "float32"),
    "double": ("double", "float64"), "float64": ("double", "float64"),
    "bfloat16": ("bfloat16", "bfloat16"), "bf16": ("bfloat16", "bfloat16"),
    "f8e4m3": ("f8e4m3", "float8_e4m3fn"), "fp8_e4m3": ("f8e4m3", "float8_e4m3fn"),
    "f8e5m2": ("f8e5m2", "float8_e5m2"), "fp8_e5m2": ("f8e5m2", "float8_e5m2"),
}

FLOAT_TYPES = ("half", "float", "double", "bfloat16", "f8e4m3", "f8e5m2")


class BenchError(Exception):
    """A problem with what was asked for; reported as one line, exit status 2.

    Usually every rank hits it alike and rank 0 alone reports it; ``every_rank`` marks the
    problems that only some ranks see, which those ranks report themselves.
    """

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


@dataclass
class BenchConfig:
    op: str
    sizes: list[int]
    minbytes: int
    maxbytes: int
    stepfactor: int
    iters: int
    warmup: int
    check: bool
    graph: int
    datatype: str            # key of DATATYPES
    redop: str
    algo: str
    symmetric: bool | None   # None: on for cuda, off for cpu
    json_path: str | None
    device: str              # "cpu" or "cuda", resolved (never "auto")
    seed: int = 0
    corrupt_rank: int | None = None  # SYMCOMM_BENCH_CORRUPT: this rank spoils one output element
    notes: list[str] = field(default_factory=list)  # preamble lines, before the runner's own
    plot_path: str | None = None
    rounds: int = 1          # -R: interleaved passes over the paths; the median time is reported
    with_auto: bool = True   # "--algo all" measures auto too; tune measures concrete paths only
    with_comparisons: bool = True  # "--algo all" adds the op's comparison columns; tune never does
    command: str = ""        # the command line, for records (tuning files)
    baseline: str | None = None  # --baseline: a `symcomm-bench baseline` file to compare with
    extension: Any = None    # --with: ops.Extension, whose operations and paths the communicator adds
    graph_communicators: bool = False  # --graph-communicators: the Communicator option of that name
    options: dict[str, int] = field(default_factory=dict)  # the op's shape flags (--hidden, --topk, ...)

    @property
    def type_name(self) -> str:
        return DATATYPES[self.datatype][0]

    @property
    def torch_dtype_name(self) -> str:
        return DATATYPES[self.datatype][1]


@dataclass
class TuneConfig(BenchConfig):
    """``symcomm-bench tune``: a sweep of every path over TUNE_OPS that ends in a tuning file."""

    output: str | None = None  # None: <gpu>_w<world>.json in the working directory


@dataclass
class BaselineConfig(BenchConfig):
    """``symcomm-bench baseline``: the op's own NCCL collective on a raw communicator, the only
    NCCL communicator in the process, once per buffer mode."""
