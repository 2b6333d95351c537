"""Work that only training rank 0 does (rollout servers, rewards, checks), with its result or failure on every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from archon.errors import JobError, user_error_types

logger = logging.getLogger("archon.rl")


class RankZeroError(JobError):
    """Work that only rank 0 does (launching servers, rollouts, rewards) failed; raised on every rank."""


def run_on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on rank 0, its result broadcast to every rank; a failure is raised on every rank.

    Without this, a rank-0 failure would leave the other ranks waiting in the next collective
    until the process-group timeout (30 minutes by default).
    """
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("ok", fn())]
        except user_error_types() as exc:  # one sentence says it all: no traceback
            payload = [("error", f"{what} failed on rank 0: {exc}")]
        except Exception as exc:  # noqa: BLE001 - a bug: keep its traceback in rank 0's log; re-raised below
            logger.exception("%s failed on rank 0", what)
            payload = [("error", f"{what} failed on rank 0: {type(exc).__name__}: {exc}")]
    if dist.get_world_size() > 1:
        # Pickling a round of rollouts for a group of one cost ~1.5 ms of a digits-demo step.
        dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise RankZeroError(value)
    return value
