"""Parameter names without the path parts that wrappers add.

Activation checkpointing (``checkpoint_wrapper``), ``torch.compile`` (``OptimizedModule``)
and FSDP1 put a module under an attribute of their own, so its parameters get an extra
name part; the model's own name (what checkpoints, HF adapters and weight sync use) is the
name without them.  FSDP2 (``fully_shard``) and ``Module.compile`` add none.
"""

from __future__ import annotations

WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
"""Name parts added by AC (``checkpoint_wrapper``), ``torch.compile`` and FSDP1 wrappers."""


def clean_fqn(name: str) -> str:
    """``name`` without the parts activation checkpointing, ``torch.compile`` and FSDP1 wrappers add."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)
