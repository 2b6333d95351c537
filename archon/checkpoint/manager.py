"""A run's checkpoint folders: written atomically, checked before use, pruned only when safe.

Layout: ``<run_dir>/checkpoints/step_<N>/<engine>/`` (one folder per engine: actor, critic)
with ``step_<N>/complete.json`` and a ``latest`` file naming the newest folder.

Writing step N: every engine saves into ``step_<N>.partial/``; after all ranks are done,
rank 0 writes ``complete.json`` last (the size of every file of the checkpoint), renames
the folder to ``step_<N>``, points ``latest`` at it, and only then deletes checkpoints
beyond ``keep_last``.  A kill at any moment therefore leaves the previous complete
checkpoint, or the new one, never a half-written folder that looks complete.

Resuming: the newest ``step_<N>`` whose ``complete.json`` exists and whose files all have
their recorded sizes is loaded; a damaged one (missing marker, missing or truncated file,
unreadable shard) is skipped for the previous complete one, with a warning naming it.
The folders themselves decide, not ``latest``: deleting the newest folder by hand resumes
from the one before it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from archon.checkpoint.dcp import CheckpointError, CheckpointWriteError, all_ranks_ok
from archon.config import ConfigError
from archon.runtime.drill import drill_point

logger = logging.getLogger("archon.checkpoint")

COMPLETE = "complete.json"
PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"step_(\d+)")


class Checkpointable(Protocol):
    """What the manager asks of an engine (``ArchonEngine`` is one): its own folder in, its own folder out."""

    def save(self, path: Path, extra_state: dict[str, Any]) -> None:
        """Write this engine's states under ``path`` (collective)."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` into this engine's states (collective); returns the extra state saved with it."""
        ...

    def checkpoint_nbytes(self) -> float:
        """This rank's share of the bytes one checkpoint of the engine takes (no collective)."""
        ...


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def manifest(folder: Path) -> dict[str, int]:
    """Size in bytes of every file under ``folder`` (relative paths; the marker itself excluded)."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE
    }


def damage(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (no marker, a missing or truncated file), or None if it is intact."""
    marker = folder / COMPLETE
    if not marker.is_file():
        return f"it has no {COMPLETE} (the run stopped while writing it)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {COMPLETE} is unreadable ({exc})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def estimate_checkpoint_bytes(engines: Mapping[str, Checkpointable]) -> int:
    """Bytes one checkpoint of ``engines`` takes (collective: the sum of every rank's share)."""
    total = torch.tensor([sum(engine.checkpoint_nbytes() for engine in engines.values())], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total.item())


def _broadcast_steps(steps: list[int]) -> list[int]:
    """Rank 0's list of step numbers on every rank (tensors, not pickles)."""
    n = torch.tensor([len(steps)], dtype=torch.int64)
    dist.broadcast(n, src=0)
    values = torch.tensor(steps if dist.get_rank() == 0 else [0] * int(n.item()), dtype=torch.int64)
    dist.broadcast(values, src=0)
    return values.tolist()


