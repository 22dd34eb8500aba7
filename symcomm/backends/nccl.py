"""Plain NCCL, and NCCL on symmetric windows. One class serves both: they differ only in
which communicator they enqueue on and in what they require of the tensors.

The symmetric communicator has windows registered; NCCL picks its symmetric kernels there
when every buffer of the call lies in a window (same offset on every rank). The plain
communicator has none, so even a symmetric tensor runs NCCL's regular kernels on it, which
win at large sizes without NVLS (ANCHORS.md).
"""
from __future__ import annotations

import torch

from .._nccl import DTYPES, REDUCE_OPS, UINT8, Library, reduce_dtype
from ..errors import DtypeError
from ..pool import GRANULE_SHIFT
from .base import SCATTERING_OPS, Call, raw_stream, runner_table


# Uneven all_gatherv schedule, by the gathered bytes (all tensors of the call). Same-run
# measurement (bench/gatherv_variants.py, 2026-11-22, H200, NCCL 2.28.9): a group of sends and
# receives beat a group of one broadcast per root by 1.35x/2.0x/1.6x/1.06x at 1/4/16/64 MiB at
# world 4, and 2.0x/1.6x/1.3x/1.02x at world 2. Above 64 MiB only a cross-run comparison
# exists (bench/fp4_gather.py's bf16 gather: 128 MiB 465 vs 415 us, 256 MiB 941 vs 745 us with
# send/recv vs broadcasts), so broadcasts keep the sizes where send/recv was not shown to win.
SENDRECV_GATHERV_MAX_BYTES = 64 << 20


