"""ep_moe_step at world 1 on a GPU: moe_dispatch + experts + moe_combine with out=None (what
compiled code takes) against out= the layer's pooled buffers (eager and graphs), each against
a per-token float32 loop over the chosen experts. torchrun --nproc-per-node=1 .../ep_compile_diag2.py"""
import sys

import torch
import torch.nn.functional as F

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
x = rms_norm(hidden, layer.w.norm, cfg.eps)
ids, w = layer.route(x)


def run(out):
    d = comm.moe_dispatch(x, ids, w, cfg.experts, max_tokens=64, out=out)
    return d, comm.moe_combine(layer.local_experts(d), d.handle)


def loop():
    got = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float32, device=dev)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = int(ids[t, j])
            gate, up = (x[t:t + 1].float() @ layer.w.gate_up[e].float().t()).chunk(2, dim=-1)
            got[t] += w[t, j] * ((F.silu(gate) * up) @ layer.w.down[e].float().t())[0]
    return got


ref = loop()
for name, out in (("out=None", None), ("out=bufs", layer.bufs)):
    d, y = run(out)
    n = int(d.expert_offsets[-1])
    print(name, "path", comm.select("moe_dispatch", x, ids, w, cfg.experts, max_tokens=64, out=out) if hasattr(comm, "select") else "?",
          "| offsets", d.expert_offsets.tolist()[:6], "... used rows", n, "of", d.x.shape[0],
          "| max err vs loop", float((y.float() - ref).abs().max()), "max |loop|", float(ref.abs().max()))
a, b = run(None)[0], run(layer.bufs)[0]
n = int(a.expert_offsets[-1])
print("received rows equal", torch.equal(a.x[:n], b.x[:n]), "offsets equal", torch.equal(a.expert_offsets, b.expert_offsets))
ya, yb = layer.local_experts(a), layer.local_experts(b)
print("expert outputs equal on used rows", torch.equal(ya[:n], yb[:n]), "strides", a.x.stride(), b.x.stride(),
      "contiguous", a.x.is_contiguous(), b.x.is_contiguous(), "dtypes", a.x.dtype, b.x.dtype)
comm.close()
torch.distributed.destroy_process_group()
