"""symcomm.bench.sizes: -b/-e parsing, the -f sweep, and per-op element layouts."""
import pytest

from symcomm.bench import ops
from symcomm.bench.sizes import ROW_BYTES, parse_size, sweep, uneven_rows


def layout(op, nbytes, world, itemsize, rank):
    return ops.spec(op).layout(nbytes, world, itemsize, rank)


@pytest.mark.parametrize("text,value", [
    ("8", 8), ("1K", 1024), ("1k", 1024), ("64K", 65536), ("2M", 2 << 20), ("1G", 1 << 30),
    ("3MB", 3 << 20), ("4KiB", 4096), (" 16 ", 16),
])
def test_parse_size_suffixes_are_powers_of_1024(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "1.5M", "-4", "12X", "1 M B"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_sweep_doubles_and_includes_both_ends():
    assert sweep(1024, 64 * 1024, 2) == [1024 << i for i in range(7)]


def test_sweep_with_larger_factor_stops_before_max():
    assert sweep(8, 1000, 4) == [8, 32, 128, 512]
    assert sweep(32 << 20, 32 << 20, 2) == [32 << 20]


@pytest.mark.parametrize("args", [(0, 8, 2), (16, 8, 2), (8, 16, 1)])
def test_sweep_rejects_bad_ranges(args):
    with pytest.raises(ValueError):
        sweep(*args)


def test_all_reduce_layout_is_the_whole_tensor():
    lay = layout("all_reduce", 1024, 4, 4, rank=2)
    assert (lay.nbytes, lay.count, lay.in_elems, lay.out_elems) == (1024, 256, 256, 256)


def test_even_gather_and_scatter_round_down_like_nccl_tests():
    # 1000 B of float over 3 ranks: 250 elements -> 83 per rank, 996 B reported.
    ag = layout("all_gather", 1000, 3, 4, rank=1)
    assert (ag.nbytes, ag.count, ag.in_elems, ag.out_elems) == (996, 83, 83, 249)
    assert ag.offset(1) == 83
    rs = layout("reduce_scatter", 1000, 3, 4, rank=2)
    assert (rs.nbytes, rs.count, rs.in_elems, rs.out_elems) == (996, 83, 249, 83)
    assert rs.offset(2) == 166


def test_uneven_rows_follow_the_documented_rule():
    assert uneven_rows(100, 4) == [10, 20, 30, 40]
    assert uneven_rows(11, 3) == [1, 3, 7]        # floor(11/6)=1, floor(22/6)=3, rest 7
    assert uneven_rows(2, 4) == [0, 0, 0, 2]      # small sizes leave rank 0 empty
    for total in range(0, 50):
        for world in (1, 2, 3, 8):
            rows = uneven_rows(total, world)
            assert sum(rows) == total and min(rows) >= 0


@pytest.mark.parametrize("op", ["all_gatherv", "reduce_scatterv"])
def test_uneven_layout_uses_aligned_rows(op):
    itemsize, world = 2, 4
    lay = layout(op, 64 * 1024, world, itemsize, rank=3)
    row = ROW_BYTES // itemsize
    assert lay.row == row
    assert lay.total * itemsize == lay.nbytes == 64 * 1024
    assert lay.count == lay.total
    assert all(p % row == 0 for p in lay.parts)
    assert all(lay.offset(r) * itemsize % 16 == 0 for r in range(world))
    assert list(lay.parts) == [r * row for r in uneven_rows(64 * 1024 // 16, world)]
    mine = lay.parts[3]
    expect = (mine, lay.total) if op == "all_gatherv" else (lay.total, mine)
    assert (lay.in_elems, lay.out_elems) == expect


@pytest.mark.parametrize("op", ["all_gatherv", "reduce_scatterv", "all_gatherv_fp4", "all_reduce"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bench_buffers_fit_every_rank_and_are_equal_everywhere(op, world):
    """The CLI's buffers: one size on every rank (reserve_symmetric is collective, and symmetric
    kernels need each buffer at the same pool offset), and large enough for every rank's part of
    every size. Sized by one rank's layouts, the uneven ops reserved different sizes per rank and
    never got symmetric memory (issue 35)."""
    from symcomm.bench.runner import buffer_elems

    specs, sizes = [ops.spec(op)], [1 << 10, 96 << 10, 1 << 20]
    n_send, n_recv = buffer_elems(specs, sizes, world, 2)
    per_rank = [[layout(op, n, world, 2, rank) for n in sizes] for rank in range(world)]
    assert all(lay.in_elems <= n_send and lay.out_elems <= n_recv for lays in per_rank for lay in lays)
    if op != "all_reduce":  # the uneven ops really are uneven: one rank alone would undersize
        assert len({tuple((lay.in_elems, lay.out_elems) for lay in lays) for lays in per_rank}) > 1
