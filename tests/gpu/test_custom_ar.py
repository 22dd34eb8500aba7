"""symcomm's own all-reduce kernels: correctness, bitwise agreement, graphs, fallbacks, stalls."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import symcomm
from symcomm import base
from symcomm.peer import context as peer_context
from symcomm.peer import setup as peer_setup
from _data import DTYPES, all_inputs, assert_reduced, rank_input

ALGOS = (base.FLAGFREE, base.ONESHOT, base.TWOSHOT)


def capacity(algo: str, world: int) -> int:
    if algo == base.FLAGFREE:
        return peer_context.default_flagfree_bytes(world)
    return peer_context.DEFAULT_STAGING_BYTES


# Bytes: one vector, odd vector counts, sizes that are not powers of two, and each capacity.
SIZES = (16, 48, 1008, 4096, 65_552, 100_000, 524_288, 1_000_016, 4 << 20, 16 << 20)


@pytest.fixture(scope="module")
def fast(dist_env):
    """No check mode (it exchanges over gloo on every call) and no pool: for the long loops."""
    c = symcomm.Communicator(symmetric=False, check=False)
    yield c
    c.close()


def _gathered_equal(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bits."""
    bits = t.contiguous().view(torch.uint8)
    parts = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, bits)
    return all(torch.equal(p, parts[0]) for p in parts)


def test_kernels_are_enabled(comm):
    paths = comm.capabilities()["paths"]
    for algo in ALGOS:
        assert paths[algo]["enabled"], paths[algo]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nbytes", SIZES)
def test_every_kernel_matches_reference_nccl_and_each_other(fast, nbytes, dtype):
    w, rank = fast.world_size, fast.rank
    numel = nbytes // (torch.finfo(dtype).bits // 8)
    inputs = all_inputs(numel, dtype, w, seed=nbytes % 1000 + 3)
    x = inputs[rank]
    before = x.clone()
    nccl = fast.all_reduce(x, algo="nccl")
    results = {}
    for algo in ALGOS:
        if nbytes > capacity(algo, w):
            continue
        out = fast.all_reduce(x, algo=algo)
        assert torch.equal(x.view(torch.uint8), before.view(torch.uint8)), f"{algo} modified its input"
        assert_reduced(out, inputs, f"{algo} {nbytes} B {dtype}")
        # NCCL rounds in the tensor's dtype along its ring; the bound covers both.
        assert_reduced(nccl, inputs, f"nccl {nbytes} B {dtype}")
        results[algo] = out
    assert results, "no kernel ran"
    first = next(iter(results.values()))
    for algo, out in results.items():
        # Same fp32 sums in the same rank order: the kernels agree to the bit, and so do ranks.
        assert torch.equal(out.view(torch.uint8), first.view(torch.uint8)), f"{algo} differs from the others"
    assert _gathered_equal(first), "ranks hold different bits"


@pytest.mark.parametrize("algo", ALGOS)
def test_in_place_and_symmetric_inputs(comm, algo):
    w, rank, dtype = comm.world_size, comm.rank, torch.bfloat16
    numel = 8 * 1000 * w
    inputs = all_inputs(numel, dtype, w, seed=5)
    with symcomm.use_symmetric_memory(comm):
        x = torch.empty(numel, dtype=dtype, device=comm.device)
    x.copy_(inputs[rank])
    plain = inputs[rank].clone()
    out_of_place = comm.all_reduce(plain, algo=algo)
    comm.all_reduce(x, out=x, algo=algo)  # symmetric input, in place
    comm.all_reduce(plain, out=plain, algo=algo)  # ordinary input, in place
    assert_reduced(x, inputs, f"{algo} in place, symmetric")
    assert torch.equal(x, out_of_place) and torch.equal(plain, out_of_place)


