"""Rollout servers that die during a run: restart the ones Archon launched, drop the others, or stop clearly.

``ServerSupervisor`` lives on trainer rank 0 next to the client and the launcher.

* A server is *lost* when the client marked it down (it refused connections or failed
  ``down_after`` requests in a row), its process exited, or it does not answer ``/health``.
  Its requests have already gone to the other servers (``RolloutClient`` retries elsewhere).
* ``recover()`` restarts a lost server the launcher started, on its own port, at most
  ``max_restarts`` times per run, and gives it back to the client.  It comes back with the
  model folder's weights: the caller must re-form the weight-update group and send the current
  weights before the next rollout (``archon.rl.server_recovery`` does, on every rank).
* A lost server that cannot be restarted (``rollout.server_addrs``, no restarts left, or the
  restart failed) is dropped: nothing is sent to it again and the next weight-update group
  leaves it out.
* When no server is left, ``RolloutError`` names every lost server, why it was lost, and the
  last lines of its log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from archon.launch.servers import RolloutLaunchError
from archon.rollout.client import RolloutClient, RolloutError, normalize_addr

logger = logging.getLogger("archon.launch.recovery")

_TAIL_LINES = 8


@dataclass
class Recovery:
    """What one ``recover()`` call did."""

    restarted: list[str] = field(default_factory=list)
    """Servers restarted (they need the current weights before they serve)."""
    dropped: list[str] = field(default_factory=list)
    """Servers given up on for the rest of the run."""

    @property
    def changed(self) -> bool:
        """The set of serving processes changed: the weight-update group must be re-formed."""
        return bool(self.restarted or self.dropped)


class ServerSupervisor:
    """Finds lost rollout servers, restarts the launched ones (a bounded number of times), drops the rest."""

    def __init__(self, client: RolloutClient, launcher: Any = None, max_restarts: int = 0):
        self.client = client
        self.launcher = launcher
        self.max_restarts = max_restarts
        self.restarts = 0
        self._dropped: set[str] = set()
        self._index: dict[str, int] = {}
        if launcher is not None and launcher.specs:
            self._index = {normalize_addr(addr): spec.index for addr, spec in zip(launcher.addrs, launcher.specs)}

    def stats(self) -> dict[str, float]:
        """For metrics: restarts so far and servers given up on."""
        return {"rollout/server_restarts": float(self.restarts), "rollout/servers_dropped": float(len(self._dropped))}

    def lost(self) -> list[str]:
        """Servers lost and not yet dropped: marked down, exited, or silent on ``/health``."""
        if self._index:
            exited = self.launcher.exited()
            for url, index in self._index.items():
                if index in exited and url not in self._dropped:
                    self.client.mark_down(url, f"its process exited with code {exited[index]}")
        self.client.check_health()
        return [url for url in self.client.down_addrs if url not in self._dropped]

    def can_restart(self, lost: list[str]) -> bool:
        """Whether ``recover()`` would restart at least one of ``lost``."""
        return self.restarts < self.max_restarts and any(url in self._index for url in lost)

    def recover(self) -> Recovery:
        """Restart or drop every lost server; ``RolloutError`` (naming them and their logs) when none is left."""
        result = Recovery()
        for url in self.lost():
            why = self.client.last_error(url) or "unknown"
            if url in self._index and self.restarts < self.max_restarts:
                self.restarts += 1
                logger.warning(
                    "rollout server %s was lost (%s); restarting it (restart %d of %d)",
                    url,
                    why,
                    self.restarts,
                    self.max_restarts,
                )
                try:
                    self.launcher.restart(self._index[url])
                except (RolloutLaunchError, OSError) as exc:
                    logger.warning("restarting rollout server %s failed: %s", url, exc)
                else:
                    self.client.revive(url)
                    result.restarted.append(url)
                    continue
            self._dropped.add(url)
            result.dropped.append(url)
            logger.warning(
                "rollout server %s was lost (%s) and is dropped; %d server(s) left", url, why, len(self.client.up_addrs)
            )
        if not self.client.up_addrs:
            raise self.no_server_left()
        return result

    def no_server_left(self, cause: BaseException | None = None) -> RolloutError:
        """The error that ends the run: every lost server, why, and the last lines of its log."""
        parts = []
        for url in self.client.down_addrs:
            part = f"{url} ({self.client.last_error(url) or 'unknown'})"
            if url in self._index:
                index = self._index[url]
                tail = self.launcher.log_tail(index, _TAIL_LINES).replace("\n", "\n    ")
                part += f"; last lines of {self.launcher.log_path(index)}:\n    {tail}\n"
            elif hasattr(self.launcher, "log_hint"):
                part += f"; {self.launcher.log_hint(url)}"
            parts.append(part)
        if self._index and self.restarts >= self.max_restarts:
            used = (
                f"all {self.max_restarts} restart(s) of rollout.max_server_restarts are used up"
                if self.max_restarts
                else "rollout.max_server_restarts = 0 allows no restart"
            )
            hint = (
                f"{used}; find the cause in the log above, then rerun the same command to resume from the last "
                "checkpoint"
            )
        elif self._index:
            hint = "restarting them failed; find the cause in the log above, then rerun to resume"
        elif hasattr(self.launcher, "log_hint"):
            hint = (
                "; a cluster launcher started them on their nodes, so the trainer cannot restart them; find the "
                "cause in their logs, then rerun the launch to resume from the last checkpoint"
            )
        else:
            hint = (
                "Archon did not start them (rollout.server_addrs), so it cannot restart them; restart them, then "
                "rerun the same command to resume from the last checkpoint"
            )
        because = f" (last request error: {cause})" if cause is not None else ""
        return RolloutError(f"no rollout server is left{because}: {'; '.join(parts)}{hint}")
