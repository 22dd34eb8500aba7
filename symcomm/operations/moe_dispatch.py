"""moe_dispatch as an operation (``Communicator.moe_dispatch``): send every token to the ranks that
hold its top-k experts, optionally quantized on the way, into receive buffers laid out by local
expert for a grouped GEMM, with each entry's top-k weight listed beside it there (the handle's
recv_group: combine adds a token's rows on their rank with the weights dispatch read).
symcomm/ep/layout.py defines where every row lands.

Its paths, in the order auto tries them: ``peer-push`` (symcomm/backends/ep_push.py: csrc/ep.cu's
kernels exchange the counts on the device and write every row straight into the receiving rank's
buffers in the symmetric pool; no host synchronisation, so it can be captured in a CUDA graph)
and ``a2a`` (symcomm/backends/ep_a2a.py: the layout in torch, one all_gather of the counts, then
one all_to_allv on whatever path that op's dispatch picks; it reads the counts on the host).
``algo=`` names either, or an all_to_allv path ("nccl", "torch"), which forces ``a2a`` with it.

Every buffer has a shape equal on every rank (sized by ``max_tokens``, the most tokens any rank
passes), so inside use_symmetric_memory they take equal pool offsets, as the peer path needs;
``out=`` (an earlier call's Dispatched) reuses them, which is how a CUDA graph keeps fixed
buffers. The a2a path's own temporaries are sized by each rank's counts, so call it outside
use_symmetric_memory (it needs no symmetric buffers): inside, they would leave rank-dependent
holes that move later pool tensors to unequal offsets. The receive buffers hold ``capacity``
rows, of which ``expert_offsets[-1]`` (on the device) are used; rows past each expert's count
are not written.
"""
from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import check_mode, fp4, validate
from ..base import Call, capturing
from ..dispatch import Choice
from ..ep import fp8, layout
from ..errors import ArgumentError, DtypeError
from ..pool import segment_bytes
from ..registry import lookup
from .autograd import no_backward, ordered, records
from .base import CallContext, Dispatcher, Operation, scale_args

if TYPE_CHECKING:
    from ..base import Path
    from ..dispatch import DispatchTable
    from ..peers import Peers

OP = "moe_dispatch"
PUSH, A2A = "peer-push", "a2a"
ORDER = (PUSH, A2A)
QUANTS = (None, "nvfp4", "fp8")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANT_DTYPES = (torch.bfloat16, torch.float16)  # what every path quantizes (see check_quant_dtype)
ID_DTYPES = (torch.int32, torch.int64)
MAX_ALIGN = 4096
OFFSETS_RULE = ("The peer path writes every rank's receive buffers at this rank's pool offsets, so they must sit at "
                "equal offsets: call dispatch inside use_symmetric_memory with the same arguments in the same order "
                "on every rank, or pass out= (an earlier call's Dispatched)")


