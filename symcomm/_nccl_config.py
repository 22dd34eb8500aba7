"""ncclConfig_t in the layout of the loaded NCCL, and the version-dependent features symcomm uses.

NCCL's communicator configuration is a C struct that grows at its end from release to release.
A program compiled against one release's ``nccl.h`` passes ``size``, ``magic`` and ``version``
from that header's ``NCCL_CONFIG_INITIALIZER``; the library copies ``min(size, its own sizeof)``
bytes and, for every field newer than ``version``, puts its own default back (NCCL's
``parseCommConfig``, init.cc, the same from v2.17.1-1 to v2.30.7-1). ctypes has no header, so this module
writes each layout down (:data:`_STEPS`) and builds the one a program compiled against that
release would pass: the layout of the newest release here that is not newer than the loaded
one, stamped with that release's version code. Stamping the release the layout came from, not
the loaded version, is what makes it safe: bytes of struct padding past our last field are then
never read as a field that NCCL added later (2.30.3's ``sizeof`` is already 96, the end of
2.30.7's ``graphStreamOrdering``).

A loaded NCCL newer than every release here gets the newest layout under that same rule, which
is exactly an older program running on a newer library: the case the size/version fields exist
for. A major version other than 2 gets no layout (no such promise was made for it), nor does
anything before 2.27.3, the oldest header here.
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, fields
from typing import Any

from .errors import ArgumentError

Version = tuple[int, int, int]

UNDEF_INT = -(2 ** 31)   # NCCL_CONFIG_UNDEF_INT (INT_MIN): "NCCL picks"
API_MAGIC = 0xCAFEBEEF   # NCCL_API_MAGIC; NCCL refuses a config whose magic differs
SPLIT_NOCOLOR = -1       # NCCL_SPLIT_NOCOLOR: this rank joins no child communicator

# Each step: the first release whose header has the fields, and the fields it appended. Read
# from src/nccl.h.in at NVIDIA/nccl's release tags v2.27.3-1 .. v2.30.7-1; 2.31.2 and 2.32.3 from
# the nccl.h inside NVIDIA's nvidia-nccl-cu13 wheels of those versions (the repository snapshot
# ends at 2.31.0a7, which still has 2.30.7's layout). tests/golden/nccl_config_layouts.json holds
# the offsets a C compiler gives every release header (scripts/nccl_config_layout.py).
_STEPS: tuple[tuple[Version, tuple[str, ...]], ...] = (
    ((2, 27, 3), ("size", "magic", "version", "blocking", "cgaClusterSize", "minCTAs", "maxCTAs",
                  "netName", "splitShare", "trafficClass", "commName", "collnetEnable", "CTAPolicy",
                  "shrinkShare", "nvlsCTAs")),
    ((2, 28, 3), ("nChannelsPerNetPeer", "nvlinkCentricSched")),
    ((2, 29, 2), ("graphUsageMode", "numRmaCtx")),
    ((2, 30, 3), ("maxP2pPeers",)),
    ((2, 30, 7), ("graphStreamOrdering",)),
    ((2, 31, 2), ("launchOrderImplicit", "numRmaSig", "rmaEagerInit", "hostCftMode")),
    ((2, 32, 3), ("nvlsHostMode",)),
)
_C_TYPES = {"size": ctypes.c_size_t, "magic": ctypes.c_uint, "version": ctypes.c_uint,
            "netName": ctypes.c_void_p, "commName": ctypes.c_void_p}


def version_code(version: Version) -> int:
    """NCCL_VERSION(X, Y, Z): the encoding changed after 2.8."""
    major, minor, patch = version
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def _version_text(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class ConfigLayout:
    """One release's ncclConfig_t: its C field names in order and a ctypes struct for them."""

    release: Version               # the release whose header this layout is
    field_names: tuple[str, ...]
    struct: type[ctypes.Structure]
    newer_than_known: bool = False  # the loaded NCCL is newer than every release here


def _make_layouts() -> tuple[ConfigLayout, ...]:
    built, names = [], ()
    for release, added in _STEPS:
        names = names + added
        struct = type(f"ncclConfig_{version_code(release)}", (ctypes.Structure,),
                      {"_fields_": [(n, _C_TYPES.get(n, ctypes.c_int)) for n in names]})
        built.append(ConfigLayout(release, names, struct))
    return tuple(built)


