"""The examples in examples/ at 2 and 3 gloo ranks: each against its single-process reference,
a rank with no tokens in the DP step, the checks failing when the layer is wrong, the training
steps (tensor-parallel and FSDP-style) with their gradients, and the torchrun commands their
docstrings give."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import symcomm
from _spawn import run_world

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import dp_moe_step  # noqa: E402
import ep_moe_step  # noqa: E402
import fsdp_train_step  # noqa: E402
import layer_utils  # noqa: E402
import tp_block  # noqa: E402
import tp_train_step  # noqa: E402
import train_utils  # noqa: E402


def _failed(checks):
    return [f"{c.name}: {c.detail}" for c in checks if not c.ok]


def _dp_world(rank, world, seed):
    comm = symcomm.Communicator()
    # On gloo there is no symmetric pool: use_symmetric_memory is the shared no-op context, so
    # the examples run the same code on both devices.
    assert comm.symmetric_pool is None
    assert symcomm.use_symmetric_memory(comm) is symcomm.use_symmetric_memory(comm, disabled=True)
    cfg = dp_moe_step.MoEConfig(seed=seed)
    checks = dp_moe_step.run_checks(comm, cfg, capacity=5, modes=("eager",), steps=3, seed=seed)
    assert not _failed(checks), _failed(checks)
    names = [c.name for c in checks]
    assert any("sizes [" in n and ", 0]" in n for n in names), "step 0 must give the last rank no tokens"
    # at these sizes the layer gathers bf16 rows; run_checks repeats every step with NVFP4 forced
    assert sum("gathered bf16 rows" in n for n in names) == 3
    assert sum("gathered FP4 payload" in n for n in names) == 3
    assert sum("MoE output" in n for n in names) == 6

    # The same checks must catch a wrong layer: every rank's experts scaled by 5%.
    ws = dp_moe_step.Workspace(comm, cfg, 5)
    layer = dp_moe_step.DPMoELayer(comm, cfg, ws)
    layer.w.down.mul_(1.05)
    bad = dp_moe_step.check_eager(layer, 3, seed)
    if any(dp_moe_step.step_counts(seed, s, world, 5)[rank] for s in range(3)):
        assert any("MoE output" in f for f in _failed(bad)), "a 5% error in the experts went unnoticed"
    # ... while what travels through the gather is still bit for bit the reference's
    assert not [f for f in _failed(bad) if "gathered" in f]
    comm.close()


def _tp_world(rank, world, seed):
    comm = symcomm.Communicator()
    cfg = tp_block.TPConfig(seed=seed)
    checks = tp_block.run_checks(comm, cfg, capacity=7, modes=("eager",), steps=3, seed=seed)
    assert not _failed(checks), _failed(checks)
    assert sum("identical on every rank" in c.name for c in checks) == 3

    # Rank 0's MLP shard left out of the sum: every rank's residual is off (they all sum the
    # same partials), and the ranks still agree with each other bit for bit.
    block = tp_block.TPBlock(comm, cfg, 7)
    if rank == 0:
        block.w.down.zero_()
    bad = tp_block.check_eager(block, 2, seed)
    assert any("residual" in f for f in _failed(bad)), "a shard missing from the all-reduce went unnoticed"
    assert not [f for f in _failed(bad) if "identical" in f]
    assert layer_utils.report("tp_block (corrupted on purpose)", bad, comm) is False
    comm.close()


class _SummedTP(tp_train_step.TPMLP):
    """The TP step with a plain all_reduce where reduce_from_tp_region belongs: its backward sums
    the replicated gradient over ranks, so every gradient is world times too large."""

    def loss(self, x, target):
        w_in, w1, w2 = self.params
        h = torch.nn.functional.gelu(symcomm.copy_to_tp_region(self.comm, x @ w_in.t()) @ w1.t())
        return torch.nn.functional.mse_loss(self.comm.all_reduce(h @ w2.t()), target)


def _train_world(rank, world, seed):
    comm = symcomm.Communicator(check=True)  # the backward's collectives pass check mode too
    tp_cfg, fsdp_cfg = tp_train_step.TrainConfig(seed=seed), fsdp_train_step.TrainConfig(seed=seed)
    checks = tp_train_step.run_checks(comm, tp_cfg, ("eager",), steps=3, seed=seed)
    assert not _failed(checks), _failed(checks)
    assert sum("gradient of" in c.name for c in checks) == 9 and "identical on every rank" in checks[-1].name
    checks = fsdp_train_step.run_checks(comm, fsdp_cfg, ("eager",), steps=3, seed=seed)
    assert not _failed(checks), _failed(checks)
    assert sum("gradient of w1 shard" in c.name for c in checks) == 3

    # The checks catch a wrong backward: the sum convention where the TP one belongs ...
    full = tp_train_step.FullMLP(tp_cfg, comm.device)
    bad = train_utils.check_eager(_SummedTP(comm, tp_cfg, full), train_utils.Reference(full, tp_cfg.lr),
                                  tp_train_step.batches_for(tp_cfg, comm, seed), 1, seed, tp_cfg.lr, 7)
    assert any("gradient of w_in" in f for f in _failed(bad)), _failed(bad)
    # ... and a rank's shard missing from the FSDP gather
    full = fsdp_train_step.FullMLP(fsdp_cfg, comm.device)
    model = fsdp_train_step.FSDPMLP(comm, fsdp_cfg, full)
    if rank == 0:
        with torch.no_grad():
            model.params[0].zero_()
    bad = train_utils.check_eager(model, train_utils.Reference(full, fsdp_cfg.lr),
                                  fsdp_train_step.batches_for(fsdp_cfg, comm, seed), 1, seed, fsdp_cfg.lr, 7)
    assert any(": loss" in f for f in _failed(bad)), _failed(bad)
    comm.close()


def _ep_world(rank, world, seed):
    comm = symcomm.Communicator()
    cfg = dp_moe_step.MoEConfig(hidden=128, experts=2 * world, seed=seed)
    for quant in (None, "nvfp4", "fp8"):
        checks = ep_moe_step.run_checks(comm, cfg, capacity=5, modes=("eager",), steps=3, seed=seed, quant=quant)
        assert not _failed(checks), (quant, _failed(checks))
        names = [c.name for c in checks]
        assert any("sizes [" in n and ", 0]" in n for n in names), "step 0 must give the last rank no tokens"
        assert sum("MoE output (combined)" in n for n in names) == 3
    # The same checks must catch a wrong layer: every rank's experts scaled by 5% ...
    layer = ep_moe_step.EPMoELayer(comm, cfg, 5, None)
    layer.w.down.mul_(1.05)
    bad = ep_moe_step.check_eager(layer, 3, seed)
    if any(dp_moe_step.step_counts(seed, s, world, 5)[rank] for s in range(3)):
        assert any("MoE output" in f for f in _failed(bad)), "a 5% error in the experts went unnoticed"
    # ... while what the dispatch delivered (rows per local expert) is still exactly the reference's
    assert not [f for f in _failed(bad) if "received per local expert" in f]
    _ep_bound_filled(comm, rank, world)
    comm.close()


def _ep_bound_filled(comm, rank, world):
    """Every token of every rank routes to experts 0-2, all on rank 0, so rank 0 receives exactly
    the rows its bucket bound allows (layout.capacity for the bucket): the bounded step must give
    the unbounded one's bits with its last row on the bound. A bound one row short leaves that
    row's activation unwritten."""
    cfg = dp_moe_step.MoEConfig(hidden=64, experts=4 * world, top_k=3, ffn=32, seed=5)
    layer = ep_moe_step.EPMoELayer(comm, cfg, 8, None)  # buffers for 8 tokens a rank, steps of 5
    layer.w.router.fill_(-1.0)
    layer.w.router[:3] = torch.tensor([[3.0], [2.0], [1.0]])  # x is positive: experts 0, 1, 2 win
    hidden = torch.ones(5, cfg.hidden, dtype=cfg.dtype) * (1 + rank)
    whole = layer.moe(hidden)
    # Deterministic mode fills new tensors with NaN, so a row past the bound that the step still
    # needed would show up instead of holding whatever the allocator last left there.
    torch.use_deterministic_algorithms(True)
    try:
        bounded = layer.moe(hidden, bucket=5)
    finally:
        torch.use_deterministic_algorithms(False)
    bound = ep_moe_step.EPMoELayer.rows_bound(layer.bufs.handle, 5)
    assert bound < layer.bufs.x.shape[0]
    if rank == 0:
        assert int(layer.bufs.expert_offsets[-1]) == bound == world * 5 * 3
    assert torch.equal(bounded, whole)


