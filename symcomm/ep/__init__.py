"""Expert parallelism: what MoE dispatch and combine send and where it lands.

layout.py defines the receive layout and the combine's sum (every path matches it bit for bit),
fp8.py the block FP8 format of quant="fp8", host.py runs the peer kernels' per-row code on the
CPU (the kernels' CI twin). The operations are symcomm/operations/moe_dispatch.py and
moe_combine.py; their paths are symcomm/backends/ep_a2a.py and ep_push.py.
"""
from . import fp8, layout

__all__ = ["fp8", "layout"]
