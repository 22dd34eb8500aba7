"""Diagnostic only: symcomm-bench with the early dependent signal kept on although NCCL 2.28 is
loaded (symcomm turns it off there: NCCL 2.28's symmetric kernels never wait). Safe for runs whose
kernels are all symcomm's or launched without programmatic serialization (torch's)."""
import sys

import symcomm.backends.nccl as nccl_backend

nccl_backend.early_dependents_safe = lambda version: True
from symcomm.bench.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
