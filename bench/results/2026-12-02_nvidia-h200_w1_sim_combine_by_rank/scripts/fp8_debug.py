"""Session 33: where the kernel's FP8 combine differs from its CPU twin (two simulated ranks)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

root = Path.cwd()
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
sys.path.insert(0, str(root / "tests"))
from _ep_reference import random_case, world_combine, world_dispatch  # noqa: E402
from _sim import SimWorld  # noqa: E402
from test_sim_ep import SimComm, _buffers  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

from symcomm.ep import host  # noqa: E402

import os
world, tokens, experts, k, hidden, align, dtype, idt = eval(os.environ["CASE"])
xs, ids, ws = random_case(world, list(tokens), hidden, experts, k, seed=5, dtype=dtype, ids_dtype=idt)
mt = max(tokens) + 1
with SimWorld(world, graph_slots=8) as sim:
    comms = [SimComm(sim, r) for r in range(world)]
    bufs = _buffers(sim, mt, hidden, k, experts, align, None, False, dtype)
    xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
    streams = [torch.cuda.Stream() for _ in range(world)]
    got, comb = [None] * world, [None] * world
    _each_rank(sim, streams, lambda r: got.__setitem__(r, comms[r].moe_dispatch(xd[r], idd[r], wd[r], experts, max_tokens=mt, align=align, out=bufs[r])))
    gen = torch.Generator().manual_seed(1)
    outs = [torch.randn(got[r].x.shape[0], hidden, generator=gen).to(dtype) for r in range(world)]
    od = [o.cuda() for o in outs]
    for q in (None, "fp8"):
        _each_rank(sim, streams, lambda r: comb.__setitem__(r, comms[r].moe_combine(od[r], got[r].handle, quant=q)))
        torch.cuda.synchronize()
        ranks = host.dispatch_host(list(xs), list(ids), list(ws), experts, mt, align=align)
        twin = host.combine_host(ranks, list(outs), list(ids), mt, q)
        _, send_rows = world_dispatch(ids, experts, mt, align)
        want = world_combine(ids, ws, send_rows, outs, experts, q)
        for r in range(world):
            kb = got[r].handle.returned.cpu()
            tb = ranks[r].returned
            n = world * mt
            codes = n * hidden
            print(f"quant {q} rank {r}: out==ref {torch.equal(comb[r].cpu(), want[r])} twin==ref {torch.equal(twin[r], want[r])}"
                  f" alarm {sim.alarm(r)}")
            if q == "fp8":
                kf, tf = kb.view(-1), tb.view(-1)
                local = experts // world
                present = set()
                for t in range(tokens[r]):
                    for j in range(k):
                        if int(send_rows[r][t, j]) >= 0:
                            present.add(int(ids[r][t, j]) // local * mt + t)
                print("  present", sorted(present), "diff tokens", (comb[r].cpu() != want[r]).any(1).nonzero().flatten().tolist())
                for slot in sorted(present):
                    kc, tc = kf[slot * hidden:(slot + 1) * hidden], tf[slot * hidden:(slot + 1) * hidden]
                    ks = kf[codes + slot * 8:codes + slot * 8 + 8].view(torch.float32)
                    ts = tf[codes + slot * 8:codes + slot * 8 + 8].view(torch.float32)
                    if not torch.equal(kc, tc) or not torch.equal(ks, ts):
                        d = (kc != tc).nonzero().flatten()[:6].tolist()
                        print(f"  slot {slot}: codes differ at {d} ({int((kc != tc).sum())}), scales k {ks.tolist()} t {ts.tolist()}")