def test_empty_tensor(fast):
    """An empty call returns an empty tensor of the input's shape and leaves the path usable:
    the sum right after it is right (a broken or half-taken turn would hang or corrupt it)."""
    x = torch.empty(0, 3, dtype=torch.bfloat16, device=fast.device)
    inputs = all_inputs(1000, torch.bfloat16, fast.world_size, seed=73)
    for algo in ALGOS:
        empty = fast.all_reduce(x, algo=algo)
        assert empty.shape == x.shape and empty.dtype == x.dtype, f"{algo}: {empty.shape} {empty.dtype}"
        after = fast.all_reduce(inputs[fast.rank].clone(), algo=algo)
        assert_reduced(after, inputs, f"{algo}, the call after an empty one")


def _graph_case(c, algo, register: bool, in_place: bool, numel: int):
    """Eager result, then capture (after an eager warm-up on a side stream) and replay on the
    same input values: returns (eager, replayed)."""
    dtype, rank = torch.bfloat16, c.rank
    x = rank_input(numel, dtype, rank, seed=17)
    eager = c.all_reduce(x.clone(), algo=algo)
    inp = torch.empty_like(x)
    out = inp if in_place else torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inp.copy_(x)
        c.all_reduce(inp, out=out, algo=algo)  # warm-up, as frameworks do before capturing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if register:
        with c.graph_capture(), torch.cuda.graph(graph):
            c.all_reduce(inp, out=out, algo=algo)
    else:
        with torch.cuda.graph(graph):
            c.all_reduce(inp, out=out, algo=algo)
    replayed = []
    for _ in range(3):  # replay more than once: epochs and flag-free buffers must rotate
        inp.copy_(x)
        if not in_place:
            out.fill_(float("nan"))
        graph.replay()
        replayed.append(out.clone())
    torch.cuda.synchronize()
    return eager, replayed, graph