class EpHandle:
    """What combine needs of one dispatch: where each entry went (``send_rows``), where each
    received row came from (``recv_src``) and which rows each rank's token has on this rank, with
    their weights (``recv_group``), the counts table, the buffer partial sums come back to
    (``returned``), and the call's top-k ids and weights. Its buffers belong to the Dispatched
    they came with: a later dispatch with ``out=`` that Dispatched overwrites them."""

    __slots__ = ("send_rows", "recv_src", "expert_offsets", "table", "returned", "recv_group", "topk_ids",
                 "topk_weights", "num_experts", "max_tokens", "align", "dtype", "world")

    def __init__(self, send_rows: torch.Tensor, recv_src: torch.Tensor, expert_offsets: torch.Tensor,
                 table: torch.Tensor, returned: torch.Tensor, recv_group: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, num_experts: int, max_tokens: int, align: int, dtype: torch.dtype) -> None:
        self.send_rows = send_rows  # int32 [max_tokens, k]; rows [:tokens] are this call's
        self.recv_src = recv_src  # int32 [capacity]; rows past expert_offsets[-1] are not written
        self.expert_offsets = expert_offsets  # int32 [E/W + 1], Dispatched.expert_offsets
        self.table = table  # int32 [world, num_experts + 1]: counts, and each rank's fingerprint
        self.returned = returned  # uint8 [world * max_tokens, hidden * itemsize]: rank p's partial of token t at p*max_tokens+t
        self.recv_group = recv_group  # int32 [world, max_tokens, k, 2]: symcomm/ep/layout.py's groups
        self.topk_ids, self.topk_weights = topk_ids, topk_weights
        self.num_experts, self.max_tokens, self.align, self.dtype = num_experts, max_tokens, align, dtype
        self.world = table.shape[0]

    @property
    def tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def topk(self) -> int:
        return self.send_rows.shape[1]

    @property
    def hidden(self) -> int:
        return self.returned.shape[1] // self.dtype.itemsize

    @property
    def capacity(self) -> int:
        return self.recv_src.shape[0]

    def pool_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers peers write into, by name (check mode compares their pool offsets)."""
        return [("handle.recv_src", self.recv_src), ("handle.recv_group", self.recv_group), ("handle.table", self.table),
                ("handle.returned", self.returned)]

    def __repr__(self) -> str:
        return (f"EpHandle(tokens={self.tokens}, topk={self.topk}, num_experts={self.num_experts}, "
                f"max_tokens={self.max_tokens}, capacity={self.capacity}, hidden={self.hidden})")


class Dispatched(NamedTuple):
    """What dispatch returns: this rank's received rows, laid out by local expert."""

    x: torch.Tensor  # [capacity, H] in x's dtype; NVFP4 payload uint8 [capacity, H/2]; FP8 codes [capacity, H]
    scales: torch.Tensor | None  # NVFP4 block scales (e4m3, linear or swizzled) | FP8 float32 [capacity, H/128]
    expert_counts: torch.Tensor  # int32 [E/W]: rows each local expert received
    expert_offsets: torch.Tensor  # int32 [E/W + 1]: where each local expert's rows start; [-1]: rows used
    handle: EpHandle
    global_scale: fp4.GlobalScale | None  # NVFP4's, as validated


class DispatchCall(Call):
    """A validated dispatch. Its outputs are the buffers peers write (recv x, scales, recv_src,
    table, returned); the rest are this rank's own."""

    __slots__ = ("x", "topk_ids", "topk_weights", "num_experts", "max_tokens", "quant", "gs", "align", "swizzle",
                 "recv", "recv_scales", "expert_counts", "expert_offsets", "handle", "inner_algo")

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, max_tokens: int,
                 quant: str | None, gs: fp4.GlobalScale | None, align: int, swizzle: bool, recv: torch.Tensor,
                 recv_scales: torch.Tensor | None, expert_counts: torch.Tensor, expert_offsets: torch.Tensor,
                 handle: EpHandle) -> None:
        outputs = [t for t in (recv, recv_scales) if t is not None] + [t for _, t in handle.pool_buffers()]
        super().__init__(OP, (x, ids, weights), outputs, (x.data_ptr(), ids.data_ptr(), weights.data_ptr()),
                         [t.data_ptr() for t in outputs], None, None, sum(t.nbytes for t in outputs))
        self.x, self.topk_ids, self.topk_weights = x, ids, weights
        self.num_experts, self.max_tokens, self.quant, self.gs = num_experts, max_tokens, quant, gs
        self.align, self.swizzle = align, swizzle
        self.recv, self.recv_scales = recv, recv_scales
        self.expert_counts, self.expert_offsets, self.handle = expert_counts, expert_offsets, handle
        self.inner_algo = "auto"  # the all_to_allv path algo= forced, for the a2a path

    @property
    def world(self) -> int:
        return self.handle.world

    @property
    def capacity(self) -> int:
        return self.handle.capacity

    def fingerprint(self) -> int:
        """This rank's sizes as the counts table carries them (symcomm/ep/layout.py)."""
        return layout.fingerprint(self.capacity, row_bytes(self.x.shape[1], self.x.dtype, self.quant),
                                  self.handle.topk, self.align, self.max_tokens, self.num_experts,
                                  self.quant, self.x.shape[1], self.x.dtype)

    def named_outputs(self) -> list[tuple[str, torch.Tensor]]:
        mine = [("out.x", self.recv)] + ([("out.scales", self.recv_scales)] if self.recv_scales is not None else [])
        return mine + self.handle.pool_buffers()


