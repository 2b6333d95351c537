"""torch.compile per transformer block (after activation checkpointing, before FSDP).

Per block rather than the whole model: blocks are identical, so one graph is compiled and
reused, and FSDP's per-block hooks stay outside the graphs.  On this project's CPU machines
compile costs ~25 s cold per block graph and does not make training faster; CPU configs keep
it off.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def apply_compile(blocks: nn.ModuleDict, fullgraph: bool = True) -> None:
    """Compile every block's forward in place (``Module.compile`` keeps parameter names unchanged)."""
    # Packed lengths vary; dynamo switches to dynamic shapes after the first recompile, and a
    # larger cache keeps blocks from falling back to eager when several shapes are live.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for block in blocks.values():
        block.compile(fullgraph=fullgraph)
