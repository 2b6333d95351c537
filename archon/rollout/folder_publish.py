"""Weights through folders the rollout servers read: each sync's files appear atomically as ``<folder>/v<version>``.

The disk weight sync (an HF folder) and the LoRA adapter sync (a PEFT folder) differ only in what every trainer
rank writes and in how rank 0 has the servers load the result; the protocol is this module's: rank 0 makes a
temp dir inside the folder (so the final rename stays on one filesystem), every rank writes into it (a
collective), rank 0 renames it to ``v<version>``, has the servers load it, and deletes older versions beyond
``keep_last``.  Errors on rank 0 are broadcast, so that every rank raises instead of waiting.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from archon.rollout.sync_common import broadcast_object, log_sync_stats, raise_if_failed, trainer_rank
from archon.runtime.drill import drill_point


class VersionFolders:
    """``<folder>/v<version>`` folders published for the rollout servers, the newest ``keep_last`` kept."""

    def __init__(self, folder: str | Path, kind: str, keep_last: int = 1, hint: str = ""):
        self.folder = Path(folder)
        self.kind = kind
        """What is synced, for logs and errors ('disk', 'adapter')."""
        self.keep_last = max(1, keep_last)
        self.hint = hint
        """Appended to a failure's message: what the user can do about it."""

    def setup(self) -> None:
        """Collective: create the folder."""
        error = None
        if trainer_rank() == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                error = f"cannot create the {self.kind} weight folder {self.folder}: {exc}; set a writable folder"
        raise_if_failed(error)

    def publish(
        self,
        version: str,
        write: Callable[[str], None],
        load: Callable[[Path], None],
        prepare: Callable[[str], None] | None = None,
    ) -> dict[str, float]:
        """Collective: every rank calls ``write(temp dir)``, rank 0 then ``prepare(temp dir)`` (if given), renames it
        to ``v<version>`` and calls ``load(final folder)``; returns the sync's time and its safetensors bytes."""
        t0 = time.perf_counter()
        tmp, error = None, None
        if trainer_rank() == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".v{version}.tmp-", dir=self.folder)
            except OSError as exc:
                error = (
                    f"cannot create a temp dir in {self.kind} weight folder {self.folder}: {exc}; set a writable folder"
                )
        raise_if_failed(error)
        tmp = broadcast_object(tmp)
        write(tmp)
        nbytes = 0
        if trainer_rank() == 0:
            final = self.folder / f"v{version}"
            drill_point("weight_sync")
            try:
                if prepare is not None:
                    prepare(tmp)
                nbytes = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
                if final.exists():
                    shutil.rmtree(final)  # re-syncing a version replaces it
                os.rename(tmp, final)
                load(final)
                self._remove_old(keep=final)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"{self.kind} weight sync of version {version} via {final} failed: {exc}{self.hint}"
            finally:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
        raise_if_failed(error)
        stats = {"weight_sync_time_s": time.perf_counter() - t0, "weight_sync_bytes": float(broadcast_object(nbytes))}
        log_sync_stats(self.kind, version, stats)
        return stats

    def _remove_old(self, keep: Path) -> None:
        versions = sorted(
            (p for p in self.folder.glob("v*") if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime
        )
        for old in versions[: max(0, len(versions) - (self.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)