def row_bytes(hidden: int, dtype: torch.dtype, quant: str | None) -> int:
    """Bytes of one received row (the fingerprint's row size)."""
    return hidden // 2 if quant == "nvfp4" else hidden if quant == "fp8" else hidden * dtype.itemsize


class BufferSpec(NamedTuple):
    """The shape and dtype of one buffer a dispatch writes."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@functools.lru_cache(maxsize=64)
def buffer_specs(world: int, max_tokens: int, topk: int, num_experts: int, hidden: int, dtype: torch.dtype,
                 quant: str | None = None, swizzle: bool = False, align: int = 1) -> Mapping[str, BufferSpec]:
    """Every buffer one dispatch writes, named as check mode names them (errors about ``out=``
    put ``out.`` before a handle's: ``out.handle.table``), in the order build allocates them:
    inside use_symmetric_memory that order sets their pool offsets. The counts table comes
    first: its shape depends on the world and the experts alone, so ranks that passed other
    sizes still meet in it, and the fingerprints there stop them all before any row lands at an
    offset only one of them thinks right. ``moe_dispatch_nbytes`` sizes the pool for them.
    Cached, and so read-only: every call of a step asks for the same sizes, and building the
    table anew was most of what it first added to build's host time (bench/NOTES.md,
    thirty-seventh session)."""
    cap = layout.capacity(world, max_tokens, topk, num_experts, align)
    i32 = torch.int32
    specs = {"handle.table": BufferSpec((world, num_experts + 1), i32)}
    if quant == "nvfp4":
        specs["out.x"] = BufferSpec((cap, hidden // 2), torch.uint8)
        specs["out.scales"] = BufferSpec(fp4.scales_shape(cap, hidden, swizzle), torch.float8_e4m3fn)
    elif quant == "fp8":
        specs["out.x"] = BufferSpec((cap, hidden), torch.float8_e4m3fn)
        specs["out.scales"] = BufferSpec((cap, hidden // fp8.BLOCK), torch.float32)
    else:
        specs["out.x"] = BufferSpec((cap, hidden), dtype)
    local = num_experts // world
    specs.update({"handle.recv_src": BufferSpec((cap,), i32),
                  "handle.recv_group": BufferSpec((world, max_tokens, topk, 2), i32),
                  "handle.returned": BufferSpec((world * max_tokens, hidden * dtype.itemsize), torch.uint8),
                  "handle.send_rows": BufferSpec((max_tokens, topk), i32),
                  "out.expert_counts": BufferSpec((local,), i32),
                  "out.expert_offsets": BufferSpec((local + 1,), i32)})
    return types.MappingProxyType(specs)


class Sizes(NamedTuple):
    """A dispatch's sizes, validated (``check_sizes``)."""

    num_experts: int
    max_tokens: int
    align: int


def check_sizes(world: int, topk: int, hidden: int, dtype: torch.dtype, num_experts: object, max_tokens: object,
                quant: object, swizzle: object, align: object, rows: str = "x") -> Sizes:
    """The rules on a dispatch's sizes that no tensor decides, which ``moe_dispatch`` and
    ``moe_dispatch_nbytes`` both apply, so the two accept the same arguments. ``rows`` names the
    dispatched rows in messages (``x`` for moe_dispatch)."""
    num_experts = validate.count("num_experts", num_experts, 1, 1 << 20)
    if num_experts % world:
        raise ArgumentError(f"num_experts ({num_experts}) must be a multiple of the world size ({world}): "
                            f"each rank holds num_experts / world experts")
    if topk > num_experts:
        raise ArgumentError(f"top-k is {topk} experts per token, but there are only {num_experts}")
    max_tokens = _max_tokens_arg(max_tokens)
    if world * max_tokens * topk >= 1 << 31:
        raise ArgumentError(f"world ({world}) x max_tokens ({max_tokens}) x k ({topk}) must stay below 2**31 "
                            f"(entries are numbered in int32)")
    align = validate.count("align", align, 1, MAX_ALIGN)
    if quant not in QUANTS:
        raise ArgumentError(f"quant must be None, 'nvfp4' or 'fp8', got {quant!r}")
    check_quant_dtype(quant, dtype, rows)
    block = {"nvfp4": fp4.BLOCK, "fp8": fp8.BLOCK}.get(quant)
    if block is not None and hidden % block:
        raise ArgumentError(f"the hidden size of {rows} ({hidden}) must be a multiple of {block} for "
                            f"{quant.upper()} blocks")
    if not isinstance(swizzle, bool):
        raise ArgumentError(f"swizzle must be a bool, got {type(swizzle).__name__}")
    if swizzle and quant != "nvfp4":
        raise ArgumentError("swizzle=True lays out NVFP4 block scales: it needs quant='nvfp4'")
    return Sizes(num_experts, max_tokens, align)


