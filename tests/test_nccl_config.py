"""ncclConfig_t as symcomm builds it, held to the layout NCCL's own headers give, per release.

tests/golden/nccl_config_layouts.json is the output of scripts/nccl_config_layout.py, which
compiles each header's ``ncclConfig_t`` with the C compiler and prints sizeof/offsetof per field
and the NCCL_CONFIG_INITIALIZER entries. It was produced on 2026-11-25 with

    python scripts/nccl_config_layout.py --git <NVIDIA/nccl clone> v2.27.3-1 v2.27.5-1 v2.27.6-1 \\
        v2.27.7-1 v2.28.3-1 v2.28.7-1 v2.28.9-1 v2.29.2-1 v2.29.3-1 v2.29.7-1 v2.30.3-1 \\
        v2.30.4-1 v2.30.7-1 \\
        --header <2.31.2 nccl.h> --source "nvidia-nccl-cu13 2.31.2 wheel, the nccl.h of its include folder" \\
        --header <2.32.3 nccl.h> --source "nvidia-nccl-cu13 2.32.3 wheel, the nccl.h of its include folder"

Each entry's ``source`` names the tag and commit (or the wheel and the header's sha256) it was
read from. CI has no NCCL and cannot fetch headers; the table is the headers' word written down.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from symcomm import _nccl
from symcomm._nccl_config import (API_MAGIC, FEATURES, LAYOUTS, UNDEF_INT, CommConfig, GraphUsage,
                                  features, layout_for, version_code)
from symcomm.errors import ArgumentError, CommTimeoutError
import itertools

TABLE = json.loads((Path(__file__).resolve().parent / "golden" / "nccl_config_layouts.json").read_text())


def _version(text: str) -> tuple[int, int, int]:
    major, minor, patch = map(int, text.split("."))
    return major, minor, patch


RELEASES = sorted(TABLE, key=_version)


def _int_at(struct: ctypes.Structure, offset: int) -> int:
    return ctypes.c_int.from_buffer_copy(bytes(struct), offset).value


@pytest.mark.parametrize("release", RELEASES)
def test_struct_matches_the_release_header(release):
    header = TABLE[release]
    layout = layout_for(_version(release))
    assert layout is not None and not layout.newer_than_known
    assert ctypes.sizeof(layout.struct) == header["sizeof"]
    assert [name for name, _, _ in header["fields"]] == list(layout.field_names)
    for name, offset, size in header["fields"]:
        member = getattr(layout.struct, name)
        assert (member.offset, member.size) == (offset, size), name


@pytest.mark.parametrize("release", RELEASES)
def test_default_config_is_the_headers_initializer(release):
    """CommConfig() is NCCL_CONFIG_INITIALIZER: size, magic, version, then every field unset."""
    header, version = TABLE[release], _version(release)
    struct = CommConfig().build(version)
    layout = layout_for(version)
    assert struct.size == header["sizeof"] and struct.magic == API_MAGIC
    assert struct.version == version_code(layout.release)
    initializer = dict(header["initializer"])
    assert list(initializer) == [name for name, _, _ in header["fields"]]
    assert initializer["magic"] in ("0xcafebeef", "NCCL_API_MAGIC")
    for name, offset, size in header["fields"][3:]:
        expected = initializer[name]
        raw = bytes(struct)[offset:offset + size]
        if expected == "NCCL_CONFIG_UNDEF_PTR":
            assert raw == bytes(size), name
        else:
            assert expected == "NCCL_CONFIG_UNDEF_INT", name
            assert _int_at(struct, offset) == UNDEF_INT, name


def test_layouts_only_ever_grow_at_the_end():
    """What makes the fallback for newer NCCL sound: each release's fields are the previous
    release's, same offsets, plus new ones after them."""
    for older, newer in itertools.pairwise(RELEASES):
        old, new = TABLE[older]["fields"], TABLE[newer]["fields"]
        assert new[:len(old)] == old, f"{newer} changed a field of {older}"
        assert TABLE[newer]["sizeof"] >= TABLE[older]["sizeof"]


