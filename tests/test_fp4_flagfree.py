"""The flag-free FP4 gather (all_gatherv_fp4's fused-flagfree) without a GPU: the two facts of
the codec its wire relies on, its wire format through the kernel's own decoder (host twin) bit
for bit against the codec, why the path declines each call it cannot serve, and the launch it
builds."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

import symcomm
from symcomm import _native, base, fp4
from symcomm.backends.composite import UnfusedFp4Path
from symcomm.backends.fp4_flagfree import CAPTURE_CODE, FlagFreeFp4Path, wire_bytes
from symcomm.backends.fp4_push import FusedPushFp4Path
from symcomm.operations.all_gatherv_fp4 import ALL_GATHERV_FP4, FLAGFREE_FP4, FUSED, UNFUSED, Fp4Call
from symcomm.peer import capture as peer_capture
from symcomm.peer import context as peer_context
from symcomm.peer.setup import SharedContext

needs_native = pytest.mark.needs_native
HALVES = (torch.bfloat16, torch.float16)
SENTINEL = 0xFFFFFFFF


def _hostile_rows(n: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over many decades with the values at the edges of the codec: zeros of both signs,
    NaN, infinities, the largest finite values, subnormals, and values at the rounding ties
    around zero (a block's max 6 puts +-0.25 on the tie between codes 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen) * torch.logspace(-6, 6, max(n, 1))[:n].unsqueeze(1)
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 65504.0, -65504.0, 1e-7, -1e-7,
                             6.0, -0.25, 0.25, -0.2500001, -0.2499999, -6.0, -3.0e38])
    for start in range(0, flat.numel() - 15, 97 * 16):  # one block of specials every 97 blocks
        flat[start:start + 16] = specials
    if n:
        x[0, :16] = -0.0  # a block of -0 alone: its scale is 0
        x[-1, -16:] = torch.linspace(-6.0, -0.01, 16)  # all negative
    return x.to(dtype)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(-1, 4).view(torch.int32).view(-1).to(torch.int64) & 0xFFFFFFFF


# ------------------------------------------------------------------------ the codec's two facts
@needs_native
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("gs", (1.0, 1e-3, 1e-30, 3.0e38), ids=str)
def test_the_codec_never_writes_code_8_or_a_scale_with_its_top_bit(dtype, gs):
    """The flag-free wire sends payload words XORed with 0x77777777 and scale words as they are:
    neither may read as the sentinel 0xFFFFFFFF, which holds only if no code is 8 (-0) and no
    scale byte has its top bit set."""
    x = _hostile_rows(64, 256, dtype, 1)
    packed, scales = fp4.quantize_host(x, gs)
    codes = torch.stack([packed & 0xF, packed >> 4])
    assert not codes.eq(8).any(), "a -0 code"
    assert not scales.view(torch.uint8).ge(0x80).any(), "a scale byte with its top bit set"
    if gs in (1.0, 1e-3):  # 1e-30 zeroes every scale, and with it every code
        assert codes.ne(0).any() and codes.ge(9).any(), "non-trivial codes, negative ones among them"
    if gs == 3.0e38:
        assert scales.view(torch.uint8).eq(0x7E).any(), "saturated scales (448)"


# ------------------------------------------------------------------------ wire: host twin vs codec
def _wire_host(xs, sizes, rank, h, dtype, gs, packed, scales) -> torch.Tensor:
    rows = (ctypes.c_int64 * len(sizes))(*sizes)
    wire = torch.full((wire_bytes(sizes[rank], h),), 0xEE, dtype=torch.uint8)
    args = _native.FlagFreeFp4Args(x=xs[rank].data_ptr(), dtype=_native.DTYPE_CODES[dtype], cols=h, rows=rows,
                                   gs_value=gs)
    lib = fp4.host_lib()
    code = lib.symcomm_flagfree_fp4_wire_host(ctypes.byref(args), len(sizes), rank, wire.data_ptr(),
                                              packed.data_ptr(), scales.data_ptr())
    assert code == 0, code
    return wire


@needs_native
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("sizes", [(0, 5), (1, 0), (3, 0, 1, 7), (1, 0, 0, 2, 9, 0, 3, 1), (33, 130)], ids=str)
@pytest.mark.parametrize("h", (16, 48, 272, 7168))
def test_the_wire_holds_no_sentinel_and_decodes_to_the_codec(dtype, sizes, h):
    """Every rank's chunk as the kernel sends it, decoded by the kernel's own routine into the
    gathered outputs: odd block counts (h 16, 48, 272: 1, 3, 17 blocks a row) leave half a
    payload vector and a partial scale vector at the end of a chunk."""
    total = sum(sizes)
    xs = [_hostile_rows(n, h, dtype, 7 * r + h) for r, n in enumerate(sizes)]
    for gs in (1.0, 2.0e4):
        # Filled with a byte the codec can write too, so an unwritten byte shows in one pass.
        for fill in (0xA5, 0x5A):
            packed = torch.full((total, h // 2), fill, dtype=torch.uint8)
            scales = torch.full((total, h // 16), fill, dtype=torch.uint8)
            for r in range(len(sizes)):
                wire = _wire_host(xs, sizes, r, h, dtype, gs, packed, scales)
                assert wire.numel() % 16 == 0
                if wire.numel():
                    assert not _words(wire).eq(SENTINEL).any(), f"rank {r}: a sentinel word on the wire"
            codec = [fp4.quantize_host(x, gs) for x in xs]
            what = f"sizes {sizes} h {h} {dtype} gs {gs} fill {fill:#x}"
            assert torch.equal(packed, torch.cat([p for p, _ in codec])), "payload " + what
            assert torch.equal(scales, torch.cat([s.view(torch.uint8) for _, s in codec])), "scales " + what


@needs_native
@pytest.mark.parametrize("gs", (-1.0, -3.0e38, 0.0, float("nan"), float("inf")), ids=str)
def test_a_global_scale_validation_never_saw_keeps_the_wire_free_of_the_sentinel(gs):
    """A device tensor's global scale is not validated (that would need a host sync): a negative,
    zero, NaN or infinite one must still give scale bytes without the top bit and no sentinel
    word. Python refuses these as floats, so the host twin is called directly."""
    sizes, h = (3, 2), 272
    xs = [_hostile_rows(n, h, torch.bfloat16, 40 + r) for r, n in enumerate(sizes)]
    packed = torch.zeros((sum(sizes), h // 2), dtype=torch.uint8)
    scales = torch.zeros((sum(sizes), h // 16), dtype=torch.uint8)
    for r in range(len(sizes)):
        wire = _wire_host(xs, sizes, r, h, torch.bfloat16, gs, packed, scales)
        assert not _words(wire).eq(SENTINEL).any(), f"rank {r}: a sentinel word on the wire"
    assert not scales.ge(0x80).any()
    codes = torch.stack([packed & 0xF, packed >> 4])
    assert not codes.eq(8).any()


def test_wire_bytes_counts_both_parts_in_whole_vectors():
    assert wire_bytes(0, 7168) == 0
    assert wire_bytes(1, 16) == 32  # one block: half a payload vector, one scale byte
    assert wire_bytes(1, 7168) == 16 * (224 + 28)  # 448 blocks
    assert wire_bytes(3, 48) == 16 * (5 + 1)  # 9 blocks


@needs_native
def test_wire_host_refuses_bad_arguments():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    out = torch.empty(64, dtype=torch.uint8)
    lib = fp4.host_lib()
    for sizes, cols, dtype, world, rank in [((2, 1), 24, 2, 2, 0), ((2, -1), 32, 2, 2, 0), ((2, 1), 32, 0, 2, 0),
                                            ((2, 1), 32, 2, 2, 2)]:
        rows = (ctypes.c_int64 * 2)(*sizes)
        args = _native.FlagFreeFp4Args(x=x.data_ptr(), dtype=dtype, cols=cols, rows=rows, gs_value=1.0)
        assert lib.symcomm_flagfree_fp4_wire_host(ctypes.byref(args), world, rank, out.data_ptr(), out.data_ptr(),
                                                  out.data_ptr()) != 0, (sizes, cols, dtype, rank)


# ------------------------------------------------------------------------ why_not, with stand-ins
class FakeState:
    """What the flag-free path reads of its PeerContext, and a library that records launches."""

    def __init__(self, world=2, device_index=0, flagfree_bytes=2 << 20):
        self.world_size, self.rank, self.device_index = world, 0, device_index
        self.flagfree_bytes = flagfree_bytes
        self.granules, self.region_slots, self.region_numbers = {}, {}, {}
        self.region_problem = None
        self.capture = None
        self.alarm = None
        self.ctx = 77
        self.lib = SimpleNamespace(launches=[], symcomm_ar_flagfree_gatherv_fp4=self._launch)

    region_of = peer_context.PeerContext.region_of
    session = peer_context.PeerContext.session
    input_of = peer_context.PeerContext.input_of

    def _launch(self, ctx, args, stream):
        a = args._obj
        self.lib.launches.append((ctx, a.x, a.dtype, a.cols, list(a.rows[:self.world_size]), a.gs_ptr, a.gs_value,
                                  a.payload, a.scales, stream))
        return 0

    launch_inputs = peer_context.PeerContext.launch_inputs

    def launch_stream(self, session):
        return 0xABC

    def check(self, what, code):
        raise AssertionError(f"{what}: {code}")


def _call(sizes=(3, 5), rank=0, h=48, dtype=torch.bfloat16, extra=()) -> Fp4Call:
    total, n = sum(sizes), sizes[rank]
    x = torch.randn(n, h).to(dtype)
    return Fp4Call(x, list(sizes), 2.5, list(extra), torch.empty((total, h // 2), dtype=torch.uint8),
                   torch.empty((total, h // 16), dtype=torch.float8_e4m3fn), [torch.empty(total, 8) for _ in extra],
                   False, False, None)


def _router(state):
    from symcomm.dispatch import Router, builtin_table
    from symcomm.operations import ALL_GATHERV, ALL_GATHERV_FP4
    router = Router(builtin_table(2), {ALL_GATHERV_FP4.name: ALL_GATHERV_FP4, ALL_GATHERV.name: ALL_GATHERV}, 0)
    router.add(FlagFreeFp4Path(SharedContext(state)), None)
    router.add(FusedPushFp4Path(SharedContext(state)), None)
    unfused = UnfusedFp4Path()
    unfused.open(SimpleNamespace(dispatcher=router))
    router.add(unfused, None)
    router.add(SimpleNamespace(name="nccl", ops=frozenset({"all_gatherv"}), why_not=lambda call: None), None)
    return router


def test_the_flagfree_path_serves_plain_outputs_first():
    call, state = _call(), FakeState()
    path, choice = _router(state).choose(ALL_GATHERV_FP4, call, "auto", explain=True)
    assert path.name == FLAGFREE_FP4 and FLAGFREE_FP4 not in choice.rejected, choice
    assert "not in a mapped symmetric pool region" in choice.rejected[FUSED]  # which flag-free does not need


@pytest.mark.parametrize("case, fragment", [
    ("cpu", "runs on CUDA devices"),
    ("world", "world 2 only; this world has 4 ranks"),
    ("dtype", "bfloat16 and float16"),
    ("extra", "fused-push carries them"),
    ("too_big", "rank 1's 5 rows take 144 bytes on the wire, more than the flag-free receive slot of 128 bytes"),
])
def test_the_flagfree_path_says_why_it_declines(case, fragment):
    state = FakeState(world=4 if case == "world" else 2, device_index=None if case == "cpu" else 0,
                      flagfree_bytes=128 if case == "too_big" else 2 << 20)
    sizes = (1, 1, 1, 1) if case == "world" else (3, 5)
    call = _call(sizes=sizes, dtype=torch.float32 if case == "dtype" else torch.bfloat16,
                 extra=[torch.zeros(3, 8)] if case == "extra" else ())
    reason = FlagFreeFp4Path(SharedContext(state)).why_not(call)
    assert reason is not None and fragment in reason, reason
    with pytest.raises(symcomm.ArgumentError, match=f"algo='{FLAGFREE_FP4}' cannot serve"):
        _router(state).choose(ALL_GATHERV_FP4, call, FLAGFREE_FP4)


def test_a_call_with_extras_is_left_to_the_fused_push():
    state = FakeState()
    call = _call(extra=[torch.zeros(3, 8)])
    state.region_problem = None
    path, choice = _router(state).choose(ALL_GATHERV_FP4, call, "auto", explain=True)
    # Extras are arbitrary bytes (they could read as the sentinel): flag-free refuses them and
    # says who carries them. The outputs here are not in a pool, so the push passes too.
    assert "sentinel; fused-push carries them" in choice.rejected[FLAGFREE_FP4]
    assert "not in a mapped symmetric pool region" in choice.rejected["fused-push"]
    assert path.name == "unfused"


def test_the_launch_passes_every_ranks_rows_and_this_ranks_outputs(monkeypatch):
    call, state = _call(sizes=(3, 5), rank=1), FakeState()
    path = FlagFreeFp4Path(SharedContext(state))
    path.run(call)
    (launch,) = state.lib.launches
    assert launch == (77, call.x.data_ptr(), _native.DTYPE_CODES[torch.bfloat16], 48, [3, 5], None, 2.5,
                      call.packed.data_ptr(), call.scales.data_ptr(), 0xABC)
    # Captured: recorded as a direct read of this rank's input under its own kernel code.
    state.capture = peer_capture.CaptureSession()
    monkeypatch.setattr(base, "_stream_capturing", lambda: True)
    path.run(call)
    # The size recorded is the gathered outputs', the same on every rank (x's is this rank's own).
    assert state.capture.calls == [(peer_capture.DIRECT, CAPTURE_CODE, call.packed.nbytes + call.scales.nbytes, -1, -1)]
    # Nothing to gather anywhere: no rank launches (every rank knows the total).
    empty, state0 = _call(sizes=(0, 0)), FakeState()
    FlagFreeFp4Path(SharedContext(state0)).run(empty)
    assert state0.lib.launches == []


def test_the_order_puts_flagfree_first_at_every_size_and_push_where_it_declines():
    rows_in_slot = (2 << 20) // (7168 // 2 + 7168 // 16)  # 520 rows of 4,032 wire bytes fill FakeState's slot
    small, large = _call(sizes=(2, 3), h=7168), _call(sizes=(2, rows_in_slot), h=7168)
    over = _call(sizes=(2, rows_in_slot + 1), h=7168)
    for call in (small, large, over):
        assert ALL_GATHERV_FP4.order(None, call) == (FLAGFREE_FP4, FUSED, UNFUSED)
    path, choice = _router(FakeState()).choose(ALL_GATHERV_FP4, large, "auto", explain=True)
    assert path.name == FLAGFREE_FP4 and "pool region" in choice.rejected[FUSED]
    assert ALL_GATHERV_FP4.ranking(None, large) == "in all_gatherv_fp4's order (fused-flagfree, fused-push, unfused)"
    # Past the receive slot flag-free declines and says so; with plain outputs, unfused serves.
    path, choice = _router(FakeState()).choose(ALL_GATHERV_FP4, over, "auto", explain=True)
    assert path.name == UNFUSED and "receive slot" in choice.rejected[FLAGFREE_FP4]