def moe_dispatch_nbytes(world: int, max_tokens: int, topk: int, num_experts: int, hidden: int,
                        dtype: torch.dtype = torch.bfloat16, quant: str | None = None, swizzle: bool = False,
                        align: int = 1) -> int:
    """Symmetric pool that ``moe_dispatch``'s buffers take, at most, for these arguments on
    ``world`` ranks (pass the dispatch's own ``quant``, ``swizzle`` and ``align``): each buffer as
    the segment torch's caching allocator takes for it (``pool.segment_bytes``, which assumes the
    allocator's default rounding: a PYTORCH_CUDA_ALLOC_CONF that rounds sizes up further takes
    more). Give it to ``Communicator(symmetric_capacity=...)``, with what else the pool holds,
    before allocating the buffers inside ``use_symmetric_memory``. It refuses what moe_dispatch
    refuses, with the same messages (``check_sizes``)."""
    world = validate.count("world", world, 1, 1 << 31)
    topk = validate.count("topk", topk, 1, 1 << 31)
    hidden = validate.count("hidden", hidden, 1, 1 << 62)
    if dtype not in DTYPES:
        raise DtypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    sizes = check_sizes(world, topk, hidden, dtype, num_experts, max_tokens, quant, swizzle, align, rows="rows")
    specs = buffer_specs(world, sizes.max_tokens, topk, sizes.num_experts, hidden, dtype, quant, swizzle, sizes.align)
    return sum(segment_bytes(spec.nbytes) for spec in specs.values())


def buffer_of(got: Dispatched, name: str) -> torch.Tensor | None:
    """The tensor ``buffer_specs`` calls ``name`` in a Dispatched ("out.x", "handle.table", ...)."""
    _, on_out, field = _WHERE[name]
    return getattr(got if on_out else got.handle, field)


def check_quant_dtype(quant: str | None, dtype: torch.dtype, name: str) -> None:
    """Quantized rows are bfloat16 or float16 on every path. The peer kernels quantize only those,
    and a path must not depend on an argument a rank passes alone: where float32 rows went to
    a2a with a quant and to the peer kernels without, ranks that disagreed on quant would wait in
    different collectives instead of finding out."""
    if quant is not None and dtype not in QUANT_DTYPES:
        raise DtypeError(f"quant={quant!r} takes bfloat16 or float16 {name}, got {dtype}: cast them, or pass "
                         f"quant=None")


def check_ids_on_host(ids: torch.Tensor, num_experts: int) -> str | None:
    """Why ``ids`` (a CPU tensor) breaks the rules, or None: every id in [-1, E), no expert twice
    in a token."""
    if not ids.numel():
        return None
    wide = ids.long()
    bad = ((wide < -1) | (wide >= num_experts)).nonzero()
    if bad.numel():
        t, j = bad[0].tolist()
        return f"topk_ids[{t}, {j}] = {int(wide[t, j])} is outside [-1, {num_experts}) (-1 means no expert)"
    repeated = ~layout.valid_entries(ids, num_experts) & (wide >= 0)
    if repeated.any():
        t, j = repeated.nonzero()[0].tolist()
        return f"topk_ids[{t}] names expert {int(wide[t, j])} twice (slot {j} repeats an earlier one)"
    return None


