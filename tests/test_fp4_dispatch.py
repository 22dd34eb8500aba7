"""The fused FP4 dispatch without a GPU: the kernel's encoding and addressing (its host twin)
bit for bit against the codec, why the fused path declines each call it cannot serve, the
launch it builds, the choice select() explains over gloo, and check mode's offset comparison
with stand-ins for the pool and the peers."""
from __future__ import annotations

import ctypes

import pytest
import torch

import symcomm
from _spawn import run_world
from types import SimpleNamespace

from symcomm import _native, base, check_mode, fp4
from symcomm.backends.composite import UnfusedFp4Path
from symcomm.backends.fp4_push import CAPTURE_CODE, FusedPushFp4Path, fused_rows_host
from symcomm.operations.all_gatherv_fp4 import ALL_GATHERV_FP4, FUSED, UNFUSED, Fp4Call, Fp4Choice, Fp4Gathered
from symcomm.peer import capture as peer_capture
from symcomm.peer import context as peer_context
from symcomm.peer.setup import SharedContext
from symcomm.peers import PeerRefusal

needs_native = pytest.mark.needs_native
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
                fused_rows_host(xs[r], scale, first, packed, scales)
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
    fused_rows_host(x, 2.0, 2, packed, scales)
    want_p, want_s = fp4.quantize_host(x, 2.0)
    assert torch.equal(packed[2:5], want_p) and torch.equal(scales[2:5].view(torch.uint8), want_s.view(torch.uint8))
    for rows in (slice(0, 2), slice(5, 9)):
        assert packed[rows].eq(0xEE).all() and scales[rows].view(torch.uint8).eq(0xEE).all()


@needs_native
def test_host_twin_rejects_bad_arguments():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    packed, scales = torch.empty(4, 16, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.float8_e4m3fn)
    for call, fragment in [
        (lambda: fused_rows_host(x.float(), 1.0, 0, packed, scales), "bfloat16 or float16"),
        (lambda: fused_rows_host(x, 1.0, 3, packed, scales), "row_offset"),
        (lambda: fused_rows_host(x, 1.0, 0, packed, scales[:3]), "scales has shape"),
        (lambda: fused_rows_host(x, 0.0, 0, packed, scales), "global_scale"),
    ]:
        with pytest.raises(symcomm.SymcommError, match=fragment):
            call()
    lib = fp4.host_lib()
    # The entry point refuses what Python would never pass: rows past the gathered output.
    past = _native.GathervFp4Args(x=x.data_ptr(), dtype=2, rows=2, cols=32, row_offset=3, total_rows=4, gs_value=1.0)
    assert lib.symcomm_ar_gatherv_fp4_host(ctypes.byref(past), packed.data_ptr(), scales.data_ptr()) != 0
    fp32 = _native.GathervFp4Args(x=x.data_ptr(), dtype=0, rows=2, cols=32, row_offset=0, total_rows=4, gs_value=1.0)
    assert lib.symcomm_ar_gatherv_fp4_host(ctypes.byref(fp32), packed.data_ptr(), scales.data_ptr()) != 0  # not fused


# ------------------------------------------------------------------------ why_not, with stand-ins
class FakeState:
    """What the fused path reads of its PeerContext: mapped regions and a recording library."""

    def __init__(self, regions=(), device_index=0):
        self.granules = {}
        self.region_slots, self.region_numbers = {}, {}
        self.region_problem = None
        self.capture = None
        self.alarm = None
        self.device_index = device_index
        self.rank = 0
        self.lib = FakeLib()
        self.ctx = 77
        for number, t in enumerate(regions):
            self.map(t, number)

    region_of = peer_context.PeerContext.region_of
    session = peer_context.PeerContext.session
    output_slot = peer_context.PeerContext.output_slot

    def map(self, t: torch.Tensor, number: int) -> None:
        base = t.data_ptr()
        for g in range(base >> 21, ((base + max(t.nbytes, 1) - 1) >> 21) + 1):
            self.granules[g] = base
        self.region_slots[base] = 10 + number
        self.region_numbers[base] = number

    launch_inputs = peer_context.PeerContext.launch_inputs

    def launch_stream(self, session):
        return 0xABC

    def check(self, what, code):
        raise AssertionError(f"{what}: {code}")


