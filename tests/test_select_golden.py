"""The path every operation's select() picks, for a fixed set of calls under each shipped
dispatch table (packaged and built-in, world 2 and 4), is what it was when the golden file was
recorded: a refactor of dispatch must not change a choice. The communicator is tests/_gpu_like.py's
(real path classes over stand-in native state on gloo), so the choices are those a GPU host
would make for these calls.

To re-record after a deliberate change of choices: SYMCOMM_RECORD_GOLDEN=1 python -m pytest
tests/test_select_golden.py, and say in the commit why the choices changed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _gpu_like import Pool, communicator
from _spawn import run_world
from symcomm import dispatch, rmsnorm

GOLDEN = Path(__file__).parent / "golden" / "select_choices.json"
TABLES = {2: "nvidia_h200_w2.json", 4: "nvidia_h200_w4.json"}
SIZES = (16, 1000, 1 << 10, 4 << 10, 32 << 10, 64 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)


def _choice(choice) -> list:
    inner = getattr(choice, "all_reduce", None) or getattr(choice, "gather", None)
    return [choice.algo, sorted(choice.rejected), None if inner is None else inner.algo]


def _collectives(comm, pool: Pool, world: int, rank: int, record) -> None:
    for nbytes in SIZES:
        for dtype in (torch.bfloat16, torch.float32):
            n = nbytes // dtype.itemsize
            for mem in ("pool", "plain"):
                def t(offset, shape):
                    return pool.tensor(offset, shape, dtype) if mem == "pool" else torch.empty(shape, dtype=dtype)
                half = 300 << 20
                x, out = t(0, (n,)), t(half, (n,))
                for redop in ("sum", "max"):
                    record(f"all_reduce {nbytes} {dtype} {mem} {redop}", comm.select("all_reduce", x, out=out, op=redop))
                    record(f"all_reduce:inplace {nbytes} {dtype} {mem} {redop}",
                           comm.select("all_reduce", x, out=x, op=redop))
                rows = max(n // world, 1)
                big = t(half, (rows * world, 1))
                record(f"all_gather {nbytes} {dtype} {mem}", comm.select("all_gather", t(0, (rows, 1)), out=big))
                record(f"all_gather:inplace {nbytes} {dtype} {mem}",
                       comm.select("all_gather", big[rank * rows:(rank + 1) * rows], out=big))
                record(f"reduce_scatter {nbytes} {dtype} {mem}",
                       comm.select("reduce_scatter", big, out=t(0, (rows, 1))))
                record(f"reduce_scatter:inplace {nbytes} {dtype} {mem}",
                       comm.select("reduce_scatter", big, out=big[rank * rows:(rank + 1) * rows]))
                row = 64 // dtype.itemsize  # 64-byte rows
                total = max(nbytes // 64, world)
                for split in ("even", "uneven"):
                    sizes = ([total // world] * world if split == "even" else
                             [total * (r + 1) // (world * (world + 1) // 2) for r in range(world)])
                    gathered = t(half, (sum(sizes), row))
                    record(f"all_gatherv {nbytes} {dtype} {mem} {split}",
                           comm.select("all_gatherv", t(0, (sizes[rank], row)), out=gathered, sizes=sizes))
                    record(f"reduce_scatterv {nbytes} {dtype} {mem} {split}",
                           comm.select("reduce_scatterv", gathered, out=t(0, (sizes[rank], row)), sizes=sizes))


def _norm(comm, pool: Pool, record) -> None:
    for hidden in (7168, 8192):
        for tokens in (1, 4, 16, 64, 256, 1024):
            for mem in ("pool", "plain"):
                shape = (tokens, hidden)
                x = pool.tensor(0, shape, torch.bfloat16) if mem == "pool" else torch.empty(shape, dtype=torch.bfloat16)
                w = torch.empty(hidden, dtype=torch.bfloat16)
                res = torch.empty(shape, dtype=torch.bfloat16)
                for quant, scale in ((None, None), ("fp8", 1.0), ("nvfp4", 1.0)):
                    for algo in ("auto", "nccl", "custom-oneshot", "custom-flagfree", "unfused"):
                        key = f"all_reduce_rmsnorm {tokens}x{hidden} {mem} {quant} {algo}"
                        try:
                            record(key, comm.select("all_reduce_rmsnorm", x, weight=w, residual=res, quant=quant,
                                                    scale=scale, algo=algo))
                        except symcomm_errors() as exc:
                            record(key, f"error: {type(exc).__name__}")


def _fp4(comm, pool: Pool, world: int, rank: int, record) -> None:
    for tokens in (1, 16, 300):
        sizes = [tokens * (r + 1) for r in range(world)]
        total = sum(sizes)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty((sizes[rank], 512), dtype=dtype)
            ids = torch.empty((sizes[rank], 8), dtype=torch.int32)
            for mem in ("pool", "plain"):
                if mem == "pool":
                    outs = dict(out=fp4_out(pool, total))
                else:
                    outs = {}
                for algo in ("auto", "nccl", "unfused", "fused-push"):
                    key = f"all_gatherv_fp4 {tokens} {dtype} {mem} {algo}"
                    try:
                        record(key, comm.select("all_gatherv_fp4", x, sizes=sizes, global_scale=1.0, extra=[ids],
                                                algo=algo, **outs))
                    except symcomm_errors() as exc:
                        record(key, f"error: {type(exc).__name__}")


def fp4_out(pool: Pool, total: int):
    import symcomm
    return symcomm.Fp4Gathered(pool.tensor(0, (total, 256), torch.uint8),
                               pool.tensor(1 << 20, (total, 32), torch.float8_e4m3fn),
                               (pool.tensor(2 << 20, (total, 8), torch.int32),), None, None)


def symcomm_errors():
    import symcomm
    return (symcomm.ArgumentError,)


def _world(rank, world, out_dir):
    os.environ.pop("SYMCOMM_TUNING_FILE", None)
    # The standalone norm kernel counts as loaded, as on a GPU with the library built.
    rmsnorm.kernel_available = lambda device: None
    pool = Pool()
    comm = communicator(pool)
    results = {}
    for which in ("builtin", "packaged"):
        if which == "builtin":
            comm.table = dispatch.builtin_table(world)
        else:
            tuned = dispatch.read_tuning(dispatch.PACKAGED_DIR / TABLES[world])
            comm.table = dispatch.DispatchTable(tuned.rules, source=f"packaged {TABLES[world]}")
        got = results.setdefault(which, {})

        def record(key, choice):
            got[key] = choice if isinstance(choice, str) else _choice(choice)
        _collectives(comm, pool, world, rank, record)
        _norm(comm, pool, record)
        _fp4(comm, pool, world, rank, record)
    comm.close()
    Path(out_dir, f"w{world}_r{rank}.json").write_text(json.dumps(results, indent=0, sort_keys=True))


@pytest.fixture(scope="module", params=(2, 4))
def recorded(request, tmp_path_factory):
    """(world, {"w<W>_r<R>": {table: {call: choice}}}) for rank 0 and the last rank: in-place
    calls sit at rank-dependent offsets."""
    world, out = request.param, tmp_path_factory.mktemp(f"select_w{request.param}")
    run_world(_world, world, str(out), timeout_s=600)
    return world, {f"w{world}_r{r}": json.loads((out / f"w{world}_r{r}.json").read_text()) for r in (0, world - 1)}


def test_select_choices_match_the_golden_record(recorded):
    _, got = recorded
    if os.environ.get("SYMCOMM_RECORD_GOLDEN") == "1":
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden.update(got)
        GOLDEN.write_text(json.dumps(golden, separators=(",", ":"), sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for key, results in got.items():
        for table, choices in results.items():
            expect = golden[key][table]
            differ = {k: (expect.get(k), v) for k, v in choices.items() if expect.get(k) != v}
            missing = sorted(set(expect) - set(choices))
            assert not differ and not missing, (f"{key} {table}: {len(differ)} choices changed, e.g. "
                                                f"{list(differ.items())[:3]}; missing {missing[:3]}")


def test_in_place_and_out_of_place_calls_take_one_path(recorded):
    """Calling in place is this rank's own business (NCCL allows one rank in place and another
    not): it must never change the path, or the ranks would wait in different ones."""
    _, got = recorded
    compared = 0
    for key, results in got.items():
        for table, choices in results.items():
            for call, choice in choices.items():
                if ":inplace " in call:
                    twin = call.replace(":inplace ", " ", 1)
                    assert choice[0] == choices[twin][0], (key, table, call, choice[0], choices[twin][0])
                    compared += 1
    assert compared >= 2 * 2 * len(SIZES) * 2 * 2 * 4  # ranks, tables, sizes, dtypes, memories, calls