class NcclBackend:
    def __init__(self, name: str, nccl: Library, comm: int, rank: int, device: torch.device,
                 granules: dict[int, int] | None = None) -> None:
        self.name = name
        self._nccl = nccl
        self._lib = nccl.lib
        self.comm = comm
        self._rank = rank
        self._device_index = device.index
        # Only the symmetric backend gets the pool's granule map (SegmentIndex.granules); its
        # presence is what makes why_not demand windows.
        self._granules = granules
        self._reduce_codes: dict[torch.dtype, int] = {}
        for dtype in DTYPES:
            try:
                self._reduce_codes[dtype] = reduce_dtype(dtype, nccl.version)
            except DtypeError:
                pass

    def why_not(self, call: Call) -> str | None:
        # Runs on every call: cheapest tests first, and nothing the validator already did
        # (device, contiguity, shapes).
        if call.redop is not None and call.dtype not in self._reduce_codes:
            return self._unreducible(call.dtype)
        if self._granules is None or call.nbytes == 0:
            return None  # plain NCCL takes any buffer; an empty call touches no memory
        if call.op in SCATTERING_OPS and call.outputs[0].nbytes % 16:
            # Measured 2026-11-21, NCCL 2.28.9, 2x/4x H200: the symmetric reduce-scatter kernels
            # got one element wrong on odd ranks when a rank's chunk was 14 bytes (7 bf16), and
            # NCCL raised no error. Chunks that are whole 16-byte vectors were always right.
            return "each rank's chunk must be a multiple of 16 bytes for NCCL's symmetric reduce-scatter"
        if call.sizes is not None and not call.even:
            # Uneven rows put each rank's slice at a different offset: a symmetric kernel
            # would read the wrong peer memory (DESIGN.md, "same offset" rule).
            return "per-rank sizes are uneven, so window offsets differ between ranks"
        symmetric = call._symmetric
        if symmetric is None:
            owner = self._granules.get
            symmetric = True
            for ptr in (*call.in_ptrs, *call.out_ptrs):
                if owner(ptr >> GRANULE_SHIFT) is None:
                    symmetric = False
                    break
            call._symmetric = symmetric
        if not symmetric:
            return "input and output are not both in symmetric memory"
        return None

    def _unreducible(self, dtype: torch.dtype) -> str:
        try:
            reduce_dtype(dtype, self._nccl.version)
        except DtypeError as exc:
            return str(exc)
        return f"NCCL cannot reduce {dtype}"

    def run(self, call: Call) -> None:
        self._RUNNERS[call.op](self, call, raw_stream(self._device_index))

    def _check(self, call: str, code: int) -> None:
        if code:
            self._raise(call, code)

    def _raise(self, call: str, code: int) -> None:
        self._nccl.check(call, code, self.comm)

    def _all_reduce(self, call: Call, stream: int) -> None:
        x = call.inputs[0]
        code = self._lib.ncclAllReduce(call.in_ptrs[0], call.out_ptrs[0], x.numel(), self._reduce_codes[x.dtype],
                                       REDUCE_OPS[call.redop], self.comm, stream)
        if code:  # no helper call on success: this is the eager hot path
            self._raise("ncclAllReduce", code)

    def _all_gather(self, call: Call, stream: int) -> None:
        # Byte-moving ops send every dtype (fp8, packed fp4, ...) as uint8.
        self._check("ncclAllGather", self._lib.ncclAllGather(
            call.in_ptrs[0], call.out_ptrs[0], call.inputs[0].nbytes, UINT8, self.comm, stream))

    def _reduce_scatter(self, call: Call, stream: int) -> None:
        self._check("ncclReduceScatter", self._lib.ncclReduceScatter(
            call.in_ptrs[0], call.out_ptrs[0], call.outputs[0].numel(), self._reduce_codes[call.dtype],
            REDUCE_OPS[call.redop], self.comm, stream))

    def _all_gatherv(self, call: Call, stream: int) -> None:
        if call.even:
            self._grouped(call, lambda x, out, src, base: self._check(
                "ncclAllGather", self._lib.ncclAllGather(src, base, x.nbytes, UINT8, self.comm, stream)))
        elif call.nbytes <= SENDRECV_GATHERV_MAX_BYTES:
            self._grouped(call, lambda x, out, src, base: self._send_recv_rows(call.sizes, x, out, src, base, stream))
        else:
            self._grouped(call, lambda x, out, src, base: self._broadcast_rows(call.sizes, out, src, base, stream))

    def _grouped(self, call: Call, enqueue) -> None:
        """enqueue(x, out, src_ptr, out_ptr) for each tensor pair, all in one NCCL group."""
        self._check("ncclGroupStart", self._lib.ncclGroupStart())
        try:
            for pair in zip(call.inputs, call.outputs, call.in_ptrs, call.out_ptrs):
                enqueue(*pair)
        finally:
            self._check("ncclGroupEnd", self._lib.ncclGroupEnd())

    def _send_recv_rows(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor, src: int, base: int,
                        stream: int) -> None:
        # Every rank knows the sizes, so both ends of a pair skip an empty slice alike. This
        # rank's own rows are a local copy (enqueued on the stream now, so it runs before the
        # group's kernels), and none when the input already sits in place.
        me, lib, comm = self._rank, self._lib, self.comm
        row_bytes = out.nbytes // out.shape[0]  # out has sum(sizes) > 0 rows here
        start = 0
        for peer, rows in enumerate(sizes):
            if peer == me:
                if rows and src != base + start * row_bytes:
                    out.narrow(0, start, rows).copy_(x)
            else:
                if sizes[me]:
                    self._check("ncclSend", lib.ncclSend(src, sizes[me] * row_bytes, UINT8, peer, comm, stream))
                if rows:
                    self._check("ncclRecv", lib.ncclRecv(base + start * row_bytes, rows * row_bytes, UINT8, peer,
                                                         comm, stream))
            start += rows

    def _broadcast_rows(self, sizes: list[int], out: torch.Tensor, src: int, base: int, stream: int) -> None:
        # One broadcast per root into its slice of the output; every rank skips the same empty
        # roots. The root's broadcast also copies its own rows into place.
        me, lib, comm = self._rank, self._lib, self.comm
        row_bytes = out.nbytes // out.shape[0]
        offset = 0
        for root, rows in enumerate(sizes):
            if rows:
                dst = base + offset
                self._check("ncclBroadcast", lib.ncclBroadcast(src if root == me else dst, dst, rows * row_bytes,
                                                               UINT8, root, comm, stream))
            offset += rows * row_bytes

    def _reduce_scatterv(self, call: Call, stream: int) -> None:
        x, out = call.inputs[0], call.outputs[0]
        x_ptr, out_ptr = call.in_ptrs[0], call.out_ptrs[0]
        dtype = self._reduce_codes[call.dtype]
        op = REDUCE_OPS[call.redop]
        if call.even:
            self._check("ncclReduceScatter", self._lib.ncclReduceScatter(
                x_ptr, out_ptr, out.numel(), dtype, op, self.comm, stream))
            return
        row_elems = x.numel() // x.shape[0]  # x has sum(sizes) > 0 rows here
        row_bytes = row_elems * x.element_size()
        lib, comm = self._lib, self.comm
        self._check("ncclGroupStart", lib.ncclGroupStart())
        try:
            offset = 0
            for root, rows in enumerate(call.sizes):
                if rows:
                    src = x_ptr + offset * row_bytes
                    # recvbuff matters at the root only; elsewhere NCCL ignores it
                    code = lib.ncclReduce(src, out_ptr if root == self._rank else src, rows * row_elems,
                                          dtype, op, root, comm, stream)
                    self._check("ncclReduce", code)
                offset += rows
        finally:
            self._check("ncclGroupEnd", lib.ncclGroupEnd())

    _RUNNERS = runner_table(locals())

