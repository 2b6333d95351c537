"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Model and optimizer state are saved as DTensors under their plain parameter names, so DCP
can load them under a different allocation (saved with ``archon:d2t2``, resumed with
``archon:d4``).  The small rest (step, scheduler, RNG, the caller's data position) is
rank-independent and written by rank 0 next to it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from archon.errors import ArchonError

if TYPE_CHECKING:
    from archon.engine.engine import ArchonEngine

ENGINE_STATE = "engine_state.pt"


class CheckpointError(ArchonError, ValueError):
    """A checkpoint folder is missing or does not match the engine."""


def _states(engine: "ArchonEngine") -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(engine.model)}
    if engine.optimizer is not None:
        state["optim"] = get_optimizer_state_dict(engine.model, engine.optimizer)
    return state


def save_checkpoint(engine: "ArchonEngine", path: Path, extra_state: dict[str, Any]) -> None:
    state = _states(engine)
    dcp.save(state, checkpoint_id=str(path / "dcp"))
    if dist.get_rank() == 0:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if engine.device_type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save({
            "step": engine.step,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "rng": rng,
            "allocation": str(engine.allocation),
            "extra": extra_state,
        }, path / ENGINE_STATE)
    dist.barrier()


def load_checkpoint(engine: "ArchonEngine", path: Path) -> dict[str, Any]:
    meta_file = path / ENGINE_STATE
    if not meta_file.is_file() or not (path / "dcp").is_dir():
        raise CheckpointError(f"'{path}' is not an Archon checkpoint (expected {ENGINE_STATE} and dcp/); "
                              "pass a folder written by ArchonEngine.save")
    state = _states(engine)
    if "optim" in state:
        try:
            dcp.load(state, checkpoint_id=str(path / "dcp"))
        except (RuntimeError, KeyError) as exc:
            if "optim" not in str(exc):
                raise
            raise CheckpointError(f"'{path}' has no optimizer state for {engine.name}; it was saved from an "
                                  "engine without an optimizer") from None
    else:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_model_state_dict(engine.model, state["model"], options=StateDictOptions(strict=True))
    if "optim" in state:
        set_optimizer_state_dict(engine.model, engine.optimizer, state["optim"])
    meta = torch.load(meta_file, weights_only=False)
    engine.step = meta["step"]
    if engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    torch.set_rng_state(meta["rng"]["torch"])
    random.setstate(meta["rng"]["python"])
    if engine.device_type == "cuda" and "cuda" in meta["rng"]:
        torch.cuda.set_rng_state(meta["rng"]["cuda"])
    return meta["extra"]


class CheckpointManager:
    """Checkpoint folders ``<run_dir>/checkpoints/step_<N>/<engine>/`` with a ``latest`` pointer.

    The pointer is rewritten (atomically) only after every engine of a step saved, so a run
    killed mid-save resumes from the previous complete checkpoint.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = max(1, keep_last)

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        folder = self.root / pointer.read_text().strip()
        return folder if folder.is_dir() else None

    def save(self, step: int, engines: dict[str, "ArchonEngine"], extra_state: dict[str, Any]) -> Path:
        folder = self.root / f"step_{step}"
        for name, engine in engines.items():
            engine.save(folder / name, extra_state)
        if dist.get_rank() == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(folder.name)
            tmp.replace(self.root / "latest")
            self._prune()
        dist.barrier()
        return folder

    def load(self, engines: dict[str, "ArchonEngine"]) -> dict[str, Any] | None:
        """Load the latest checkpoint into ``engines``; the extra state, or None without a checkpoint."""
        folder = self.latest()
        if folder is None:
            return None
        extra: dict[str, Any] = {}
        for name, engine in engines.items():
            extra = engine.load(folder / name)
        return extra

    def _prune(self) -> None:
        import shutil

        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
