"""The fused FP4 dispatch without a GPU: the kernel's encoding and addressing (its host twin)
bit for bit against the codec, why the fused path declines each call it cannot serve, the
launch it builds, the choice select() explains over gloo, and check mode's offset comparison
with stand-ins for the pool and the peers."""
from __future__ import annotations

import pytest
import torch

import symcomm
from _spawn import run_world
from symcomm import checks, fp4, fp4_gather
from symcomm.backends import custom
from symcomm.base import PUSH
from symcomm.fp4_gather import FUSED, UNFUSED, Fp4Gathered, _Args, _Outs
from symcomm.peers import PeerRefusal

NATIVE, WHY_NOT = fp4.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"csrc/ is not built: {WHY_NOT}")
HALVES = (torch.bfloat16, torch.float16)


def _rows(n: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian rows over six decades, with an all-zero block and a -0 block where there is room."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen) * torch.logspace(-3, 3, max(n, 1))[:n].unsqueeze(1)
    if n:
        x[0, :16] = 0.0
        x[-1, -16:] = -0.0
    return x.to(dtype)


# ------------------------------------------------------------------------ bytes: host twin vs codec
@needs_native
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("sizes", [(0, 5), (3, 0, 1, 7), (1, 0, 0, 2, 9, 0, 3, 1), (33, 0, 130, 1)], ids=str)
@pytest.mark.parametrize("h", (16, 48, 7168))
def test_fused_bytes_equal_the_codec_concatenated(dtype, sizes, h):
    world, total = len(sizes), sum(sizes)
    xs = [_rows(n, h, dtype, 31 * r + h) for r, n in enumerate(sizes)]
    gs = float(fp4.global_scale_for(torch.cat(xs)).item())
    for scale in (gs, 1.0):
        # What every rank's outputs hold once all ranks have written: filled with a byte the
        # codec can write too, so an unwritten byte shows up in the second pass.
        for fill in (0xA5, 0x5A):
            packed = torch.full((total, h // 2), fill, dtype=torch.uint8)
            scales = torch.full((total, h // 16), fill, dtype=torch.uint8).view(torch.float8_e4m3fn)
            first = 0
            for r in range(world):
                fp4_gather.fused_rows_host(xs[r], scale, first, packed, scales)
                first += sizes[r]
            codec = [fp4.quantize_host(x, scale) for x in xs]
            what = f"world {world} sizes {sizes} h {h} {dtype} gs {scale} fill {fill:#x}"
            assert torch.equal(packed, torch.cat([p for p, _ in codec])), "payload " + what
            assert torch.equal(scales.view(torch.uint8), torch.cat([s.view(torch.uint8) for _, s in codec])), \
                "scales " + what
            ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), scale)
            assert torch.equal(packed, ref_packed), "payload vs reference " + what
            assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8)), "scales vs reference " + what


@needs_native
def test_a_rank_writes_only_its_own_rows():
    sizes, h = (2, 3, 0, 4), 48
    packed = torch.full((sum(sizes), h // 2), 0xEE, dtype=torch.uint8)
    scales = torch.full((sum(sizes), h // 16), 0xEE, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = _rows(3, h, torch.bfloat16, 5)
    fp4_gather.fused_rows_host(x, 2.0, 2, packed, scales)
    want_p, want_s = fp4.quantize_host(x, 2.0)
    assert torch.equal(packed[2:5], want_p) and torch.equal(scales[2:5].view(torch.uint8), want_s.view(torch.uint8))
    for rows in (slice(0, 2), slice(5, 9)):
        assert packed[rows].eq(0xEE).all() and scales[rows].view(torch.uint8).eq(0xEE).all()


@needs_native
def test_host_twin_rejects_bad_arguments():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    packed, scales = torch.empty(4, 16, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.float8_e4m3fn)
    for call, fragment in [
        (lambda: fp4_gather.fused_rows_host(x.float(), 1.0, 0, packed, scales), "bfloat16 or float16"),
        (lambda: fp4_gather.fused_rows_host(x, 1.0, 3, packed, scales), "row_offset"),
        (lambda: fp4_gather.fused_rows_host(x, 1.0, 0, packed, scales[:3]), "scales has shape"),
        (lambda: fp4_gather.fused_rows_host(x, 0.0, 0, packed, scales), "global_scale"),
    ]:
        with pytest.raises(symcomm.SymcommError, match=fragment):
            call()
    lib = fp4._host_lib()
    # The entry point refuses what Python would never pass: rows past the gathered output.
    assert lib.symcomm_ar_gatherv_fp4_host(x.data_ptr(), 2, 2, 32, 3, 4, 1.0, packed.data_ptr(),
                                           scales.data_ptr()) != 0
    assert lib.symcomm_ar_gatherv_fp4_host(x.data_ptr(), 0, 2, 32, 0, 4, 1.0, packed.data_ptr(),
                                           scales.data_ptr()) != 0  # fp32: not a fused dtype


# ------------------------------------------------------------------------ why_not, with stand-ins
class FakeState:
    """What the fused path reads of CustomAllReduce: mapped regions and a recording library."""

    def __init__(self, regions=()):
        self.granules = {}
        self.region_slots, self.region_numbers = {}, {}
        self.region_problem = None
        self.capture = None
        self.lib = FakeLib()
        self.ctx = 77
        for number, t in enumerate(regions):
            self.map(t, number)

    region_of = custom.CustomAllReduce.region_of
    session = custom.CustomAllReduce.session
    output_slot = custom.CustomAllReduce.output_slot

    def map(self, t: torch.Tensor, number: int) -> None:
        base = t.data_ptr()
        for g in range(base >> 21, ((base + max(t.nbytes, 1) - 1) >> 21) + 1):
            self.granules[g] = base
        self.region_slots[base] = 10 + number
        self.region_numbers[base] = number

    def launch_stream(self, session):
        return 0xABC

    def check(self, what, code):
        raise AssertionError(f"{what}: {code}")


class FakeLib:
    def __init__(self):
        self.launches = []

    def symcomm_ar_gatherv_fp4(self, *args):
        self.launches.append(args)
        return 0


class FakePath:
    def __init__(self, state):
        self._state = state


class FakeComm:
    def __init__(self, rank=0, world=4, device="cuda:0", state=None, off=None):
        self.rank, self.world_size = rank, world
        self.device = torch.device(device)
        self._paths = {} if state is None else {PUSH: FakePath(state)}
        self._off = {} if off is None else {PUSH: off}
        self.healthy_checks = 0

    def check_health(self):
        self.healthy_checks += 1

    def algorithms(self):
        return ["nccl", *self._paths]


def _alone(shape, dtype, skew: int = 0) -> torch.Tensor:
    """A tensor starting on a 2 MiB boundary (plus ``skew`` bytes), so each is its own region."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + (4 << 20), dtype=torch.uint8)
    start = -raw.data_ptr() % (2 << 20) + skew
    return raw[start:start + nbytes].view(dtype).view(shape)


def _case(sizes=(3, 0, 5, 1), rank=0, h=48, dtype=torch.bfloat16, extra_cols=(8, 8), in_pool=True, skew=0):
    total, n = sum(sizes), sizes[rank]
    x = _alone((n, h), dtype)
    extra = [_alone((n, c), torch.int32) for c in extra_cols]
    outs = _Outs(_alone((total, h // 2), torch.uint8, skew), _alone((total, h // 16), torch.float8_e4m3fn),
                 [_alone((total, c), torch.int32) for c in extra_cols])
    state = FakeState([t for _, t in outs.named()] if in_pool else [])
    return _Args(x, list(sizes), 2.5, extra, None), outs, state


FUSED_PATH = fp4_gather._BY_NAME[FUSED]


def test_fused_path_serves_symmetric_outputs():
    a, outs, state = _case()
    assert FUSED_PATH.why_not(FakeComm(state=state), a, outs) is None
    a, outs, state = _case(sizes=(0, 4, 0, 0), dtype=torch.float16, extra_cols=())
    assert FUSED_PATH.why_not(FakeComm(state=state), a, outs) is None


@pytest.mark.parametrize("case, fragment", [
    ("cpu", "runs on CUDA devices"),
    ("dtype", "bfloat16 and float16"),
    ("too_many", "9 tensors (payload, scales and 7 extra) exceed the 8"),
    ("world_size", "world size 3 is unsupported"),
    ("not_symmetric", "out.packed is not in a mapped symmetric pool region"),
    ("one_output_outside", "out.extra[1] is not in a mapped symmetric pool region"),
    ("region_problem", "peers could not map region 2"),
    ("packed_misaligned", "out.packed does not start on a 16-byte boundary"),
    ("extra_rows", "extra[0]: rows of 12 bytes"),
])
def test_fused_path_says_why_it_declines(case, fragment):
    a, outs, state = _case()
    comm = FakeComm(state=state)
    if case == "cpu":
        comm = FakeComm(device="cpu", state=state)
    elif case == "dtype":
        a = a._replace(x=a.x.float())
    elif case == "too_many":
        a = a._replace(extra=[a.extra[0]] * 7)
        outs = outs._replace(extra=[outs.extra[0]] * 7)
    elif case == "world_size":
        comm = FakeComm(world=3, off="custom all-reduce: world size 3 is unsupported (the kernels serve 2, 4, 6, 8 "
                                    "ranks)")
    elif case == "not_symmetric":
        a, outs, state = _case(in_pool=False)
        comm = FakeComm(state=state)
    elif case == "one_output_outside":
        outs.extra[1] = _alone(tuple(outs.extra[1].shape), torch.int32)
    elif case == "region_problem":
        a, outs, state = _case(in_pool=False)
        state.region_problem = "peers could not map region 2"
        comm = FakeComm(state=state)
    elif case == "packed_misaligned":
        a, outs, state = _case(skew=8)
        comm = FakeComm(state=state)
    elif case == "extra_rows":
        a, outs, state = _case(extra_cols=(3,))
        comm = FakeComm(state=state)
    reason = FUSED_PATH.why_not(comm, a, outs)
    assert reason is not None and fragment in reason, reason
    path, gather_algo, rejected = fp4_gather._choose(comm, a, outs, "auto")
    assert path.name == UNFUSED and gather_algo == "auto" and rejected == {FUSED: reason}
    with pytest.raises(symcomm.ArgumentError, match="algo='fused-push' cannot serve"):
        fp4_gather._choose(comm, a, outs, FUSED)


def test_a_misaligned_input_does_not_change_the_path():
    """Alignment of x is this rank's alone: deciding on it could send ranks down different paths
    to wait for each other, so the fused path takes a misaligned x (and copies it)."""
    a, outs, state = _case()
    raw = _alone((a.x.numel() + 8,), torch.bfloat16)
    a = a._replace(x=raw[1:1 + a.x.numel()].view(a.x.shape))
    assert a.x.data_ptr() % 16 and FUSED_PATH.why_not(FakeComm(state=state), a, outs) is None
    assert custom.aligned(a.x).data_ptr() % 16 == 0 and torch.equal(custom.aligned(a.x), a.x)


def test_a_gather_algo_forces_the_unfused_path():
    a, outs, state = _case()
    comm = FakeComm(state=state)
    path, gather_algo, rejected = fp4_gather._choose(comm, a, outs, "nccl")
    assert (path.name, gather_algo) == (UNFUSED, "nccl") and "forces the unfused path" in rejected[FUSED]
    with pytest.raises(symcomm.ArgumentError, match="must be a string"):
        fp4_gather._choose(comm, a, outs, 3)


def test_fused_launch_addresses_every_tensor_at_this_ranks_rows():
    sizes, rank, h = (3, 0, 5, 1), 2, 48
    a, outs, state = _case(sizes=sizes, rank=rank, h=h)
    comm = FakeComm(rank=rank, state=state)
    FUSED_PATH.run(comm, a, outs, "auto")
    assert comm.healthy_checks == 1
    (launch,) = state.lib.launches
    (ctx, x_ptr, dtype, n, cols, row_offset, total, gs_ptr, gs_value, pslot, poff, sslot, soff, k, srcs, slots,
     offsets, row_bytes, stream) = launch
    assert (ctx, x_ptr, dtype, n, cols, row_offset, total) == (77, a.x.data_ptr(), 2, 5, h, 3, 9)
    assert (gs_ptr, gs_value, stream) == (None, 2.5, 0xABC)
    assert (pslot, poff, sslot, soff) == (10, 0, 11, 0)  # each output is its own region, at offset 0
    assert k == 2 and list(srcs) == [t.data_ptr() for t in a.extra]
    assert list(slots) == [12, 13] and list(offsets) == [0, 0] and list(row_bytes) == [32, 32]
    # Nothing to gather anywhere: no rank launches (every rank knows the total).
    a0, outs0, state0 = _case(sizes=(0, 0, 0, 0))
    FUSED_PATH.run(FakeComm(state=state0), a0, outs0, "auto")
    assert state0.lib.launches == []


def test_fused_launch_records_captured_outputs(monkeypatch):
    a, outs, state = _case()
    state.capture = custom.CaptureSession()
    comm = FakeComm(state=state)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    FUSED_PATH.run(comm, a, outs, "auto")  # eager, with a session open: nothing recorded
    assert state.capture.calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    FUSED_PATH.run(comm, a, outs, "auto")
    assert state.capture.calls == [(custom.IN_REGION, fp4_gather.CAPTURE_CODE, t.nbytes, number, 0)
                                   for number, (_, t) in enumerate(outs.named())]


# ------------------------------------------------------------------------ check mode, with stand-ins
class FakePool:
    def __init__(self, state):
        self.state = state

    def locate(self, ptr):
        base = self.state.granules.get(ptr >> 21, -1)
        return (-1, -1) if base < 0 else (self.state.region_numbers[base], ptr - base)


class Table:
    def __init__(self, rows):
        self.rows = rows

    def exchange(self, values, kind="setup"):
        assert len(values) == len(self.rows[0]) and kind == "check"
        return self.rows


def _signature_of(rank, sizes, shift=0):
    a, outs, state = _case(sizes=sizes, rank=rank)
    if shift:  # this rank's scales sit `shift` bytes further into their region
        raw = _alone((outs.scales.numel() + shift,), torch.uint8)
        outs = outs._replace(scales=raw[shift:].view(torch.float8_e4m3fn).view(outs.scales.shape))
        state.map(raw, 1)
    comm = FakeComm(rank=rank, state=state)
    comm.symmetric_pool = FakePool(state)
    return comm, a, outs, fp4_gather.signature(comm, a, outs, FUSED_PATH)


def test_check_mode_names_the_output_at_another_offset():
    sizes = (3, 0, 5, 1)
    rows = [_signature_of(r, sizes, shift=512 if r == 2 else 0)[3][0] for r in range(4)]
    comm, a, outs, _ = _signature_of(0, sizes)
    comm.peers = Table(rows)
    with pytest.raises(symcomm.PeerMismatchError) as info:
        fp4_gather.verify(comm, a, outs, FUSED_PATH)
    message = str(info.value)
    assert "window offset of 'out.scales'" in message and "rank 2: 512" in message, message
    assert "outside it" in message and "Offsets stay symmetric" in message


def test_check_mode_leaves_per_rank_inputs_free_and_compares_the_rest():
    sizes = (3, 0, 5, 1)
    signatures = [_signature_of(r, sizes) for r in range(4)]
    comm, a, outs, _ = signatures[0]
    # Every rank's x and extras sit elsewhere (their own allocations): no mismatch.
    comm.peers = Table([sig[0] for *_, sig in signatures])
    fp4_gather.verify(comm, a, outs, FUSED_PATH)
    # Another global scale, another path, a refusal: each named.
    values, names = signatures[0][3]
    other_scale = list(values)
    other_scale[names.index("global_scale")] = checks.float_bits(3.0)
    comm.peers = Table([values, other_scale, values, values])
    with pytest.raises(symcomm.PeerMismatchError, match=r"disagree on the global_scale .rank 0: 2\.5, rank 1: 3\.0"):
        fp4_gather.verify(comm, a, outs, FUSED_PATH)
    unfused = fp4_gather.signature(comm, a, outs, fp4_gather._BY_NAME[UNFUSED])[0]
    comm.peers = Table([values, unfused, values, values])
    with pytest.raises(symcomm.PeerMismatchError, match="disagree on the path .rank 0: fused-push, rank 1: unfused"):
        fp4_gather.verify(comm, a, outs, FUSED_PATH)
    comm.peers = Refusing({1: "ArgumentError: x has 4 rows"})
    with pytest.raises(symcomm.PeerMismatchError, match=r"rank\(s\) 1 rejected.*x has 4 rows"):
        fp4_gather.verify(comm, a, outs, FUSED_PATH)


class Refusing:
    """Peers whose exchange finds that some ranks refused (peers.Peers raises PeerRefusal)."""

    def __init__(self, reasons):
        self.reasons = reasons

    def exchange(self, values, kind="setup"):
        raise PeerRefusal(kind, self.reasons)


# ------------------------------------------------------------------------ over gloo
def _select_on_gloo(rank, world):
    comm = symcomm.Communicator()
    sizes = [2, 0, 3][:world]
    x = torch.randn(sizes[rank], 64)
    ids = torch.zeros(sizes[rank], 4, dtype=torch.int32)
    choice = comm.select("all_gatherv_fp4", x, sizes=sizes, global_scale=1.0, extra=[ids])
    assert isinstance(choice, fp4_gather.Fp4Choice) and choice.algo == UNFUSED
    assert "runs on CUDA devices" in choice.rejected[FUSED], choice
    assert choice.gather is not None and choice.gather.algo in comm.algorithms()
    forced = fp4_gather.select(comm, x, sizes, 1.0, [ids], algo=comm.algorithms()[0])
    assert forced.gather.algo == comm.algorithms()[0] and "forces the unfused path" in forced.rejected[FUSED]
    with pytest.raises(symcomm.ArgumentError, match="algo='fused-push' cannot serve"):
        comm.all_gatherv_fp4(x, sizes, 1.0, algo=FUSED)
    got = comm.all_gatherv_fp4(x, sizes, 1.0, extra=[ids], algo=UNFUSED)
    total = sum(sizes)
    assert got.packed.shape == (total, 32) and got.extra[0].shape == (total, 4)
    out = Fp4Gathered(torch.empty(total, 32, dtype=torch.uint8), torch.empty(total, 4, dtype=torch.float8_e4m3fn),
                      (torch.empty(total, 4, dtype=torch.int32),), None, None)
    again = comm.all_gatherv_fp4(x, sizes, 1.0, extra=[ids], out=out)
    assert again.packed is out.packed and torch.equal(again.packed, got.packed)
    comm.close()


def test_select_explains_the_fp4_path_over_gloo():
    run_world(_select_on_gloo, 3, timeout_s=120)