class FakeLib:
    def __init__(self):
        self.launches = []

    def symcomm_ar_gatherv_fp4(self, ctx, args, stream):
        a = args._obj  # ctypes.byref's target: the symcomm_gatherv_fp4_args_t
        k = a.nextra
        self.launches.append((ctx, a.x, a.dtype, a.rows, a.cols, a.row_offset, a.total_rows, a.gs_ptr, a.gs_value,
                              a.payload_slot, a.payload_offset, a.scales_slot, a.scales_offset, k, a.extra_srcs[:k],
                              a.extra_slots[:k], a.extra_offsets[:k], a.extra_row_bytes[:k], stream))
        return 0


def _alone(shape, dtype, skew: int = 0) -> torch.Tensor:
    """A tensor starting on a 2 MiB boundary (plus ``skew`` bytes), so each is its own region."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + (4 << 20), dtype=torch.uint8)
    start = -raw.data_ptr() % (2 << 20) + skew
    return raw[start:start + nbytes].view(dtype).view(shape)


def _call(sizes=(3, 0, 5, 1), rank=0, h=48, dtype=torch.bfloat16, extra_cols=(8, 8), skew=0, x=None, extra=None,
          gathered=None) -> Fp4Call:
    total, n = sum(sizes), sizes[rank]
    x = _alone((n, h), dtype) if x is None else x
    extra = [_alone((n, c), torch.int32) for c in extra_cols] if extra is None else extra
    gathered = ([_alone((total, c), torch.int32) for c in extra_cols] if gathered is None else gathered)
    return Fp4Call(x, list(sizes), 2.5, extra, _alone((total, h // 2), torch.uint8, skew),
                   _alone((total, h // 16), torch.float8_e4m3fn), gathered, False, False, None)


def _case(in_pool=True, **kwargs):
    call = _call(**kwargs)
    state = FakeState([t for _, t in call.named_outputs()] if in_pool else [])
    state.rank = kwargs.get("rank", 0)
    return call, state


def _router(state, off=None, rank=0):
    """A Router holding the FP4 paths (the fused one over ``state``, or off with ``off``) and a
    plain gather path, as a Communicator would."""
    from symcomm.dispatch import Router, builtin_table
    from symcomm.operations import ALL_GATHERV, ALL_GATHERV_FP4
    router = Router(builtin_table(4), {ALL_GATHERV_FP4.name: ALL_GATHERV_FP4, ALL_GATHERV.name: ALL_GATHERV}, rank)
    router.add(FusedPushFp4Path(SharedContext(state)) if off is None else FusedPushFp4Path(), off)
    unfused = UnfusedFp4Path()
    unfused.open(SimpleNamespace(dispatcher=router))
    router.add(unfused, None)
    router.add(SimpleNamespace(name="nccl", ops=frozenset({"all_gatherv"}), why_not=lambda call: None), None)
    return router


def test_fused_path_serves_symmetric_outputs():
    call, state = _case()
    assert FusedPushFp4Path(SharedContext(state)).why_not(call) is None
    call, state = _case(sizes=(0, 4, 0, 0), dtype=torch.float16, extra_cols=())
    assert FusedPushFp4Path(SharedContext(state)).why_not(call) is None


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
    call, state = _case()
    off = None
    if case == "cpu":
        state.device_index = None
    elif case == "dtype":
        call = _call(dtype=torch.float32)
        state = FakeState([t for _, t in call.named_outputs()])
    elif case == "too_many":
        extra = [_alone((3, 8), torch.int32)] * 7
        call = _call(extra=extra, gathered=[_alone((9, 8), torch.int32)] * 7)
        state = FakeState([t for _, t in call.named_outputs()])
    elif case == "world_size":
        off = "symcomm's peer-memory kernels are off: world size 3 is unsupported (the kernels serve 2, 4, 6, 8 ranks)"
    elif case == "not_symmetric":
        call, state = _case(in_pool=False)
    elif case == "one_output_outside":
        call.gathered_extra[1] = _alone(tuple(call.gathered_extra[1].shape), torch.int32)
    elif case == "region_problem":
        call, state = _case(in_pool=False)
        state.region_problem = "peers could not map region 2"
    elif case == "packed_misaligned":
        call, state = _case(skew=8)
    elif case == "extra_rows":
        call, state = _case(extra_cols=(3,))
    router = _router(state, off)
    path, choice = router.choose(ALL_GATHERV_FP4, call, "auto", explain=True)
    reason = choice.rejected[FUSED]
    assert fragment in reason, reason
    assert path.name == UNFUSED and call.inner_algo == "auto"
    expected = "is unavailable" if off else "algo='fused-push' cannot serve"
    with pytest.raises(symcomm.ArgumentError, match=expected):
        router.choose(ALL_GATHERV_FP4, call, FUSED)


def test_a_misaligned_input_does_not_change_the_path():
    """Alignment of x is this rank's alone: deciding on it could send ranks down different paths
    to wait for each other, so the fused path takes a misaligned x (and copies it)."""
    raw = _alone((3 * 48 + 8,), torch.bfloat16)
    # Finite values: left uninitialised, the bytes could hold a NaN, which torch.equal never matches.
    raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(5)))
    call, state = _case(x=raw[1:1 + 3 * 48].view(3, 48))
    assert call.x.data_ptr() % 16 and FusedPushFp4Path(SharedContext(state)).why_not(call) is None
    assert peer_context.aligned(call.x).data_ptr() % 16 == 0 and torch.equal(peer_context.aligned(call.x), call.x)


def test_a_gather_algo_forces_the_unfused_path():
    call, state = _case()
    router = _router(state)
    path, choice = router.choose(ALL_GATHERV_FP4, call, "nccl", explain=True)
    assert (path.name, call.inner_algo) == (UNFUSED, "nccl") and "algo='nccl' forces unfused" in choice.rejected[FUSED]
    with pytest.raises(symcomm.ArgumentError, match="must be a string"):
        router.choose(ALL_GATHERV_FP4, _call(), 3)


def test_fused_launch_addresses_every_tensor_at_this_ranks_rows():
    sizes, rank, h = (3, 0, 5, 1), 2, 48
    call, state = _case(sizes=sizes, rank=rank, h=h)
    FusedPushFp4Path(SharedContext(state)).run(call)
    (launch,) = state.lib.launches
    (ctx, x_ptr, dtype, n, cols, row_offset, total, gs_ptr, gs_value, pslot, poff, sslot, soff, k, srcs, slots,
     offsets, row_bytes, stream) = launch
    assert (ctx, x_ptr, dtype, n, cols, row_offset, total) == (77, call.x.data_ptr(), 2, 5, h, 3, 9)
    assert (gs_ptr, gs_value, stream) == (None, 2.5, 0xABC)
    assert (pslot, poff, sslot, soff) == (10, 0, 11, 0)  # each output is its own region, at offset 0
    assert k == 2 and list(srcs) == [t.data_ptr() for t in call.extra]
    assert list(slots) == [12, 13] and list(offsets) == [0, 0] and list(row_bytes) == [32, 32]
    # Nothing to gather anywhere: no rank launches (every rank knows the total).
    call0, state0 = _case(sizes=(0, 0, 0, 0))
    FusedPushFp4Path(SharedContext(state0)).run(call0)
    assert state0.lib.launches == []


def test_fused_launch_records_captured_outputs(monkeypatch):
    call, state = _case()
    state.capture = peer_capture.CaptureSession()
    path = FusedPushFp4Path(SharedContext(state))
    monkeypatch.setattr(base, "_stream_capturing", lambda: False)
    path.run(call)  # eager, with a session open: nothing recorded
    assert state.capture.calls == []
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    path.run(call)
    assert state.capture.calls == [(peer_capture.IN_REGION, CAPTURE_CODE, t.nbytes, number, 0)
                                   for number, (_, t) in enumerate(call.named_outputs())]


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


PATH_NAMES = [FUSED, UNFUSED]


def _signature_of(rank, sizes, shift=0, path=FUSED):
    call, state = _case(sizes=sizes, rank=rank)
    if shift:  # this rank's scales sit `shift` bytes further into their region
        raw = _alone((call.scales.numel() + shift,), torch.uint8)
        call = Fp4Call(call.x, call.sizes, call.gs, call.extra, call.packed,
                       raw[shift:].view(torch.float8_e4m3fn).view(call.scales.shape), call.gathered_extra, False,
                       False, None)
        state.map(raw, 1)
    return call, ALL_GATHERV_FP4.check_signature(call, PATH_NAMES.index(path), len(sizes), FakePool(state).locate,
                                                 ("out",))


def _verify(peers, call, sizes):
    values, names = _signature_of(0, sizes)[1]
    check_mode.compare(peers, ALL_GATHERV_FP4.name, values, names, PATH_NAMES, ALL_GATHERV_FP4.check_decode,
                       ALL_GATHERV_FP4.window_rule)


def test_check_mode_names_the_output_at_another_offset():
    sizes = (3, 0, 5, 1)
    rows = [_signature_of(r, sizes, shift=512 if r == 2 else 0)[1][0] for r in range(4)]
    call, _ = _signature_of(0, sizes)
    with pytest.raises(symcomm.PeerMismatchError) as info:
        _verify(Table(rows), call, sizes)
    message = str(info.value)
    assert "window offset of 'out.scales'" in message and "rank 2: 512" in message, message
    assert "outside it" in message and "Offsets stay symmetric" in message


def test_check_mode_leaves_per_rank_inputs_free_and_compares_the_rest():
    sizes = (3, 0, 5, 1)
    signatures = [_signature_of(r, sizes) for r in range(4)]
    call = signatures[0][0]
    # Every rank's x and extras sit elsewhere (their own allocations): no mismatch.
    _verify(Table([sig[0] for _, sig in signatures]), call, sizes)
    # Another global scale, another path, a refusal: each named.
    values, names = signatures[0][1]
    other_scale = list(values)
    other_scale[names.index("global_scale")] = check_mode.float_bits(3.0)
    with pytest.raises(symcomm.PeerMismatchError, match=r"disagree on the global_scale .rank 0: 2\.5, rank 1: 3\.0"):
        _verify(Table([values, other_scale, values, values]), call, sizes)
    unfused = _signature_of(1, sizes, path=UNFUSED)[1][0]
    with pytest.raises(symcomm.PeerMismatchError, match="disagree on the path .rank 0: fused-push, rank 1: unfused"):
        _verify(Table([values, unfused, values, values]), call, sizes)
    with pytest.raises(symcomm.PeerMismatchError, match=r"rank\(s\) 1 rejected.*x has 4 rows"):
        _verify(Refusing({1: "ArgumentError: x has 4 rows"}), call, sizes)


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
    assert isinstance(choice, Fp4Choice) and choice.algo == UNFUSED
    assert "runs on CUDA devices" in choice.rejected[FUSED], choice
    assert choice.gather is not None and choice.gather.algo in comm.algorithms()
    forced = comm.select("all_gatherv_fp4", x, sizes, 1.0, [ids], algo=comm.algorithms()[0])
    assert forced.gather.algo == comm.algorithms()[0] and "forces unfused" in forced.rejected[FUSED]
    with pytest.raises(symcomm.ArgumentError, match="algo='fused-push' is unavailable: the fused kernel runs on CUDA"):
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

