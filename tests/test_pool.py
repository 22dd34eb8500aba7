"""Membership index and the native sub-allocator (bookkeeping only: no memory is touched)."""
from __future__ import annotations

import ctypes

import pytest

from symcomm.pool import REGION_GRANULE, SegmentIndex, round_to_granule

G = REGION_GRANULE


def test_index_finds_the_owning_segment():
    index = SegmentIndex()
    index.add(10 * G, 3 * G)
    index.add(20 * G, G)
    assert len(index) == 2
    assert index.find(10 * G) == 10 * G
    assert index.find(13 * G - 1) == 10 * G
    assert index.find(13 * G) == -1
    assert index.find(20 * G + 5) == 20 * G
    assert index.find(0) == -1
    index.remove(10 * G)
    assert index.find(11 * G) == -1 and len(index) == 1


def test_index_rejects_overlap_and_misalignment():
    index = SegmentIndex()
    index.add(4 * G, 2 * G)
    with pytest.raises(ValueError, match="overlaps"):
        index.add(5 * G, 2 * G)
    with pytest.raises(ValueError, match="granule"):
        index.add(9 * G + 512, G)
    with pytest.raises(ValueError, match="granule"):
        index.add(9 * G, G // 2)
    with pytest.raises(KeyError):
        index.remove(7 * G)


def test_index_with_a_thousand_segments():
    index = SegmentIndex()
    for i in range(1000):
        index.add((2 * i + 1) * G, G)
    for i in (0, 417, 999):
        assert index.find((2 * i + 1) * G + 12345) == (2 * i + 1) * G
        assert index.find(2 * i * G + 12345) == -1


def test_round_to_granule():
    assert round_to_granule(1) == G
    assert round_to_granule(G) == G
    assert round_to_granule(G + 1) == 2 * G


@pytest.fixture(scope="module")
def native(native_library):
    return native_library.lib


def _alloc(lib, pool, size):
    previous = lib.symcomm_pool_set_active(pool)
    try:
        return lib.symcomm_alloc(size, 0, None) or 0
    finally:
        lib.symcomm_pool_set_active(previous)


def test_allocator_is_deterministic_across_bases(native):
    """Two ranks' pools at different addresses hand out the same offsets for the same requests."""
    requests = [G, 20 * G, 3 * G, 1000, 10 * G]
    offsets = []
    for base in (0x7F00_0000_0000, 0x7A00_0000_0000):
        pool = native.symcomm_pool_create()
        assert native.symcomm_pool_add_region(pool, base, 32 * G) == 0
        assert native.symcomm_pool_add_region(pool, base + 64 * G, 16 * G) == 0
        ptrs = [_alloc(native, pool, n) for n in requests]
        native.symcomm_free(ptrs[1], 0, 0, None)
        ptrs.append(_alloc(native, pool, 4 * G))
        offsets.append([p - base for p in ptrs])
        native.symcomm_pool_destroy(pool)
    assert offsets[0] == offsets[1]
    assert offsets[0][2] == 21 * G          # third request fills in after the first two
    assert offsets[0][4] == 64 * G          # no room left in region 1 (32 G): region 2
    assert offsets[0][5] == G               # a freed block is reused, first fit by offset


def test_exhaustion_coalescing_and_accounting(native):
    pool = native.symcomm_pool_create()
    base = 0x7E00_0000_0000
    native.symcomm_pool_add_region(pool, base, 4 * G)
    a, b = _alloc(native, pool, 2 * G), _alloc(native, pool, 2 * G)
    assert a and b and native.symcomm_pool_bytes_in_use(pool) == 4 * G
    assert _alloc(native, pool, 512) == 0
    assert native.symcomm_pool_take_failed_request(pool) == 512
    assert native.symcomm_pool_take_failed_request(pool) == 0  # cleared once read
    native.symcomm_free(a, 0, 0, None)
    native.symcomm_free(b, 0, 0, None)
    assert native.symcomm_pool_live_allocations(pool) == 0
    whole = _alloc(native, pool, 4 * G)  # the two halves merged back
    assert whole == base
    native.symcomm_free(ctypes.c_void_p(0x1234).value, 0, 0, None)  # unknown pointer: ignored
    native.symcomm_pool_destroy(pool)
    native.symcomm_free(whole, 0, 0, None)  # late free after destroy: ignored, no crash
    assert _alloc(native, pool, 512) == 0   # a destroyed pool serves nothing


def test_region_must_be_aligned(native):
    pool = native.symcomm_pool_create()
    assert native.symcomm_pool_add_region(pool, 0x7D00_0000_0001, G) == -1
    assert native.symcomm_pool_add_region(pool, 0x7D00_0000_0000, 0) == -1
    assert native.symcomm_pool_add_region(12345, 0x7D00_0000_0000, G) == -1
    native.symcomm_pool_destroy(pool)