LAYOUTS: tuple[ConfigLayout, ...] = _make_layouts()
_FIRST_RELEASE: dict[str, Version] = {n: release for release, added in _STEPS for n in added}


def layout_for(version: Version) -> ConfigLayout | None:
    """The layout a config for NCCL ``version`` is built in, or None where there is none."""
    if version[0] != 2 or version < LAYOUTS[0].release:
        return None
    chosen = [layout for layout in LAYOUTS if layout.release <= version][-1]
    if chosen is LAYOUTS[-1] and version > chosen.release:
        return ConfigLayout(chosen.release, chosen.field_names, chosen.struct, newer_than_known=True)
    return chosen


class GraphUsage(enum.IntEnum):
    """ncclConfig_t.graphUsageMode (NCCL >= 2.29.2): how CUDA graphs use the communicator."""

    NONE = 0       # never captured
    ONE_GRAPH = 1  # captured into one graph, never run eagerly
    MIXED = 2      # NCCL's default: several graphs, or graphs and eager calls (pays graph mixing)


# Python name -> (C name, kind). "bool" fields take True/False, "count" fields a positive int.
_CONFIG_FIELDS: dict[str, tuple[str, str]] = {
    "blocking": ("blocking", "bool"),
    "cga_cluster_size": ("cgaClusterSize", "non-negative"),
    "min_ctas": ("minCTAs", "count"),
    "max_ctas": ("maxCTAs", "count"),
    "split_share": ("splitShare", "bool"),
    "cta_policy": ("CTAPolicy", "non-negative"),
    "nvls_ctas": ("nvlsCTAs", "count"),
    "graph_usage_mode": ("graphUsageMode", "graph-usage"),
    "graph_stream_ordering": ("graphStreamOrdering", "bool"),
    "nvls_host_mode": ("nvlsHostMode", "int"),
}


@dataclass(frozen=True)
class CommConfig:
    """The ncclConfig_t fields symcomm sets, each None for "NCCL picks".

    ``split_share`` matters on the *parent*: ncclCommSplit shares the parent's buffers and proxy
    with the child when the parent was created with ``split_share=True`` (NCCL reads the
    parent's flag, in NCCL's ``ncclCommInitChildComm``). ``blocking=False`` makes init
    return at once; :meth:`symcomm._nccl.Library.comm_wait_ready` then waits, bounded.
    ``netName`` and ``commName`` are left out on purpose: NCCL keeps those pointers past the
    call, which a ctypes buffer would not outlive.

    Invalid values raise ArgumentError here, before any communication; a field the loaded
    NCCL's layout lacks raises when the struct is built (:meth:`build`).
    """

    blocking: bool | None = None
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    split_share: bool | None = None
    cta_policy: int | None = None
    nvls_ctas: int | None = None
    graph_usage_mode: GraphUsage | int | None = None
    graph_stream_ordering: bool | None = None
    nvls_host_mode: int | None = None

    def __post_init__(self) -> None:
        for name, (_, kind) in _CONFIG_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if kind == "bool":
                if not isinstance(value, bool):
                    raise ArgumentError(f"CommConfig.{name} must be True, False or None, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentError(f"CommConfig.{name} must be an int or None, got {value!r}")
            if kind == "count" and value < 1:
                raise ArgumentError(f"CommConfig.{name} must be at least 1, got {value}")
            if kind == "non-negative" and value < 0:
                raise ArgumentError(f"CommConfig.{name} must be >= 0, got {value}")
            if kind == "graph-usage" and value not in tuple(GraphUsage):
                raise ArgumentError(f"CommConfig.{name} must be one of "
                                    f"{', '.join(f'{m.value} ({m.name})' for m in GraphUsage)}, got {value}")
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ArgumentError(f"CommConfig.min_ctas ({self.min_ctas}) must not exceed max_ctas ({self.max_ctas})")
        # NCCL would warn and quietly turn the ordering back on (parseCommConfig, v2.30.7-1).
        if self.graph_stream_ordering is False and self.graph_usage_mode in (None, GraphUsage.MIXED):
            raise ArgumentError("CommConfig.graph_stream_ordering=False needs graph_usage_mode NONE or "
                                "ONE_GRAPH: NCCL does not support it with graph mixing (its default)")

    def c_fields(self) -> dict[str, int]:
        """The fields that are set, by their C name."""
        return {c_name: int(getattr(self, name)) for name, (c_name, _) in _CONFIG_FIELDS.items()
                if getattr(self, name) is not None}

    def build(self, version: Version) -> ctypes.Structure:
        """The ncclConfig_t to pass to NCCL ``version``: NCCL_CONFIG_INITIALIZER of the layout's
        release, then the fields that are set. ArgumentError names a field that NCCL lacks."""
        layout = layout_for(version)
        if layout is None:
            raise ArgumentError(f"a CommConfig needs NCCL 2.x >= {_version_text(LAYOUTS[0].release)} "
                                f"(the oldest ncclConfig_t layout symcomm knows); the loaded NCCL is "
                                f"{_version_text(version)}")
        struct = layout.struct()
        for name in layout.field_names:
            if name not in _C_TYPES:  # an int field; the pointers stay NULL (NCCL_CONFIG_UNDEF_PTR)
                setattr(struct, name, UNDEF_INT)
        struct.size = ctypes.sizeof(layout.struct)
        struct.magic = API_MAGIC
        struct.version = version_code(layout.release)
        missing = [c for c in self.c_fields() if c not in layout.field_names]
        if missing:
            py_names = {c: n for n, (c, _) in _CONFIG_FIELDS.items()}
            raise ArgumentError("; ".join(
                f"CommConfig.{py_names[c]} needs NCCL >= {_version_text(_FIRST_RELEASE[c])} (ncclConfig_t "
                f"gained {c} there); the loaded NCCL is {_version_text(version)}" for c in missing))
        for c_name, value in self.c_fields().items():
            setattr(struct, c_name, value)
        return struct

    def __repr__(self) -> str:
        set_fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                               if getattr(self, f.name) is not None)
        return f"CommConfig({set_fields})"


