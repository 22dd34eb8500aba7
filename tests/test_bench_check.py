"""symcomm.bench.check: reproducible inputs, float64 expectations, tolerances, #wrong."""
import math

import pytest
import torch

from symcomm.bench import check, ops

CPU = torch.device("cpu")


def gen_for(spec, lay, dtype, redop, world, seed=0):
    return lambda p: check.make_input(spec.input_elems(lay, p), dtype, CPU, seed, p, lay.nbytes,
                                      redop, world)


def test_inputs_are_reproducible_distinct_and_non_zero():
    a = check.make_input(4096, torch.bfloat16, CPU, 0, 1, 8192, "sum", 4)
    b = check.make_input(4096, torch.bfloat16, CPU, 0, 1, 8192, "sum", 4)
    c = check.make_input(4096, torch.bfloat16, CPU, 0, 2, 8192, "sum", 4)
    d = check.make_input(4096, torch.bfloat16, CPU, 1, 1, 8192, "sum", 4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert bool((a != 0).all()) and bool((a < 0).any()) and bool((a > 0).any())


@pytest.mark.parametrize("dtype,redop,world", [(torch.int8, "sum", 8), (torch.int8, "prod", 8),
                                               (torch.uint8, "prod", 4), (torch.int32, "prod", 8)])
def test_integer_inputs_cannot_overflow_the_reduction(dtype, redop, world):
    top = check.int_magnitude(dtype, redop, world)
    limit = torch.iinfo(dtype).max
    assert (top * world if redop == "sum" else top ** world) <= limit
    x = check.make_input(1000, dtype, CPU, 0, 0, 1000, redop, world)
    assert bool((x != 0).all()) and int(x.abs().max()) <= top


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "reduce_scatterv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_reduction_computed_in_dtype_passes_and_one_bad_element_counts(op, dtype):
    world, rank = 3, 1
    spec = ops.spec(op)
    lay = spec.layout(6144, world, dtype.itemsize, rank)
    gen = gen_for(spec, lay, dtype, "sum", world)
    exp = spec.expected(lay, "sum", dtype, rank, world, gen)
    lo, hi = spec.output_span(lay, rank)
    got = gen(0)[lo:hi].clone()
    for p in range(1, world):  # rank order, in the low precision dtype, as a real path would
        got += gen(p)[lo:hi]
    assert got.numel() > 0
    assert check.count_wrong(got, exp) == 0
    check.corrupt(got)
    assert check.count_wrong(got, exp) == 1
    check.poison_fill(got)
    assert check.count_wrong(got, exp) == got.numel()


def test_off_by_one_rank_sum_is_caught_in_bf16():
    world = 4
    spec = ops.spec("all_reduce")
    lay = spec.layout(2048, world, 2, 0)
    gen = gen_for(spec, lay, torch.bfloat16, "sum", world)
    exp = spec.expected(lay, "sum", torch.bfloat16, 0, world, gen)
    missing_one = sum(gen(p).double() for p in range(world - 1)).to(torch.bfloat16)
    assert check.count_wrong(missing_one, exp) > lay.count // 2


@pytest.mark.parametrize("redop", ["max", "min", "prod", "avg"])
def test_other_redops(redop):
    world = 4
    spec = ops.spec("all_reduce")
    lay = spec.layout(512, world, 4, 2)
    gen = gen_for(spec, lay, torch.float32, redop, world)
    exp = spec.expected(lay, redop, torch.float32, 2, world, gen)
    xs = torch.stack([gen(p) for p in range(world)])
    got = {"max": xs.amax(0), "min": xs.amin(0), "prod": xs.prod(0), "avg": xs.mean(0)}[redop]
    assert check.count_wrong(got, exp) == 0
    assert check.count_wrong(-got, exp) == got.numel()


@pytest.mark.parametrize("op", ["all_gather", "all_gatherv"])
def test_gather_expectation_is_exact_concatenation(op):
    world = 4
    spec = ops.spec(op)
    lay = spec.layout(4096, world, 2, 3)
    gen = gen_for(spec, lay, torch.bfloat16, "none", world)
    exp = spec.expected(lay, "none", torch.bfloat16, 3, world, gen)
    got = torch.cat([gen(p) for p in range(world)])
    assert got.numel() == lay.total
    assert check.count_wrong(got, exp) == 0
    swapped = torch.cat([gen(p) for p in (1, 0, 2, 3)])
    assert check.count_wrong(swapped, exp) > 0


def test_poison_is_never_a_valid_result():
    assert math.isnan(check.poison_value(torch.bfloat16))
    assert check.poison_value(torch.int8) == -128
    assert check.poison_value(torch.uint8) == 0
