"""``python -m symcomm``: what this install has (native library built or why not, torch,
devices, NCCL), for a user who wants to know before running anything."""
from .about import lines

print("\n".join(lines()))