def _both(rank, world, seed):
    # One world for every example: starting gloo ranks costs more than the checks themselves.
    _dp_world(rank, world, seed)
    _tp_world(rank, world, seed + 1)
    _train_world(rank, world, seed + 2)
    _ep_world(rank, world, seed + 3)


@pytest.mark.parametrize("world", (2, 3))
def test_examples_match_single_process(world):
    run_world(_both, world, 11 + world)


def test_tp_shards_cover_the_full_weights():
    cfg = tp_block.TPConfig(heads=5, ffn=40)  # uneven shares at world 3
    full = tp_block.TPWeights(cfg, torch.device("cpu"))
    shards = [full.shard(cfg, r, 3) for r in range(3)]
    d = cfg.heads * cfg.head_dim
    assert torch.equal(torch.cat([s.o for s in shards], dim=1), full.o)
    assert torch.equal(torch.cat([s.down for s in shards], dim=1), full.down)
    q_rows = torch.cat([s.qkv[:s.qkv.shape[0] // 3] for s in shards])
    assert torch.equal(q_rows, full.qkv[:d])
    gates = torch.cat([s.gate_up[:s.gate_up.shape[0] // 2] for s in shards])
    assert torch.equal(gates, full.gate_up[:cfg.ffn])


def test_experts_are_split_over_any_world():
    for world in (1, 2, 3, 4, 7):
        parts = [dp_moe_step.experts_of(r, world, 6) for r in range(world)]
        assert [e for p in parts for e in p] == list(range(6))


def _torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--standalone", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_documented_cpu_command_runs_and_passes():
    done = _torchrun("examples/tp_block.py", "--cpu", "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp_block: PASS: 6 checks per rank, world 2, cpu" in done.stdout, done.stdout


@pytest.mark.parametrize("example", ("tp_train_step", "fsdp_train_step"))
def test_the_training_examples_run_eager_and_compiled_on_cpu(example):
    """Their documented --cpu command, with torch.compile too (AOTAutograd's backward of the
    collectives), which CUDA graphs apart is what the GPU runs."""
    done = _torchrun(f"examples/{example}.py", "--cpu", "--steps", "2", "--modes", "eager,compile", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"{example}: PASS: \d+ checks per rank, world 2, cpu", done.stdout), done.stdout


@pytest.mark.parametrize("example", ("tp_block", "dp_moe_step", "ep_moe_step"))
def test_the_layer_examples_run_on_a_machine_with_fewer_gpus_than_ranks(example):
    """The plain GPU command, no --cpu, where torch sees fewer GPUs than local ranks (none on the
    CPU machine): one line says so and the example runs over gloo, instead of dying in
    torch.cuda.set_device (issue 35). The training examples share init_distributed."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank: the example would run on them")
    done = _torchrun(f"examples/{example}.py", "--steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CUDA device(s) for 2 local ranks: running on the CPU over gloo, as --cpu does" in done.stdout, done.stdout
    assert re.search(rf"{example}: PASS: \d+ checks per rank, world 2, cpu", done.stdout), done.stdout


# Every example in examples/ (the *_utils modules are their helpers) runs under torchrun on the
# CPU in a test here: a new one must join them.
TORCHRUN_TESTED = {"quickstart", "tp_block", "dp_moe_step", "ep_moe_step", "tp_train_step", "fsdp_train_step"}


def test_every_example_runs_under_torchrun_here():
    examples = {p.stem for p in (ROOT / "examples").glob("*.py") if not p.stem.endswith("_utils")}
    assert examples == TORCHRUN_TESTED


def test_layer_step_bench_prints_its_table_on_cpu():
    done = _torchrun("bench/layer_step.py", "--cpu", "--tokens", "1,4", "--iters", "2", "--rounds", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "timings are meaningless" in out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    for layer in ("dp_moe", "tp_block", "ep_moe"):
        for tokens in ("1", "4"):
            got = {r[2] for r in rows if r[:2] == [layer, tokens]}
            assert got == {"symcomm-auto", "symcomm-nccl", "torch.distributed", "torch-symm-mem", "local"}, (
                layer, tokens, got, out)
    skipped = [r for r in rows if r[2] == "torch-symm-mem"]
    assert skipped and all(r[3] == "skipped:" for r in skipped), out
    timed = [r for r in rows if r[2] in ("symcomm-auto", "torch.distributed")]
    assert all(float(r[3]) > 0 for r in timed), out


def test_train_step_bench_prints_its_table_on_cpu():
    done = _torchrun("bench/train_step.py", "--cpu", "--iters", "2", "--rounds", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "timings are meaningless" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line and not line.startswith("#")]
    got = {(r[0], r[1], r[2]) for r in rows}
    variants = ("symcomm", "serial", "funcol", "local")
    assert got == {(s, t, v) for s in ("tp", "fsdp") for t in ("1", "4") for v in variants}, done.stdout
    assert all(float(r[3]) > 0 for r in rows), done.stdout


@pytest.mark.parametrize("world", (2, 3))
def test_the_quickstart_runs_at_any_world_size(world):
    """The README's example, the file itself under torchrun, run from outside the clone as a
    user would (the clone is installed, or on PYTHONPATH as here): every rank gets the same
    sum, its gathered rows and its shard, and the process group ends cleanly."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                           "--standalone", str(ROOT / "examples" / "quickstart.py")],
                          cwd="/", env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "terminate called" not in done.stderr
    # The ranks share one stdout: their lines may interleave, so each is found by its pattern.
    found = sorted(re.findall(r"rank (\d+): sum (\S+), rows \((\d+), 1024\), shard \((\d+), 1024\)", done.stdout))
    assert [int(rank) for rank, *_ in found] == list(range(world)), done.stdout
    assert len({tuple(rest) for _, *rest in found}) == 1  # the same on every rank
    _, _, rows, shard = found[0]
    assert (int(rows), int(shard)) == (sum(3 + r for r in range(world)), 64)
    assert done.stdout.count("Choice(algo='torch'") == 1  # rank 0 says which path, once