@pytest.mark.parametrize("in_place", (False, True), ids=("out_of_place", "in_place"))
@pytest.mark.parametrize("register", (True, False), ids=("graph_capture", "plain_capture"))
@pytest.mark.parametrize("algo", ALGOS)
def test_graph_replay_is_bitwise_equal_to_eager(fast, algo, register, in_place):
    eager, replayed, _ = _graph_case(fast, algo, register, in_place, numel=40_000 * fast.world_size + 8)
    for r in replayed:
        assert torch.equal(r.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("in_place", (False, True), ids=("out_of_place", "in_place"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_shot_push_into_a_pool_output(comm, dtype, in_place):
    """custom-twoshot-push stores into the peers' pool outputs (two_shot_push) at any size at
    world 2, past the scratch buffer too, from an ordinary input or in place. Checked against
    the float64 reference, bit for bit across ranks and against one-shot (both sum in rank order
    with one rounding), empty too, then in a graph captured in graph_capture() and replayed.
    Elsewhere it declines, saying why (it has run on real ranks at world 2 only)."""
    from symcomm.backends import twoshot_push
    w, rank = comm.world_size, comm.rank
    algo = base.TWOSHOT_PUSH
    if w not in twoshot_push.REAL_WORLDS:
        with symcomm.use_symmetric_memory(comm):
            x = torch.empty(4096, dtype=dtype, device=comm.device)
        with pytest.raises(symcomm.SymcommError, match="world 2 only"):
            comm.all_reduce(x, algo=algo)
        return
    cap = peer_context.DEFAULT_STAGING_BYTES
    itemsize = torch.finfo(dtype).bits // 8
    for nbytes in (0, 16, 1008, 65_552, 1_000_016, cap + 48, 3 * cap + 16 * 7):
        numel = nbytes // itemsize
        inputs = all_inputs(numel, dtype, w, seed=nbytes % 997 + 61)
        with symcomm.use_symmetric_memory(comm):
            out = torch.empty(numel, dtype=dtype, device=comm.device)
        x = out if in_place else inputs[rank].clone()  # an ordinary input when out of place
        x.copy_(inputs[rank])
        comm.all_reduce(x, out=out, algo=algo)
        if not nbytes:
            continue  # nothing to check but that it returned: the next size's sum shows a broken path
        what = f"{algo}, {nbytes} bytes {dtype}{' in place' if in_place else ''}"
        assert_reduced(out, inputs, what)
        assert _gathered_equal(out), f"{what}: ranks hold different bits"
        with symcomm.use_symmetric_memory(comm):  # one-shot reads a pool input at any size
            one = torch.empty_like(out)
        one.copy_(inputs[rank])
        comm.all_reduce(one, out=one, algo=base.ONESHOT)
        assert torch.equal(one.view(torch.uint8), out.view(torch.uint8)), f"{what}: not one-shot's bits"
    numel = (1 << 20) // itemsize + 8
    inputs = all_inputs(numel, dtype, w, seed=67)
    with symcomm.use_symmetric_memory(comm):
        out = torch.empty(numel, dtype=dtype, device=comm.device)
    x = out if in_place else torch.empty_like(out)
    x.copy_(inputs[rank])
    comm.all_reduce(x, out=out, algo=algo)  # warm-up before capturing
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        comm.all_reduce(x, out=out, algo=algo)
    for replay in range(3):
        x.copy_(inputs[rank])
        if not in_place:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_reduced(out, inputs, f"{algo}, replay {replay}{' in place' if in_place else ''}")
        assert _gathered_equal(out), f"replay {replay}: ranks hold different bits"


@pytest.mark.parametrize("nbytes", (4096, (1 << 20) + 48))
def test_captured_one_shot_in_place_on_rank_0_only(fast, nbytes):
    """Inside graph_capture() rank 0 sums an ordinary tensor in place and its peers out of place.
    Each rank's input gets a slot of its own, as it would out of place, so the ranks' records
    agree at the capture's end; rank 0 sums through scratch and copies back after its peers
    have read its input. When an in-place call was staged instead, the records differed and
    the capture's end raised PeerMismatchError."""
    w, rank, dtype = fast.world_size, fast.rank, torch.bfloat16
    numel = nbytes // 2
    inputs = all_inputs(numel, dtype, w, seed=47)
    inp = torch.empty(numel, dtype=dtype, device=fast.device)
    out = inp if rank == 0 else torch.empty_like(inp)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inp.copy_(inputs[rank])
        fast.all_reduce(inp, out=out, algo=base.ONESHOT)  # warm-up before capturing
    torch.cuda.current_stream().wait_stream(side)
    assert_reduced(out, inputs, f"{nbytes} bytes eagerly, rank 0 in place")
    graph = torch.cuda.CUDAGraph()
    with fast.graph_capture(), torch.cuda.graph(graph):
        fast.all_reduce(inp, out=out, algo=base.ONESHOT)
    for replay in range(3):
        inp.copy_(inputs[rank])
        if rank:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_reduced(out, inputs, f"{nbytes} bytes, replay {replay}, rank 0 in place")
        assert _gathered_equal(out), f"{nbytes} bytes, replay {replay}: ranks hold different bits"


def test_registered_capture_reads_inputs_in_place(fast):
    """Inside graph_capture() a captured one-shot/two-shot call copies nothing; captured
    without it, it copies its input to the staging buffer first."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(graph):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    for algo in (base.ONESHOT, base.TWOSHOT):
        _, _, registered = _graph_case(fast, algo, True, False, numel=4096)
        _, _, staged = _graph_case(fast, algo, False, False, numel=4096)
        reg, stg = kernels(registered), kernels(staged)
        print(f"\n{algo}: registered replay {reg}; staged replay {stg}")
        assert not any("memcpy" in k.lower() for k in reg), reg
        assert any("memcpy" in k.lower() for k in stg), stg


def test_symmetric_inputs_are_read_in_place_without_copy(comm):
    """Pool regions are mapped from every peer at setup (cuMem handles over a Unix socket), so
    an eager one-/two-shot on a symmetric tensor launches the kernel alone; an ordinary tensor
    is copied to the staging buffer first. Both give the same bits."""
    from torch.profiler import ProfilerActivity, profile

    info = comm.capabilities()
    mapped = info["custom_all_reduce"]["symmetric_regions_mapped"]
    assert mapped == info["symmetric_memory"]["regions"] > 0, info["custom_all_reduce"]
    w, rank = comm.world_size, comm.rank
    numel = 64 * 1024 + 8 * w
    inputs = all_inputs(numel, torch.bfloat16, w, seed=31)
    with symcomm.use_symmetric_memory(comm):
        x = torch.empty(numel, dtype=torch.bfloat16, device=comm.device)
    x.copy_(inputs[rank])
    plain = inputs[rank].clone()
    for algo in (base.ONESHOT, base.TWOSHOT):
        results = []
        for t in (x, plain):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                results.append(comm.all_reduce(t, algo=algo))
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            copies = [n for n in names if "memcpy" in n.lower()]
            assert bool(copies) == (t is plain), (algo, t is plain, names)
        assert torch.equal(results[0], results[1]), algo
        assert_reduced(results[0], inputs, f"{algo} on symmetric input")


def test_one_shot_reads_symmetric_inputs_past_the_staging_capacity(comm):
    """A symmetric input is read where it lies, so one-shot serves messages past the staging
    buffer (odd vector count, not a power of two), out of place and in place (summed into a
    fresh tensor, copied back once every peer has read the input). Its bits equal the same
    kernel's on the first staging buffer's worth of the same input, in place too; its sums are
    within the reference's bound; every rank holds the same bits; captured replays give them
    again. An ordinary input, or two-shot, keeps the staging limit and the error says so."""
    w, rank, dtype = comm.world_size, comm.rank, torch.bfloat16
    nbytes = peer_context.DEFAULT_STAGING_BYTES + 4096 + 48
    numel, head = nbytes // 2, peer_context.DEFAULT_STAGING_BYTES // 2
    inputs = all_inputs(numel, dtype, w, seed=43)
    with symcomm.use_symmetric_memory(comm):
        x = torch.empty(numel, dtype=dtype, device=comm.device)
    x.copy_(inputs[rank])
    for in_place in (False, True):  # accepted (a forced algo raises where it cannot serve)
        comm.select("all_reduce", x, out=x if in_place else None, algo=base.ONESHOT)
    out = comm.all_reduce(x, algo=base.ONESHOT)
    assert torch.equal(x, inputs[rank]), "one-shot modified its input"
    assert_reduced(out, inputs, "one-shot past the staging capacity")
    within = comm.all_reduce(x[:head], algo=base.ONESHOT)
    assert torch.equal(out[:head].view(torch.int16), within.view(torch.int16))
    assert _gathered_equal(out), "ranks hold different bits"
    comm.all_reduce(x, out=x, algo=base.ONESHOT)
    assert torch.equal(x.view(torch.int16), out.view(torch.int16)), "in place differs from out of place"
    replayed = torch.full_like(out, float("nan"))
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    with comm.graph_capture(), torch.cuda.graph(graphs[0]):
        comm.all_reduce(x, out=replayed, algo=base.ONESHOT)
    with comm.graph_capture(), torch.cuda.graph(graphs[1]):
        comm.all_reduce(x, out=x, algo=base.ONESHOT)
    x.copy_(inputs[rank])
    graphs[0].replay()
    graphs[1].replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed.view(torch.int16), out.view(torch.int16))
    assert torch.equal(x.view(torch.int16), out.view(torch.int16)), "in-place replay"
    del graphs
    x.copy_(inputs[rank])
    plain = inputs[rank].clone()
    for why, call in (("ordinary input", lambda: comm.all_reduce(plain, algo=base.ONESHOT)),
                      ("two-shot", lambda: comm.all_reduce(x, algo=base.TWOSHOT))):
        with pytest.raises(symcomm.ArgumentError, match="capacity"):
            call()
    assert torch.equal(x, inputs[rank]) and torch.equal(plain, inputs[rank]), "a refused call wrote its input"


def test_capture_count_mismatch_raises_on_every_rank(fast):
    x = rank_input(4096, torch.bfloat16, fast.rank, seed=3)
    ys = [torch.empty_like(x) for _ in range(2)]
    fast.all_reduce(x, algo=base.ONESHOT)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(symcomm.PeerMismatchError, match="different numbers"):
        with fast.graph_capture(), torch.cuda.graph(graph):
            for i in range(1 + (fast.rank == 0)):  # rank 0 records two buffers, the others one
                fast.all_reduce(x if i == 0 else ys[0], out=ys[1], algo=base.ONESHOT)
    del graph  # never replayed
    torch.cuda.synchronize()
    # The communicator is still usable afterwards.
    assert_reduced(fast.all_reduce(x, algo=base.ONESHOT), all_inputs(4096, torch.bfloat16, fast.world_size, 3), "after")


def test_ten_thousand_calls_with_changing_sizes(fast):
    """Every one of 10,000 calls, not only the last of each size: auto takes one path per size,
    so each call must give the first call's bits (a stale buffer or epoch would not)."""
    w, rank = fast.world_size, fast.rank
    sizes = [16, 2064, 65_536, 131_088, 1 << 20, 3 << 20, 48, 8 << 20, 512]  # bytes
    inputs = {n: all_inputs(n // 2, torch.bfloat16, w, seed=n % 97) for n in sizes}
    expected = {n: fast.all_reduce(inputs[n][rank], algo="nccl") for n in sizes}
    first = {n: fast.all_reduce(inputs[n][rank]) for n in sizes}
    torch.cuda.synchronize()
    algos = {n: fast.select("all_reduce", inputs[n][rank]).algo for n in sizes}
    assert any(a.startswith("custom-") for a in algos.values()), algos
    for n in sizes:
        assert_reduced(first[n], inputs[n], f"{n} B ({algos[n]})")
        torch.testing.assert_close(first[n], expected[n], rtol=0.02, atol=0.05)
    differ = {n: torch.zeros((), dtype=torch.int64, device=fast.device) for n in sizes}
    for i in range(10_000):
        n = sizes[i % len(sizes)]
        differ[n] += (fast.all_reduce(inputs[n][rank]).view(torch.int16) != first[n].view(torch.int16)).sum()
        if i % 2500 == 2499:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    assert {n: int(d) for n, d in differ.items()} == dict.fromkeys(sizes, 0), algos


def test_fallback_reasons(fast):
    dev = fast.device
    cases = {
        "capacity": torch.ones(peer_context.DEFAULT_STAGING_BYTES // 2 + 8, dtype=torch.bfloat16, device=dev),
        "multiple of 16": torch.ones(1001, dtype=torch.bfloat16, device=dev),
        "dtype": torch.ones(1024, dtype=torch.int32, device=dev),
        "aligned": torch.ones(1028, dtype=torch.bfloat16, device=dev)[4:],  # 2048 bytes at +8
    }
    for expect, x in cases.items():
        choice = fast.select("all_reduce", x)
        assert not choice.algo.startswith("custom-"), (expect, choice)
        for algo in ALGOS:
            assert expect in choice.rejected[algo], (expect, algo, choice.rejected[algo])
    choice = fast.select("all_reduce", torch.ones(1024, device=dev), op="max")
    assert "only sum" in choice.rejected[base.ONESHOT]
    big_for_flagfree = torch.ones(capacity(base.FLAGFREE, fast.world_size) // 4 + 4, device=dev)
    with pytest.raises(symcomm.ArgumentError, match="capacity"):
        fast.all_reduce(big_for_flagfree, algo=base.FLAGFREE)


def _disabled_reason(**kwargs) -> str:
    with symcomm.Communicator(symmetric=False, **kwargs) as c:
        path = c.capabilities()["paths"][base.ONESHOT]
        assert not path["enabled"]
        assert base.ONESHOT not in c.algorithms()
        x = rank_input(4096, torch.float32, c.rank, seed=9)
        assert_reduced(c.all_reduce(x), all_inputs(4096, torch.float32, c.world_size, 9), "fallback")
        return path["reason"]


def test_disabled_by_environment(dist_env, monkeypatch):
    monkeypatch.setenv("SYMCOMM_DISABLE_CUSTOM_AR", "1")
    assert "SYMCOMM_DISABLE_CUSTOM_AR" in _disabled_reason()


def test_disabled_by_zero_capacity(dist_env):
    assert "custom_ar_capacity=0" in _disabled_reason(custom_ar_capacity=0)


def test_ranks_on_different_hosts_fall_back(dist_env, monkeypatch):
    monkeypatch.setattr(peer_setup, "host_identity", lambda: 1000 + dist.get_rank())
    assert "span hosts" in _disabled_reason()


def test_failed_p2p_test_falls_back(dist_env, monkeypatch):
    """Rank 1 stores a wrong token: the real store/load round trip catches it on every rank."""
    real = peer_setup.probe_token
    if dist.get_rank() == 1:
        monkeypatch.setattr(peer_setup, "probe_token", lambda r: real(r) ^ (0x100 if r == 1 else 0))
    assert "P2P test failed" in _disabled_reason()


def test_unsupported_world_size_falls_back(dist_env):
    """A real sub-group of world-1 ranks (1 at world 2, 3 at world 4): sizes the kernels
    don't serve. The group is created with use_local_synchronization: otherwise torch
    (2.11) makes each non-member join an NCCL split of the default group even for a gloo
    sub-group, which the members never join, and the non-member hangs in new_group."""
    w, rank = dist.get_world_size(), dist.get_rank()
    members = list(range(w - 1))
    if rank in members:
        group = dist.new_group(members, backend="gloo", use_local_synchronization=True)
        with symcomm.Communicator(group=group, device="cuda", symmetric=False) as c:
            reason = c.capabilities()["paths"][base.ONESHOT]["reason"]
            assert f"world size {len(members)} is unsupported" in reason, reason
            x = rank_input(512, torch.float32, rank, seed=4)
            expected = [rank_input(512, torch.float32, r, seed=4) for r in members]
            assert_reduced(c.all_reduce(x), expected, "sub-group all_reduce")
        dist.destroy_process_group(group)
    dist.barrier()


_WORKER = os.path.join(os.path.dirname(__file__), "_stall_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing_peer_workers(mode: str, tmp_path) -> tuple[str, str]:
    """Rank 0's and rank 1's output of the two worker processes for ``mode``. A port that
    _free_port found free can be taken by another process's socket before the workers bind it;
    that attempt fails at setup with EADDRINUSE and is retried on a new port."""
    for attempt in range(3):
        port = _free_port()
        procs, logs = [], []
        for r in range(2):
            # Not torchrun's children: drop its agent-store settings so they rendezvous alone.
            base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
            env = dict(base, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SYMCOMM_TIMEOUT_S="6")
            # Output to files, not pipes: reading a pipe waits for every holder of its write end.
            logs.append(tmp_path / f"{mode}{attempt}_rank{r}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen([sys.executable, _WORKER, mode], env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        try:
            procs[0].wait(timeout=45)
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                p.kill()
                p.wait()
        out, peer = (log.read_text() for log in logs)
        print(f"\n{mode} worker rank 0 (port {port}):\n{out}\nrank 1:\n{peer}")
        if "EADDRINUSE" not in out:
            break
    return out, peer


@pytest.mark.parametrize("mode", ("stall", "kill"))
def test_missing_peer_raises_within_the_timeout(dist_env, mode, tmp_path):
    """Two fresh processes on GPUs 0 and 1 (rank 0 of this suite runs them): rank 1 stalls or
    dies before an all-reduce; rank 0's kernel must give up within SYMCOMM_TIMEOUT_S (6 s
    here, which also bounds their NCCL init) and the next call must raise CommTimeoutError
    naming rank 1. With a stalled peer rank 0's CUDA context must still work afterwards; a dead
    peer's memory may vanish under rank 0's stores, so there only the bound is checked."""
    try:
        if dist.get_rank() == 0:
            out, _ = _missing_peer_workers(mode, tmp_path)
            line = next((l for l in out.splitlines() if l.startswith("RESULT")),
                        "RESULT none (no result within 45 s)")
            _, raised, seconds = line.split()[:3]
            assert raised == "raised", line
            # A stalled peer: the kernel waits out its 6 s bound, then gives up, and the context
            # lives on. A dead peer's memory may vanish under rank 0's stores (a fault CUDA reports
            # on its own), so for it only the bound is checked: an error well before any hang.
            assert float(seconds) < 20 and (mode == "kill" or float(seconds) >= 5.5), line
            assert mode == "kill" or "CONTEXT ok" in out, out
    finally:
        # Every rank meets here even when rank 0's checks fail: a barrier one rank skipped would
        # pair with the next test's, and the ranks' later collectives would cross (a hang).
        dist.barrier()


CASES = {"two-shot-push in place": base.TWOSHOT_PUSH, "flag-free all_gather of a misaligned view": base.FLAGFREE,
         "push all_gather of a misaligned view": base.PUSH}


@pytest.mark.parametrize("case", CASES)
def test_a_copied_input_follows_the_previous_launch_on_another_stream(comm, case):
    """These paths copy their input before launching (the own chunk in place; a misaligned view
    to an aligned one). The input here is the output of symcomm's previous call, made on
    another stream behind a long kernel: the copy must wait for that launch, as the kernel
    does, or it reads the old bytes. Without the wait the result below is wrong on every rank."""
    from symcomm.backends import custom_ar, twoshot_push
    w, rank, dtype, algo = comm.world_size, comm.rank, torch.bfloat16, CASES[case]
    if algo == base.TWOSHOT_PUSH and w not in twoshot_push.REAL_WORLDS:
        pytest.skip(f"{algo} runs at world {twoshot_push.REAL_WORLDS} only (the push case runs at every world)")
    if algo == base.FLAGFREE and w not in custom_ar.FLAGFREE_COLLECTIVE_WORLDS:
        pytest.skip(f"{algo} gathers at world {custom_ar.FLAGFREE_COLLECTIVE_WORLDS} only (the push case runs "
                    f"at every world)")
    per_rank = 8200  # bf16 elements: 16,400 bytes, whole 16-byte vectors as flag-free needs
    n = per_rank * w
    first_input = rank_input(n, dtype, rank, seed=79)
    with symcomm.use_symmetric_memory(comm):
        y = torch.empty(n, dtype=dtype, device=comm.device)
        gathered = torch.empty((per_rank - 8) * w, dtype=dtype, device=comm.device)

    def first(stream_y: torch.Tensor) -> None:
        if algo == base.TWOSHOT_PUSH:
            comm.all_reduce(stream_y, out=stream_y, algo=algo)
        else:
            comm.all_gather(first_input[:per_rank], out=stream_y, algo=algo)

    def second(stream_y: torch.Tensor) -> torch.Tensor:
        if algo == base.TWOSHOT_PUSH:
            return comm.all_reduce(stream_y, out=stream_y, algo=algo)
        # 2 bytes past a vector, per_rank - 8 elements: whole vectors
        return comm.all_gather(stream_y[1:per_rank - 7], out=gathered, algo=algo)

    y.copy_(first_input)  # the reference, eagerly on one stream
    first(y)
    want = second(y).clone()
    if algo == base.TWOSHOT_PUSH:
        y.copy_(first_input)  # the first call's input
    else:
        y.fill_(7.0)  # what a copy that does not wait would read
    here, behind, ahead = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    behind.wait_stream(here)
    ahead.wait_stream(here)
    with torch.cuda.stream(behind):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds: the next call is made long before
        first(y)
    with torch.cuda.stream(ahead):
        got = second(y)
    here.wait_stream(behind)
    here.wait_stream(ahead)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{case}: the copy read the old input"