def test_every_layout_step_is_a_release_in_the_table():
    assert [".".join(map(str, layout.release)) for layout in LAYOUTS] == [
        r for i, r in enumerate(RELEASES)
        if i == 0 or TABLE[r]["fields"] != TABLE[RELEASES[i - 1]]["fields"]]


@pytest.mark.parametrize("release", RELEASES)
def test_fields_land_at_the_headers_offsets(release):
    header, version = TABLE[release], _version(release)
    offsets = {name: offset for name, offset, _ in header["fields"]}
    config = CommConfig(min_ctas=2, max_ctas=8, cga_cluster_size=0, split_share=True, blocking=True)
    struct = config.build(version)
    assert _int_at(struct, offsets["minCTAs"]) == 2 and _int_at(struct, offsets["maxCTAs"]) == 8
    assert _int_at(struct, offsets["cgaClusterSize"]) == 0
    assert _int_at(struct, offsets["splitShare"]) == 1 and _int_at(struct, offsets["blocking"]) == 1


@pytest.mark.parametrize("release", RELEASES)
def test_graph_usage_mode_is_set_where_the_release_has_it(release):
    header, version = TABLE[release], _version(release)
    offsets = {name: offset for name, offset, _ in header["fields"]}
    config = CommConfig(graph_usage_mode=GraphUsage.ONE_GRAPH)
    if version >= (2, 29, 2):
        assert "graphUsageMode" in offsets
        assert _int_at(config.build(version), offsets["graphUsageMode"]) == 1
        assert features(version, object())["graph_usage_mode"]
    else:
        assert "graphUsageMode" not in offsets
        with pytest.raises(ArgumentError, match=r"graph_usage_mode needs NCCL >= 2\.29\.2.*loaded NCCL is"):
            config.build(version)
        assert not hasattr(CommConfig().build(version), "graphUsageMode")
        assert not features(version, object())["graph_usage_mode"]


def test_versions_between_releases_take_the_older_layout():
    # 2.30.5 is not a release here: it gets 2.30.3's layout and version, so NCCL resets the
    # graphStreamOrdering it would otherwise read from the struct's padding (offset 92 of 96).
    struct = CommConfig().build((2, 30, 5))
    assert struct.version == version_code((2, 30, 3)) and not hasattr(struct, "graphStreamOrdering")
    with pytest.raises(ArgumentError, match=r"graph_stream_ordering needs NCCL >= 2\.30\.7"):
        CommConfig(graph_stream_ordering=True, graph_usage_mode=GraphUsage.NONE).build((2, 30, 5))


def test_newer_nccl_gets_the_newest_layout_stamped_with_its_release():
    newest = TABLE[RELEASES[-1]]
    layout = layout_for((2, 40, 1))
    assert layout.newer_than_known and layout.release == _version(RELEASES[-1])
    struct = CommConfig(max_ctas=4).build((2, 40, 1))
    assert struct.size == newest["sizeof"] and struct.version == version_code(_version(RELEASES[-1]))
    assert struct.maxCTAs == 4


def test_no_layout_for_unknown_majors_or_older_releases():
    for version in ((3, 0, 0), (2, 26, 5), (2, 19, 3)):
        assert layout_for(version) is None
        with pytest.raises(ArgumentError, match="needs NCCL 2.x >= 2.27.3"):
            CommConfig(max_ctas=2).build(version)
    assert not any(features((3, 0, 0), object()).values())


