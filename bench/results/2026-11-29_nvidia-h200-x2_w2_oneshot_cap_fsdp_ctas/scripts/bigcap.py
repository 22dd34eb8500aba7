"""symcomm-bench under torchrun with custom_ar_capacity raised (default 16 MiB): do the custom
all-reduce kernels beat NCCL and PyTorch's two-shot at 64-256 MiB once the cap is lifted?"""
import sys
import symcomm
from symcomm.bench import cli

CAP = 1 << 30
_orig = symcomm.Communicator


class BigCap(_orig):
    def __init__(self, *a, **k):
        k.setdefault("custom_ar_capacity", CAP)
        super().__init__(*a, **k)


symcomm.Communicator = BigCap
sys.exit(cli.main(sys.argv[1:]))
