"""Where MoE decode time goes in the peer-push kernels, on ONE GPU with simulated ranks.

Not NVLink timing: the peers are the same HBM. What it measures: each kernel's duration
(torch.profiler over graph replays) and a replay's time per dispatch+combine, so the kernels'
own cost (launch, layout arithmetic, local barrier round trips) is separated from what two
real GPUs add. Run: python3 diag/moe_profile.py [tokens ...]
"""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
sys.path.insert(0, str(root / "tests"))
from _ep_reference import random_case  # noqa: E402
from _sim import SimWorld  # noqa: E402
from test_sim_ep import SimComm, _buffers  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

WORLD, HIDDEN, K, EXPERTS, ITERS = 2, 7168, 8, 256, 20


def run(tokens: int, quant, combine_quant, max_blocks: int) -> None:
    with SimWorld(WORLD, graph_slots=16, max_blocks=max_blocks) as sim:
        comms = [SimComm(sim, r) for r in range(WORLD)]
        bufs = _buffers(sim, tokens, HIDDEN, K, EXPERTS, 1, quant, False, torch.bfloat16)
        xs, ids, ws = random_case(WORLD, [tokens] * WORLD, HIDDEN, EXPERTS, K, seed=tokens)
        xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
        expert_out = [torch.randn(bufs[r].x.shape[0], HIDDEN, device="cuda").to(torch.bfloat16) for r in range(WORLD)]
        streams = [torch.cuda.Stream() for _ in range(WORLD)]
        got = [None] * WORLD

        def step(r):
            got[r] = comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant,
                                           global_scale=1.0 if quant else None, out=bufs[r])
            comms[r].moe_combine(expert_out[r], got[r].handle, quant=combine_quant)

        def dispatch_only(r):
            comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant,
                               global_scale=1.0 if quant else None, out=bufs[r])

        for what, body in (("d+c", step), ("dispatch", dispatch_only)):
            for _ in range(3):
                _each_rank(sim, streams, body)
            graphs = []
            for r in range(WORLD):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                    for _ in range(ITERS):
                        body(r)
                graphs.append(g)
            samples = []
            for _ in range(10):
                here = torch.cuda.current_stream()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(here)
                _each_rank(sim, streams, lambda r: graphs[r].replay())
                end.record(here)
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1000 / ITERS)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _each_rank(sim, streams, lambda r: graphs[r].replay())
            per = defaultdict(list)
            for ev in prof.events():
                if ev.device_type.name == "CUDA":
                    name = ev.name.replace("void ", "").replace("(anonymous namespace)::", "").split("<")[0][:60]
                    per[name].append(ev.device_time)
            print(f"tokens {tokens} quant {quant} combine {combine_quant} blocks {max_blocks} {what}: "
                  f"{statistics.median(samples):.2f} us per iteration (median of 10 replays; min "
                  f"{min(samples):.2f}); kernels (median us, count):", flush=True)
            for name, times in sorted(per.items()):
                print(f"    {name:40s} {statistics.median(times):8.2f} {len(times)}")
            assert all(sim.alarm(r) == 0 for r in range(WORLD))


if __name__ == "__main__":
    for t in [int(a) for a in sys.argv[1:]] or [1, 8, 64]:
        run(t, None, None, 32)
        if t == 1:
            run(t, "nvfp4", None, 32)
            run(t, None, None, 8)
