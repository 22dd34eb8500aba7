"""Where ep_moe_step's compiled step departs from eager on a GPU (world 1): each stage compiled
alone on the eager stage's inputs. torchrun --nproc-per-node=1 .../ep_compile_diag.py"""
import sys

import torch

sys.path.insert(0, "examples")
import symcomm  # noqa: E402
import dp_moe_step  # noqa: E402
import ep_moe_step  # noqa: E402
from layer_utils import init_distributed, rms_norm  # noqa: E402
from symcomm import fp4  # noqa: E402

dev = init_distributed(False)
comm = symcomm.Communicator()
cfg = dp_moe_step.MoEConfig(hidden=2048, experts=16, top_k=4, ffn=1024)
for quant in ("nvfp4", None, "fp8"):
    layer = ep_moe_step.EPMoELayer(comm, cfg, 64, quant)
    hidden = dp_moe_step.padded_input(cfg, 0, 200, comm.rank, 64, 64, dev)
    C = lambda f: torch.compile(f, fullgraph=True, dynamic=False)  # noqa: E731
    norm = lambda h: rms_norm(h, layer.w.norm, cfg.eps)  # noqa: E731
    xe, xc = norm(hidden), C(norm)(hidden)
    ie, we = layer.route(xe)
    ic, wc = C(layer.route)(xe)
    print(quant, "norm: elements differing", int((xe != xc).sum()), "of", xe.numel(),
          "| route on eager x: ids differ", int((ie != ic).sum()), "weights max diff", float((we - wc).abs().max()))
    gse = fp4.global_scale_for(xe, comm) if quant == "nvfp4" else None

    def tail(x, ids, w, gs):
        d = comm.moe_dispatch(x, ids, w, cfg.experts, max_tokens=64, quant=quant, global_scale=gs)
        return comm.moe_combine(layer.local_experts(d), d.handle)

    te, tc = tail(xe, ie, we, gse), C(tail)(xe, ie, we, gse)
    print(quant, "tail (dispatch, experts, combine) on eager inputs: max err", float((te.float() - tc.float()).abs().max()),
          "max |eager|", float(te.float().abs().max()))

    def experts_only(x, ids, w, gs):
        d = comm.moe_dispatch(x, ids, w, cfg.experts, max_tokens=64, quant=quant, global_scale=gs)
        return layer.decode(d), d.expert_offsets

    de, oe = experts_only(xe, ie, we, gse)
    dc, oc = C(experts_only)(xe, ie, we, gse)
    n = int(oe[-1])
    print(quant, "dispatch+decode: offsets equal", torch.equal(oe, oc), "rows differing", int((de[:n] != dc[:n]).any(-1).sum()), "of", n)
    full_e, full_c = layer(hidden), C(layer.forward)(hidden)
    print(quant, "whole step: max err", float((full_e.float() - full_c.float()).abs().max()), "max |eager|", float(full_e.float().abs().max()))
comm.close()
torch.distributed.destroy_process_group()
