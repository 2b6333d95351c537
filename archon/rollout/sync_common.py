"""What every weight sync's ranks share: rank 0 decides, every rank learns the outcome, sizes and logs.

The weight syncs (``archon.rollout.weight_sync``, ``archon.rollout.tensor_weight_sync``) are collectives over the
trainer ranks; these helpers work without a process group too (a single process acts as rank 0 of one).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from archon.errors import ArchonError

logger = logging.getLogger("archon.rollout.weight_sync")

MIB = 1 << 20
"""Bytes in a mebibyte: weight_chunk_mb and the sync logs count in MiB."""


def extras_kw(extras: bool) -> dict[str, bool]:
    # Only passed when asked for, so engines without the option keep working.
    return {"extras": True} if extras else {}


class WeightSyncError(ArchonError, RuntimeError):
    """New weights did not reach the rollout servers; the message says where it failed."""


def trainer_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0, None elsewhere (``[obj]`` without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def raise_if_failed(error: str | None) -> None:
    """Collective: every rank raises rank 0's error (None: success)."""
    error = broadcast_object(error)
    if error is not None:
        raise WeightSyncError(error if trainer_rank() == 0 else f"weight sync failed on trainer rank 0: {error}")


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def log_sync_stats(kind: str, version: str, stats: dict[str, float]) -> None:
    if trainer_rank() == 0:
        logger.info(
            "%s weight sync to version %s: %.1f MiB in %.2f s",
            kind,
            version,
            stats["weight_sync_bytes"] / MIB,
            stats["weight_sync_time_s"],
        )
