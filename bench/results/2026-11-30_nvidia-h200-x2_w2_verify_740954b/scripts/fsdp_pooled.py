"""Diagnostic, not shipped: bench/train_step.py's FSDP rows plus 'pooled', whose two weight
gathers write into outputs allocated once in the symmetric pool, so a pool-to-pool path
(custom-push) can serve them where the shipped step's gathers (outputs from the caching
allocator) run on plain NCCL at 16 CTAs. The backward's reduce-scatter input (autograd's
gradient of the gathered weight) stays outside the pool in both.

    torchrun --nproc-per-node=2 diag/w15/fsdp_pooled.py --steps fsdp --json out.json

EXTRA_MIB (default 256) is added to the pool train_step reserves, for the gathered weights.
"""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import train_step as ts  # noqa: E402

import symcomm  # noqa: E402


class FSDPPooled(ts.FSDPOverlapped):
    def __init__(self, comm, cfg, full):
        super().__init__(comm, cfg, full)
        w = comm.world_size
        with symcomm.use_symmetric_memory(comm):
            self.gathered = [torch.empty((p.shape[0] * w, *p.shape[1:]), dtype=p.dtype, device=p.device)
                             for p in self.params]
        if comm.rank == 0:
            for p, out in zip(self.params, self.gathered):
                print(f"# pooled gather {tuple(out.shape)}: {comm.select('all_gather', p.detach(), out=out).algo}",
                      flush=True)

    def gather_ahead(self):
        here = torch.cuda.current_stream()
        self.comm_stream.wait_stream(here)
        self.held.clear()
        gathered = []
        with torch.cuda.stream(self.comm_stream):
            for i, s in enumerate(self.params):
                # A fresh alias each step: out= on the same autograd tensor would chain this step's graph to the last.
                w = self.held[i] = self.comm.all_gather(s, out=self.gathered[i].detach())
                gathered.append((w, torch.cuda.Event()))
                gathered[-1][1].record()
        return gathered


_Communicator = symcomm.Communicator


def _with_room(*args, symmetric_capacity=None, **kwargs):
    extra = int(os.environ.get("EXTRA_MIB", "256")) << 20
    return _Communicator(*args, symmetric_capacity=(symmetric_capacity or 256 << 20) + extra, **kwargs)


ts.MODELS["fsdp", "pooled"] = FSDPPooled
ts.MODELS["tp", "pooled"] = ts.TPOverlapped  # so --steps tp,fsdp runs too
ts.VARIANTS = ("symcomm", "pooled", "funcol", "local")
symcomm.Communicator = _with_room

if __name__ == "__main__":
    sys.exit(ts.main())