@pytest.mark.parametrize("kwargs, message", [
    ({"min_ctas": 0}, "min_ctas must be at least 1"),
    ({"max_ctas": -3}, "max_ctas must be at least 1"),
    ({"min_ctas": 8, "max_ctas": 4}, r"min_ctas \(8\) must not exceed max_ctas \(4\)"),
    ({"max_ctas": True}, "max_ctas must be an int"),
    ({"max_ctas": 2.0}, "max_ctas must be an int"),
    ({"split_share": 1}, "split_share must be True, False or None"),
    ({"graph_usage_mode": 3}, r"graph_usage_mode must be one of 0 \(NONE\)"),
    ({"cga_cluster_size": -1}, "cga_cluster_size must be >= 0"),
    ({"graph_stream_ordering": False}, "needs graph_usage_mode NONE or ONE_GRAPH"),
    ({"graph_stream_ordering": False, "graph_usage_mode": 2}, "needs graph_usage_mode NONE or ONE_GRAPH"),
])
def test_bad_values_are_refused_before_any_call(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        CommConfig(**kwargs)


def test_several_missing_fields_are_named_together():
    config = CommConfig(graph_usage_mode=0, nvls_host_mode=1)
    with pytest.raises(ArgumentError, match=r"graph_usage_mode needs NCCL >= 2\.29\.2.*nvls_host_mode needs NCCL >= 2\.32\.3"):
        config.build((2, 28, 9))


def test_features_follow_version_and_symbols():
    class WithSymbols:
        ncclCommMemStats = ncclAllReduceConfig = object()

    assert features((2, 28, 9), WithSymbols()) == dict.fromkeys(FEATURES, False)
    at_2_29_7 = features((2, 29, 7), WithSymbols())
    assert at_2_29_7["abortable_symmetric_kernels"] and at_2_29_7["comm_mem_stats"]
    assert not at_2_29_7["pdl_safe_symmetric_kernels"] and not at_2_29_7["uneven_windows"]
    at_2_30_7 = features((2, 30, 7), WithSymbols())
    assert at_2_30_7["window_register_in_capture"] and at_2_30_7["pdl_safe_symmetric_kernels"]
    assert not at_2_30_7["coll_config"]
    assert features((2, 31, 2), WithSymbols())["coll_config"]
    # the version alone is not enough for a feature that is a call: the symbol must be there
    assert not features((2, 31, 2), object())["coll_config"]


# ------------------------------------------------------------------- Library's wrappers


class _ConfigLib:
    """Records the calls the wrappers make; answers as NCCL would."""

    def __init__(self, init_code=0, async_states=()):
        self.calls = []
        self.init_code = init_code
        self.async_states = list(async_states)

    def _out(self, ptr, value):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = value

    def ncclCommInitRank(self, handle, world, uid, rank):
        self.calls.append(("ncclCommInitRank", world, rank))
        handle._obj.value = 0x1000
        return 0

    def ncclCommInitRankConfig(self, handle, world, uid, rank, config):
        self.calls.append(("ncclCommInitRankConfig", world, rank, bytes(config._obj)))
        handle._obj.value = 0x2000
        return self.init_code

    def ncclCommSplit(self, parent, color, key, handle, config):
        self.calls.append(("ncclCommSplit", parent, color, key, None if config is None else bytes(config._obj)))
        handle._obj.value = None if color == -1 else 0x3000
        return 0

    def ncclCommGetAsyncError(self, comm, state):
        state._obj.value = self.async_states.pop(0) if self.async_states else 7
        return 0

    def ncclCommAbort(self, comm):
        self.calls.append(("ncclCommAbort", comm))
        return 0

    def ncclGetErrorString(self, code):
        return b"some error"

    def ncclGetLastError(self, comm):
        return b""


def _library(lib, version=(2, 29, 7)):
    return _nccl.Library(lib, "/fake", "test", version)


def test_init_without_config_is_plain_init_rank():
    lib = _ConfigLib()
    assert _library(lib).comm_init_rank(4, _nccl.UniqueId(), 1) == 0x1000
    assert lib.calls == [("ncclCommInitRank", 4, 1)]


def test_init_with_config_passes_the_versions_struct():
    lib = _ConfigLib()
    nccl = _library(lib, (2, 29, 7))
    assert nccl.comm_init_rank(2, _nccl.UniqueId(), 0, CommConfig(max_ctas=4, graph_usage_mode=1)) == 0x2000
    name, world, rank, raw = lib.calls[0]
    offsets = {n: o for n, o, _ in TABLE["2.29.7"]["fields"]}
    assert (name, world, rank, len(raw)) == ("ncclCommInitRankConfig", 2, 0, TABLE["2.29.7"]["sizeof"])
    assert ctypes.c_int.from_buffer_copy(raw, offsets["maxCTAs"]).value == 4
    assert ctypes.c_int.from_buffer_copy(raw, offsets["graphUsageMode"]).value == 1


def test_init_refuses_a_field_before_calling_nccl():
    lib = _ConfigLib()
    with pytest.raises(ArgumentError, match="graph_usage_mode needs NCCL >= 2.29.2"):
        _library(lib, (2, 28, 9)).comm_init_rank(2, _nccl.UniqueId(), 0, CommConfig(graph_usage_mode=1))
    assert lib.calls == []


def test_in_progress_is_a_failure_unless_the_config_is_non_blocking():
    with pytest.raises(_nccl.NcclError, match="ncclInProgress"):
        _library(_ConfigLib(init_code=7)).comm_init_rank(2, _nccl.UniqueId(), 0, CommConfig(max_ctas=2))
    lib = _ConfigLib(init_code=7, async_states=[7, 7, 0])
    nccl = _library(lib)
    comm = nccl.comm_init_rank(2, _nccl.UniqueId(), 0, CommConfig(blocking=False))
    nccl.comm_wait_ready(comm, timeout_s=5.0, poll_s=0.0)
    assert lib.async_states == []  # polled until it answered success


def test_wait_ready_reports_a_failed_setup():
    nccl = _library(_ConfigLib(async_states=[7, 6]))
    with pytest.raises(_nccl.NcclError, match="ncclRemoteError"):
        nccl.comm_wait_ready(0x2000, timeout_s=5.0, poll_s=0.0)


def test_wait_ready_aborts_after_its_bound():
    lib = _ConfigLib()  # stays in progress
    with pytest.raises(CommTimeoutError, match="within 0 s"):
        _library(lib).comm_wait_ready(0x2000, timeout_s=0.05, poll_s=0.01)
    assert lib.calls == [("ncclCommAbort", 0x2000)]


def test_split_passes_color_key_and_config():
    lib = _ConfigLib()
    nccl = _library(lib, (2, 28, 9))
    assert nccl.comm_split(0x1000, 0, 3) == 0x3000
    assert lib.calls[-1] == ("ncclCommSplit", 0x1000, 0, 3, None)  # NULL: the child copies the parent's
    assert nccl.comm_split(0x1000, 1, 0, CommConfig(max_ctas=2)) == 0x3000
    raw = lib.calls[-1][4]
    offsets = {n: o for n, o, _ in TABLE["2.28.9"]["fields"]}
    assert ctypes.c_int.from_buffer_copy(raw, offsets["maxCTAs"]).value == 2
    assert nccl.comm_split(0x1000, None, 0) == 0
    assert lib.calls[-1][2] == -1  # NCCL_SPLIT_NOCOLOR
    for color in (-1, True, "0"):
        with pytest.raises(ArgumentError, match="color must be a non-negative int or None"):
            nccl.comm_split(0x1000, color, 0)


def test_mem_stats_only_where_nccl_has_them():
    class Stats(_ConfigLib):
        def ncclCommMemStats(self, comm, stat, value):
            value._obj.value = [12 << 20, 0, 4 << 20, 16 << 20][stat]
            return 0

    assert _library(_ConfigLib(), (2, 28, 9)).comm_mem_stats(0x1000) is None
    assert _library(Stats(), (2, 29, 7)).comm_mem_stats(0x1000) == {
        "suspendable_bytes": 12 << 20, "suspended": 0, "persistent_bytes": 4 << 20, "total_bytes": 16 << 20}


def test_library_reports_its_layout_and_features():
    nccl = _library(_ConfigLib(), (2, 28, 9))
    assert nccl.config_layout.release == (2, 28, 3)
    assert set(nccl.features) == set(FEATURES) and not nccl.features["graph_usage_mode"]
