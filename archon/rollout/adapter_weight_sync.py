"""Adapter-only weight sync: a LoRA actor's adapters, not its merged weights, reach the rollout servers.

Per sync the engine writes its adapters as a PEFT folder (``export_peft``, a collective; rank 0 writes) into a
fresh temp dir, rank 0 renames it atomically to ``<folder>/v<version>`` and has every up server load it under a
new adapter name (``archon-v<version>``) through its LoRA endpoint (SGLang's and the built-in server's
``/load_lora_adapter``, vLLM's ``/v1/load_lora_adapter``); from then on the client names that adapter in every
generate request, and each server's previous adapter is unloaded (``RolloutClient.load_lora_adapter``).  A new
name per sync, because vLLM caches adapters by name and refuses to load a name twice.  The base weights never
move: the servers keep serving ``actor.path`` underneath.  The folder must be visible to the servers, and they must
be started with LoRA enabled (the launcher does so when ``rollout.lora_sync`` resolves to 'adapter').

The first sync may come before any adapter was loaded: the servers serve the base, which is what PEFT's init
(B = 0) computes too.  The engine is duck-typed (``export_peft(path) -> bool``), so this module does not import
``archon.engine``; errors on rank 0 are broadcast so that every rank raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from archon.rollout.folder_publish import VersionFolders

ADAPTER_PREFIX = "archon-v"
"""Adapter names are this and the weight version (and ``-r<n>`` when a version is synced again)."""


class AdapterSyncEngine(Protocol):
    """What adapter sync needs from a training engine."""

    def export_peft(self, path: str | Path) -> bool: ...


class AdapterWeightSync:
    """LoRA adapters through a PEFT folder on a disk the servers can read, loaded by their LoRA endpoints."""

    def __init__(self, engine: AdapterSyncEngine, client: Any, folder: str | Path, *, keep_last: int = 2):
        self.engine = engine
        self.client = client
        # The folder of the adapter being served is kept until the next sync loaded another.
        hint = (
            "; the folder must be visible to the servers and they must have LoRA enabled, or set "
            "rollout.lora_sync = 'merged'"
        )
        self.folders = VersionFolders(folder, "adapter", keep_last, hint)
        self._synced: dict[str, int] = {}  # times each version was synced (recovery syncs one again)

    def setup(self) -> None:
        """Collective: create the folder."""
        self.folders.setup()

    def adapter_name(self, version: str) -> str:
        """A name no server has loaded: ``archon-v<version>``, then ``-r<n>`` for the n-th sync of it again."""
        n = self._synced.get(version, 0)
        self._synced[version] = n + 1
        return f"{ADAPTER_PREFIX}{version}" + (f"-r{n}" if n else "")

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Collective: export the adapters, publish them as ``<folder>/v<version>``, make every server serve them.

        ``servers_quiet`` is accepted for symmetry: requests running during the switch finish with the adapter
        they started with (the built-in server lets them finish before it merges the new one).
        """
        version = str(version)
        wrote: list[bool] = []

        def load(final: Path) -> None:
            if not wrote[0]:
                raise RuntimeError(
                    "the actor engine cannot write its adapters as a PEFT folder; set rollout.lora_sync = 'merged'"
                )
            self.client.load_lora_adapter(self.adapter_name(version), str(final), version)

        return self.folders.publish(version, lambda tmp: wrote.append(self.engine.export_peft(tmp)), load)

    def rebuild(self) -> None:
        """Nothing to re-form: ``sync`` reaches whichever servers are up (a restarted one holds no adapter)."""

    def close(self) -> None:
        pass
