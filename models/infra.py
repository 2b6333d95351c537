"""Shared helpers for ``<model>/infra/parallelize.py``."""

from __future__ import annotations

from typing import Any

_SIZE_FIELDS = (
    "world_size", "dp_replicate", "dp_shard", "dp", "tp", "pp", "cp", "ep", "etp",
    "dp_size", "dp_shard_size", "dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size", "etp_size",
)


def parallel_sizes(parallel_dims: Any) -> dict[str, int]:
    """The parallel sizes an object carries (``ParallelDims`` or anything with size fields)."""
    if parallel_dims is None:
        return {}
    sizes = {}
    for name in _SIZE_FIELDS:
        value = getattr(parallel_dims, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            sizes[name] = value
    return sizes


def require_single_device(parallel_dims: Any, model_name: str) -> None:
    """Raise ``NotImplementedError`` unless every parallel size is 1 (placeholder parallelize)."""
    bigger = {k: v for k, v in parallel_sizes(parallel_dims).items() if v > 1}
    if bigger:
        raise NotImplementedError(
            f"parallelize_{model_name}: parallel sizes {bigger} are not applied yet; "
            "multi-device parallelism lands with the engine issue."
        )
