"""Narrowing ep_moe_step's compiled/eager gap on a GPU (world 1): which prefix of the step, compiled,
departs from eager, and what the custom ops' bodies are handed. torchrun --nproc-per-node=1 ..."""
import sys

import torch

sys.path.insert(0, "examples")
import symcomm  # noqa: E402
import dp_moe_step  # noqa: E402
import ep_moe_step  # noqa: E402
from layer_utils import init_distributed, rms_norm  # noqa: E402

dev = init_distributed(False)
comm = symcomm.Communicator()
cfg = dp_moe_step.MoEConfig(hidden=2048, experts=16, top_k=4, ffn=1024)
layer = ep_moe_step.EPMoELayer(comm, cfg, 64, None)
hidden = dp_moe_step.padded_input(cfg, 0, 200, comm.rank, 64, 64, dev)
seen = []
orig_d, orig_c = symcomm.Communicator.moe_dispatch, symcomm.Communicator.moe_combine


def spy_d(self, x, ids, w, *a, **k):
    if not torch.compiler.is_compiling():
        seen.append(("dispatch", tuple(x.shape), x.stride(), x.dtype, tuple(ids.shape), ids.stride(), ids.dtype,
                     tuple(w.shape), w.stride(), w.dtype, k.get("out") is None))
    return orig_d(self, x, ids, w, *a, **k)


def spy_c(self, y, handle, *a, **k):
    if not torch.compiler.is_compiling():
        seen.append(("combine", tuple(y.shape), y.stride(), y.dtype))
    return orig_c(self, y, handle, *a, **k)


symcomm.Communicator.moe_dispatch, symcomm.Communicator.moe_combine = spy_d, spy_c
C = lambda f: torch.compile(f, fullgraph=True, dynamic=False)  # noqa: E731
norm = lambda h: rms_norm(h, layer.w.norm, cfg.eps)  # noqa: E731
x = norm(hidden)
ids, w = layer.route(x)


def tail(x, ids, w):
    d = comm.moe_dispatch(x, ids, w, cfg.experts, max_tokens=64)
    return comm.moe_combine(layer.local_experts(d), d.handle)


def from_x(x):
    i, ww = layer.route(x)
    return tail(x, i, ww)


def from_hidden(h):
    x = norm(h)
    i, ww = layer.route(x)
    return tail(x, i, ww)


want = tail(x, ids, w)
for name, fn, arg in (("tail(x, ids, w)", lambda a: tail(*a), (x, ids, w)), ("route+tail(x)", from_x, x),
                      ("norm+route+tail(h)", from_hidden, hidden), ("layer.moe(h)", layer.moe, hidden),
                      ("layer.forward(h) - h", lambda h: layer.forward(h) - h, hidden)):
    seen.clear()
    got = C(fn)(arg)
    print(f"{name}: max err vs eager tail {float((got.float() - want.float()).abs().max()):.4g}; bodies saw {seen}")
seen.clear()
e = layer.moe(hidden)
print(f"eager layer.moe(h) (out=bufs): max err vs eager tail {float((e.float() - want.float()).abs().max()):.4g}; {seen}")
comm.close()
torch.distributed.destroy_process_group()