def _given(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return validate.destination(name, t, tuple(shape), dtype, device)


def _max_tokens_arg(max_tokens: object) -> int:
    if max_tokens is None:
        raise ArgumentError("max_tokens is required: the most tokens any rank dispatches in one call, the same "
                            "on every rank (it sizes every receive buffer)")
    return validate.count("max_tokens", max_tokens, 1, 1 << 31)


class EpOperation(Operation):
    """What moe_dispatch and moe_combine share: their fixed order of paths, and ``algo=``
    naming one of them or an all_to_allv path (which forces a2a with that path inside)."""

    def order(self, table: DispatchTable, call: Any) -> tuple[str, ...]:
        return ORDER

    def ranking(self, table: DispatchTable, call: Any) -> str:
        return f"in {self.name}'s order"

    def resolve(self, call: Any, algo: object, dispatcher: Dispatcher) -> str:
        algo = super().resolve(call, algo, dispatcher)
        if algo == "auto" or algo in ORDER:
            return algo
        return self.resolve_inner(call, algo, dispatcher, "all_to_allv", A2A, ORDER, f"a path of {self.name}")

    def inner_choice(self, call: Any, path: Path, dispatcher: Dispatcher) -> Choice | None:
        return Choice(call.inner_algo, {}) if path.name == A2A else None

    def refuse_gradient(self, *tensors: Any) -> None:
        """Neither operation has a backward yet: a call autograd would record is refused where
        every call enters (build, and compiled for torch.compile), rather than run
        with its gradient silently dropped. In build, check mode tells the peers why."""
        if records(*tensors):
            raise no_backward(self.name, "expert-parallel dispatch and combine have no backward yet (serve "
                                         "under torch.inference_mode())")


class MoeDispatch(EpOperation):
    name = OP
    skips_empty = False  # a rank with no tokens still takes part: peers wait for its counts
    bench = "symcomm.bench.moe_spec:MOE_DISPATCH_COMBINE"
    check_decode: dict[str, Callable[[int], object]] = {"global_scale": check_mode.bits_float,
                                                        "quant": lambda v: ("none", "nvfp4", "fp8")[v & 3]
                                                        + (" swizzled" if v & 4 else "")}
    window_rule = OFFSETS_RULE

    def build(self, ctx: CallContext, x: Any, topk_ids: Any, topk_weights: Any, num_experts: Any,
              max_tokens: Any = None, quant: Any = None, global_scale: Any = None, align: Any = 1,
              swizzle: Any = False, out: Any = None) -> DispatchCall:
        self.refuse_gradient(x, topk_weights, out)
        device, world = ctx.device, ctx.world_size
        x = validate.tensor("x", x, device)
        if x.ndim != 2:
            raise ArgumentError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise DtypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
        n, hidden = x.shape
        if hidden == 0:
            raise ArgumentError("x must have a positive hidden size (x.shape[1])")
        ids = validate.tensor("topk_ids", topk_ids, device)
        if ids.dtype not in ID_DTYPES:
            raise DtypeError(f"topk_ids must be int32 or int64, got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[0] != n or ids.shape[1] == 0:
            raise ArgumentError(f"topk_ids must be [{n}, k] with k >= 1 (x has {n} tokens), got {tuple(ids.shape)}")
        k = ids.shape[1]
        weights = validate.tensor("topk_weights", topk_weights, device)
        if weights.dtype not in DTYPES:
            raise DtypeError(f"topk_weights must be float32, bfloat16 or float16, got {weights.dtype}")
        if tuple(weights.shape) != (n, k):
            raise ArgumentError(f"topk_weights must have topk_ids' shape {(n, k)}, got {tuple(weights.shape)}")
        num_experts, max_tokens, align = check_sizes(world, k, hidden, x.dtype, num_experts, max_tokens, quant,
                                                     swizzle, align)
        if n > max_tokens:
            raise ArgumentError(f"x has {n} tokens, more than max_tokens ({max_tokens})")
        gs = None
        if quant == "nvfp4":
            fp4.check_rows(x)
            if global_scale is None:
                raise ArgumentError("quant='nvfp4' needs global_scale (the same on every rank: "
                                    "symcomm.fp4.global_scale_for(x, comm))")
            gs = fp4.check_global_scale(global_scale, device)
        else:
            if quant == "fp8":
                fp8.check_rows(x)
            if global_scale is not None:
                raise ArgumentError(f"global_scale is NVFP4's; quant={quant!r} takes none")
        if device.type == "cpu" and (problem := check_ids_on_host(ids, num_experts)) is not None:
            raise ArgumentError(problem)
        specs = buffer_specs(world, max_tokens, k, num_experts, hidden, x.dtype, quant, swizzle, align)
        validate.check_extent("the receive buffer", specs["out.x"].shape[0], x)
        if out is not None:
            if not isinstance(out, Dispatched) or not isinstance(out.handle, EpHandle):
                raise ArgumentError(f"out must be a Dispatched (an earlier dispatch's result), got {type(out).__name__}")
            bufs = {name: _given(_WHERE[name][0], buffer_of(out, name), spec.shape, spec.dtype, device)
                    for name, spec in specs.items()}
        else:
            # In buffer_specs' order, with shapes equal on every rank, so that inside
            # use_symmetric_memory they take equal pool offsets. (The a2a path all-gathers the
            # counts into the table; peer-push exchanges them in context memory and copies them there.)
            bufs = {name: torch.empty(spec.shape, dtype=spec.dtype, device=device) for name, spec in specs.items()}
        handle = EpHandle(bufs["handle.send_rows"], bufs["handle.recv_src"], bufs["out.expert_offsets"],
                          bufs["handle.table"], bufs["handle.returned"], bufs["handle.recv_group"], ids, weights,
                          num_experts, max_tokens, align, x.dtype)
        recv, scales, counts, offsets = (bufs.get(name) for name in ("out.x", "out.scales", "out.expert_counts",
                                                                     "out.expert_offsets"))
        return DispatchCall(x, ids, weights, num_experts, max_tokens, quant, gs, align, swizzle, recv, scales, counts,
                            offsets, handle)

    def result(self, call: DispatchCall) -> Dispatched:
        return Dispatched(call.recv, call.recv_scales, call.expert_counts, call.expert_offsets, call.handle, call.gs)

    def check_scalars(self, call: DispatchCall) -> Sequence[tuple[str, int]]:
        quant = QUANTS.index(call.quant) | (4 if call.swizzle else 0)
        return [("num_experts", call.num_experts), ("max_tokens", call.max_tokens), ("topk", call.handle.topk),
                ("align", call.align), ("quant", quant),
                ("global_scale", check_mode.scale_bits(call.gs))]

    def check_signature(self, call: DispatchCall, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Sequence[str]) -> tuple[list[int], list[str]]:
        return pool_signature(self.name, call, call.named_outputs(), call.x.dtype, self.check_scalars(call),
                              path_index, world, locate, compared)

    def check_more(self, call: DispatchCall, path: Path, peers: Peers) -> None:
        """On CUDA the ids are checked here (a host synchronisation, which check mode may make):
        every rank learns which ranks' ids break the rules, and all raise the same error. Not
        during CUDA-graph capture, where reading them would end the capture: the kernels skip an
        id outside [0, num_experts) there, as everywhere."""
        unread = call.x.device.type == "cpu" or capturing(call.x.device)  # CPU ids: validated already
        problem = None if unread else check_ids_on_host(call.topk_ids.cpu(), call.num_experts)
        rows = peers.exchange([0 if problem is None else 1], kind=check_mode.KIND)
        bad = [r for r, (flag,) in enumerate(rows) if flag]
        if bad:
            here = f" (here: {problem})" if problem else ""
            raise ArgumentError(f"check mode: {OP}: the top-k ids of rank(s) {bad} break the rules{here}")

    def compiled(self, comm: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, max_tokens: int | None = None, quant: str | None = None, global_scale: Any = None,
                 align: int = 1, swizzle: bool = False, out: Dispatched | None = None,
                 algo: str = "auto") -> Dispatched:
        self.refuse_gradient(x, topk_weights, out)
        max_tokens = _max_tokens_arg(max_tokens)  # the op's schema takes an int: name the rule first
        if out is not None:
            raise ArgumentError("out= is not supported under torch.compile: the compiled dispatch allocates its own "
                                "buffers (pass out=None)")
        got = _moe_dispatch(x, topk_ids, topk_weights, num_experts, max_tokens, quant, *scale_args(global_scale),
                            align, swizzle, comm.key, algo)
        bufs = dict(zip(OP_OUTPUTS, got))
        handle = EpHandle(bufs["handle.send_rows"], bufs["handle.recv_src"], bufs["out.expert_offsets"],
                          bufs["handle.table"], bufs["handle.returned"], bufs["handle.recv_group"], topk_ids,
                          topk_weights, num_experts, max_tokens, align, x.dtype)
        return Dispatched(bufs["out.x"], bufs["out.scales"] if quant is not None else None, bufs["out.expert_counts"],
                          bufs["out.expert_offsets"], handle, global_scale)


def pool_signature(op: str, call: Call, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   scalars: Sequence[tuple[str, int]], path_index: int, world: int,
                   locate: Callable[[int], tuple[int, int]] | None,
                   compared: Sequence[str]) -> tuple[list[int], list[str]]:
    """Check mode's signature of an EP call: the buffers peers write, at their pool offsets
    where the chosen path needs them equal, named as the caller knows them."""
    tensors = [t for _, t in named]
    ptrs = [t.data_ptr() for t in tensors]
    view = Call(op, tensors, tensors, ptrs, ptrs, None, None, call.nbytes)
    view.dtype = dtype
    values, names = check_mode.signature(view, path_index, world, locate, compared, op, scalars)
    for i, (name, _) in enumerate(named):
        names = [n.replace(f"'out[{i}]'", f"'{name}'").replace(f"'x[{i}]'", f"'{name}'") for n in names]
    return values, names


MOE_DISPATCH = MoeDispatch()

# What the custom op returns, in order ("out.scales" is empty without a quant): buffer_specs' names.
OP_OUTPUTS = ("out.x", "out.scales", "out.expert_counts", "out.expert_offsets", "handle.send_rows", "handle.recv_src",
              "handle.table", "handle.returned", "handle.recv_group")
# Each buffer's name in errors about out=, whether the Dispatched holds it (or its handle), and
# the field: worked out once, since build looks them up on every call with out=.
_WHERE = {name: (name if name.startswith("out.") else f"out.{name}", name.startswith("out."), name.split(".")[1])
          for name in OP_OUTPUTS}


@torch.library.custom_op(f"symcomm::{OP}", mutates_args=())
def _moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  max_tokens: int, quant: str | None, scale_value: float | None, scale: torch.Tensor | None,
                  align: int, swizzle: bool, comm_key: int, algo: str) -> list[torch.Tensor]:
    got = lookup(comm_key).moe_dispatch(x, topk_ids, topk_weights, num_experts, max_tokens=max_tokens, quant=quant,
                                    global_scale=scale if scale is not None else scale_value, align=align,
                                    swizzle=swizzle, algo=algo)
    outputs = (buffer_of(got, name) for name in OP_OUTPUTS)
    return [x.new_empty((0,)) if t is None else t for t in outputs]  # None: no scales without a quant


ordered(_moe_dispatch)


@_moe_dispatch.register_fake
def _(x, topk_ids, topk_weights, num_experts, max_tokens, quant, scale_value, scale, align, swizzle, comm_key, algo):
    specs = buffer_specs(lookup(comm_key).world_size, max_tokens, topk_ids.shape[1], num_experts, x.shape[1],
                         x.dtype, quant, swizzle, align)
    none = BufferSpec((0,), x.dtype)  # the op's empty scales without a quant
    return [x.new_empty(spec.shape, dtype=spec.dtype) for spec in (specs.get(name, none) for name in OP_OUTPUTS)]