# Behaviour that changed between releases, each with the first release that has it and where
# that was read (NVIDIA/nccl release tags; 2.31.2 from its wheel's nccl.h). A feature that is a
# function of the library also needs its symbol (FEATURE_SYMBOLS).
FEATURES: dict[str, tuple[Version, str]] = {
    "graph_usage_mode": ((2, 29, 2), "ncclConfig_t.graphUsageMode appears in v2.29.2-1's nccl.h.in"),
    "abortable_symmetric_kernels": ((2, 29, 7), ("v2.29.7-1: ncclDevComm gains abortFlag and the LSA "
                                                "barrier's waits test it (lsa_barrier__funcs.h)")),
    "comm_mem_stats": ((2, 29, 7), "ncclCommMemStats and ncclCommSuspend/Resume appear in v2.29.7-1"),
    "window_register_in_capture": ((2, 30, 7), ("v2.30.7-1: window registration switches its thread to "
                                               "cudaStreamCaptureModeRelaxed (dev_runtime.cc)")),
    "uneven_windows": ((2, 30, 7), ("v2.30.7-1: a window's VA span is the largest rank's size "
                                   "(lsaMaxSize, 'to support asymmetric sizes', dev_runtime.cc)")),
    "pdl_safe_symmetric_kernels": ((2, 30, 7), ("v2.30.7-1's symmetric kernels start with "
                                               "cudaGridDependencySynchronize (their generator, generate.py); "
                                               "v2.27.x had it, v2.28.3-1..v2.30.4-1 do not")),
    "graph_stream_ordering": ((2, 30, 7), "ncclConfig_t.graphStreamOrdering appears in v2.30.7-1"),
    "coll_config": ((2, 31, 2), "ncclCollConfig_t and the nccl*Config collectives, in 2.31.2's nccl.h"),
    "nvls_host_mode": ((2, 32, 3), "ncclConfig_t.nvlsHostMode appears in 2.32.3's nccl.h"),
}
FEATURE_SYMBOLS: dict[str, str] = {"comm_mem_stats": "ncclCommMemStats",
                                   "coll_config": "ncclAllReduceConfig"}


def features(version: Version, lib: Any) -> dict[str, bool]:
    """Each feature of :data:`FEATURES`: whether NCCL ``version`` (loaded as ``lib``) has it."""
    return {name: version[0] == 2 and version >= first
                  and (name not in FEATURE_SYMBOLS or hasattr(lib, FEATURE_SYMBOLS[name]))
            for name, (first, _) in FEATURES.items()}
