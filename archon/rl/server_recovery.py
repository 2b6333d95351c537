"""Keeping an RL run going when rollout servers die: the trainer's side of ``archon.launch.recovery``.

Rank 0 owns the client, the launcher and the ``ServerSupervisor``; every rank takes part in
the weight sync.  So recovery is collective: rank 0 restarts or drops the lost servers and
broadcasts what changed, then every rank re-forms the weight-update group and, when restarted
servers would otherwise serve the model folder's weights, sends the policy they should have.

* A server lost while others are up costs nothing during the rollout (the client sends its
  requests elsewhere); before the step's weight sync it is restarted or dropped, and the sync
  then brings every server to the new policy.
* When a rollout fails because no server is left, the run restarts what it may, gives the
  restarted servers the current policy, and repeats the rollout: sampling seeds depend only on
  the step and the sample, so the repeated rollout is the one the run would have made.
* When nothing can be restarted, the run stops with the supervisor's error before the step
  trains or saves anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from archon.rl.rank0 import run_on_rank0
from archon.rollout.client import RolloutError, RolloutRequestError
from archon.rollout.weight_sync import WeightSyncError

logger = logging.getLogger("archon.rl")

T = TypeVar("T")


def generate_or_recover(supervisor: Any, generate: Callable[[], T]) -> T | None:
    """Rank 0: ``generate()``; None when servers were lost and restarting them lets the rollout be repeated."""
    try:
        return generate()
    except RolloutRequestError:
        raise  # the request itself was refused: no server would take it
    except RolloutError as exc:
        lost = supervisor.lost()
        if supervisor.can_restart(lost):
            logger.warning("rollout failed (%s); restarting lost rollout servers and repeating the rollout", exc)
            return None
        if not supervisor.client.up_addrs:
            raise supervisor.no_server_left() from None
        raise


def recover_servers(supervisor: Any, weight_sync: Any, version: str | None) -> bool:
    """Collective: restart or drop lost servers; re-form the group and send ``version`` to restarted ones.

    ``version`` is what the servers should serve (None: the model folder's weights, which a
    restarted server already has).  Returns whether any server was restarted or dropped.
    """

    def recover() -> tuple[bool, bool]:
        result = supervisor.recover()
        return result.changed, bool(result.restarted)

    changed, restarted = run_on_rank0(recover, "recovering the rollout servers")
    if changed:
        weight_sync.rebuild()
        if restarted and version is not None:
            weight_sync.sync(version)
    return changed


def sync_with_recovery(supervisor: Any, weight_sync: Any, version: str) -> dict[str, float]:
    """Collective: recover servers lost during the step, then sync ``version``; once more if a server dies meanwhile."""
    recover_servers(supervisor, weight_sync, None)  # the sync below gives restarted servers the new policy
    try:
        return weight_sync.sync(version)
    except WeightSyncError:
        if not recover_servers(supervisor, weight_sync, None):
            raise
        return weight_sync.sync(version)