class CheckpointManager:
    """Saves and resumes ``<run_dir>/checkpoints/step_<N>/`` (see the module docstring)."""

    def __init__(self, run_dir: str | Path, keep_last: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = max(1, keep_last)
        self.loaded: Path | None = None
        """The folder the last ``load`` resumed from."""

    # ------------------------------------------------------------------ inspection (any rank, no collectives)
    def folders(self) -> list[tuple[int, Path]]:
        """Every ``step_<N>`` folder (complete or not), newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def latest(self) -> Path | None:
        """The newest intact checkpoint folder, or None."""
        for _, folder in self.folders():
            if damage(folder) is None:
                return folder
        return None

    # ------------------------------------------------------------------ before training
    def check_writable(self) -> None:
        """Collective: every rank can create files in the checkpoint folder, or every rank raises ``ConfigError``."""
        error = None
        probe = self.root / f".write_probe_rank{dist.get_rank()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            error = exc
        if not all_ranks_ok(error is None):
            where = f"({error})" if error is not None else "on another rank"
            raise ConfigError(
                f"output_dir {self.root.parent} cannot be written {where}; set output_dir to a folder "
                "this job can create files in"
            )

    def check_space(self, engines: Mapping[str, Checkpointable]) -> None:
        """Collective: the disk has room for one more checkpoint of ``engines``, or every rank raises
        ``ConfigError``."""
        needed = estimate_checkpoint_bytes(engines)
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free if dist.get_rank() == 0 else 0
        if all_ranks_ok(dist.get_rank() != 0 or free >= needed):
            return
        gib = 2**30
        raise ConfigError(
            f"output_dir {self.root.parent} has {free / gib:.2f} GiB free, but one checkpoint of this "
            f"run takes about {needed / gib:.2f} GiB (model and optimizer state of "
            f"{', '.join(engines)}); free disk space or set output_dir to a larger disk"
        )

    # ------------------------------------------------------------------ save
    def save(self, step: int, engines: Mapping[str, Checkpointable], extra_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` of ``engines`` (collective); returns its folder.

        On any failure (disk full mid-write, folder not writable) every rank raises
        ``CheckpointWriteError``; the partial folder is removed and older checkpoints are untouched.
        """
        folder = self.root / f"step_{step}"
        partial = self.root / f"step_{step}{PARTIAL_SUFFIX}"
        rank0 = dist.get_rank() == 0
        error = None
        if rank0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while writing it
                partial.mkdir()
            except OSError as exc:
                error = exc
        if not all_ranks_ok(error is None):
            raise CheckpointWriteError(self._write_failed(folder, error or "creating the folder failed on rank 0"))
        try:
            for i, (name, engine) in enumerate(engines.items()):
                engine.save(partial / name, extra_state)
                if i == 0:
                    drill_point("checkpoint")  # mid-checkpoint: shards of one engine written, nothing complete
            error = None
            if rank0:
                try:
                    self._complete(partial, folder, step)
                except OSError as exc:
                    error = exc
            if not all_ranks_ok(error is None):
                raise CheckpointWriteError(f"completing it on rank 0: {error}" if error else "completing it on rank 0")
        except CheckpointWriteError as exc:
            if rank0:
                shutil.rmtree(partial, ignore_errors=True)  # frees the space it took; nothing points at it
            raise CheckpointWriteError(self._write_failed(folder, exc)) from None
        if rank0:
            self._prune(step)
        dist.barrier()
        return folder

    def _write_failed(self, folder: Path, cause: object) -> str:
        previous = self.latest()
        kept = f"the previous checkpoint {previous} is intact" if previous is not None else "no checkpoint was kept"
        return (
            f"writing checkpoint {folder} failed ({cause}); {kept}; free disk space under {self.root} (or point "
            "output_dir at a larger, writable disk) and rerun the same command to resume"
        )

    def _complete(self, partial: Path, folder: Path, step: int) -> None:
        """Rank 0, after every rank wrote: the marker last, then the rename, then ``latest``."""
        _write_atomically(partial / COMPLETE, json.dumps({"step": step, "files": manifest(partial)}, indent=1))
        if folder.exists():
            # A damaged folder of the same step (the run resumed from an older one); never an intact
            # newer checkpoint, since a run always resumes from its newest intact one.
            shutil.rmtree(folder)
        partial.rename(folder)
        _fsync_dir(self.root)
        _write_atomically(self.root / "latest", folder.name)

    def _prune(self, step: int) -> None:
        """Rank 0: keep the newest ``keep_last`` intact checkpoints up to ``step``; delete every other one up to it.

        Folders of later steps (left when a run resumed from an older checkpoint) stay until the
        run reaches their step and replaces them.
        """
        intact = 0
        for n, folder in self.folders():
            if n > step:
                continue
            problem = damage(folder)
            if problem is None and intact < self.keep_last:
                intact += 1
                continue
            if problem is not None:
                logger.warning("deleting damaged checkpoint %s: %s", folder, problem)
            shutil.rmtree(folder, ignore_errors=True)
        for leftover in self.root.glob(f"step_*{PARTIAL_SUFFIX}"):
            shutil.rmtree(leftover, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, engines: Mapping[str, Checkpointable]) -> dict[str, Any] | None:
        """Load the newest intact checkpoint into ``engines`` (collective); its extra state, or None without one.

        Damaged checkpoints are skipped with a warning naming them; when every checkpoint there
        is damaged, the error names the newest one and why.
        """
        candidates: list[int] = []
        if dist.get_rank() == 0:
            for n, folder in self.folders():
                problem = damage(folder)
                if problem is None:
                    candidates.append(n)
                else:
                    logger.warning("skipping checkpoint %s: %s; resuming from an older one", folder, problem)
        candidates = _broadcast_steps(candidates)
        first_error: CheckpointError | None = None
        for n in candidates:
            folder = self.root / f"step_{n}"
            try:
                extra: dict[str, Any] = {}
                for name, engine in engines.items():
                    extra = engine.load(folder / name)
            except CheckpointError as exc:  # the same on every rank (DCP gathers every rank's failure)
                if dist.get_rank() == 0:
                    logger.warning("skipping checkpoint %s: %s; trying an older one", folder, exc)
                first_error = first_error or exc
                continue
            self.loaded = folder
            return extra
        if first_error is not None:
            raise CheckpointError(
                f"no checkpoint under {self.root} could be loaded; the newest failed with: {first_error}"
            )
        return None
