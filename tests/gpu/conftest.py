"""GPU suite: run as `torchrun --nproc-per-node=N -m pytest tests/gpu`.

Without GPUs or torchrun every test here skips with the reason. Set SYMCOMM_REQUIRE_GPU=1
(scripts/gpu_check.sh does) to turn those skips into failures, so a GPU run can never pass by
skipping.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

REQUIRED = os.environ.get("SYMCOMM_REQUIRE_GPU") == "1"


def _unavailable() -> str | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return "not launched by torchrun"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if int(os.environ["WORLD_SIZE"]) < 2:
        return "needs at least 2 ranks"
    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])):
        return "fewer GPUs than local ranks"
    return None


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item, not only this folder's: touch GPU tests alone.
    here = os.path.dirname(__file__)
    gpu_items = [item for item in items if str(item.path).startswith(here + os.sep)]
    reason = _unavailable()
    if reason is None or not gpu_items:
        return
    if REQUIRED:
        raise pytest.UsageError(f"SYMCOMM_REQUIRE_GPU=1 but the GPU suite cannot run: {reason}")
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    # Printed at once, not in the end-of-run summary: a crash in a later teardown (a native
    # abort takes the process down) must not hide which test failed and why.
    if report.failed:
        print(f"\n---- FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n----", flush=True)


@pytest.fixture(scope="session")
def dist_env():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # gloo for CPU tensors (setup exchanges, check mode: safe during graph capture), NCCL for
    # torch.distributed's own CUDA collectives, which some tests compare against.
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    yield dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def comm(dist_env):
    import symcomm
    # 256 MiB in + out for the largest message, plus room for the rest of the suite. Check mode
    # is on: a test that fails on one rank keeps its tensors alive in the traceback, which shifts
    # that rank's later pool offsets; check mode then names the problem instead of letting the
    # symmetric kernels read the wrong memory on every later test.
    c = symcomm.Communicator(symmetric_capacity=1536 << 20, check=True)
    yield c
    c.close()
