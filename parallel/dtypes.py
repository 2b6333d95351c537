"""dtype names as configs and command lines write them, and the torch dtypes they mean.

A module of its own so that the engine, the rollout server and the FSDP policies read one
table without reaching into each other.
"""

from __future__ import annotations

import torch

from parallel.errors import ParallelConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = tuple(_DTYPES)
"""The dtype names configs and command lines accept."""


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype named ``name`` (one of ``DTYPE_NAMES``); a torch dtype is returned as it is."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ParallelConfigError(f"dtype '{name}' is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]
