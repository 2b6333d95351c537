"""One engine's resumable state with torch.distributed.checkpoint (DCP), read without running code.

Model and optimizer tensors are saved as DTensors under their plain parameter names, so DCP
can load them under a different allocation (saved with ``archon:d2t2``, resumed with
``archon:d4``).  Everything else is rank-independent and written by rank 0 next to it, as
data rather than pickles: ``engine_state.json`` (step, LR scheduler, optimizer
hyper-parameters, Python RNG, the caller's data position) and ``rng_state.safetensors``
(torch and CUDA generator states).

Loading a checkpoint never unpickles arbitrary objects: the DCP index (``.metadata``, a
pickle that DCP writes) is read with an unpickler that only builds DCP's own metadata
classes, and a checkpoint whose index describes a non-tensor item is refused instead of
being handed to ``torch.load(weights_only=False)``.  So a file planted in a checkpoint folder
cannot run code on resume.  Folders, completeness and fallbacks are the business of
``archon.engine.checkpoint_manager``.
"""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from archon.errors import ArchonError, JobError

if TYPE_CHECKING:
    from archon.engine.engine import ArchonEngine

ENGINE_STATE = "engine_state.json"
RNG_STATE = "rng_state.safetensors"
DCP_DIR = "dcp"


class CheckpointError(ArchonError, ValueError):
    """A checkpoint folder is missing, damaged, or does not match the engine."""


class CheckpointWriteError(JobError):
    """Writing a checkpoint failed (disk full, folder not writable); raised on every rank."""


# ---------------------------------------------------------------------------- safe reading

# The globals a DCP index may name: DCP's metadata classes, the storage record of the file
# system reader, and plain torch/pathlib values (dtypes, sizes, layouts, paths).
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds a DCP ``Metadata`` and nothing else: any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA_MODULE and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the DCP index refers to {module}.{name}, which a checkpoint never contains")


class _SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the index read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"the DCP index {path} is missing or damaged ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"the DCP index {path} holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Archon's checkpoints hold tensors only; DCP would ``torch.load(weights_only=False)`` anything else."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"the checkpoint stores '{read_item.dest_index.fqn}' as a pickled object, but Archon "
                              "checkpoints hold tensors only; it was not written by Archon and is not loaded")


# ---------------------------------------------------------------------------- state

def _states(engine: "ArchonEngine") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tensors DCP saves and loads, and this rank's optimizer param groups (parameter names and
    hyper-parameters; the hyper-parameters go to JSON beside the tensors)."""
    state: dict[str, Any] = {"model": get_model_state_dict(engine.model)}
    groups: list[dict[str, Any]] = []
    if engine.optimizer is not None:
        optim = get_optimizer_state_dict(engine.model, engine.optimizer)
        state["optim"] = {"state": optim["state"]}
        groups = optim["param_groups"]
    return state, groups


def _python_rng_to_json(state: tuple) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng_from_json(state: list[Any]) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups without their parameter names.

    They are the same on every rank (one config, one schedule), while the names are this rank's
    own (a pipeline stage's), so rank 0's are saved and every rank puts them on its own names.
    """
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _restore_groups(path: Path, mine: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(mine) != len(saved):
        raise CheckpointError(f"'{path}' has {len(saved)} optimizer param group(s) but the engine has {len(mine)}; "
                              "resume with the optimizer settings it was written with")
    # JSON turns tuples (AdamW's betas) into lists.
    return [{**g, **{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}} for g, s in zip(mine, saved)]


def _engine_state(engine: "ArchonEngine", groups: list[dict[str, Any]], extra_state: dict[str, Any]) -> str:
    state = {
        "step": engine.step,
        "allocation": str(engine.allocation),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "optimizer_param_groups": _hyperparameters(groups),
        "python_rng": _python_rng_to_json(random.getstate()),
        "extra": extra_state,
    }
    try:
        return json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the state saved with {engine.name}'s checkpoint must be JSON data (numbers, "
                              f"strings, lists, dicts): {exc}") from None


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when ``ok`` holds on every rank (one collective, so no rank is left waiting)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_checkpoint(engine: "ArchonEngine", path: Path, extra_state: dict[str, Any]) -> None:
    """Every rank writes its DCP shards under ``path/dcp``; rank 0 the rest.

    A failure on any rank (disk full, unwritable folder) raises ``CheckpointWriteError`` on
    every rank.
    """
    state, groups = _states(engine)
    try:
        dcp.save(state, checkpoint_id=str(path / DCP_DIR))
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises on all of them
        raise CheckpointWriteError(f"writing {engine.name}'s shards to {path / DCP_DIR} failed: "
                                   f"{_first_failure(exc)}") from None
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            text = _engine_state(engine, groups, extra_state)
            rng = {"torch": torch.get_rng_state()}
            if engine.device_type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state()
            save_file(rng, str(path / RNG_STATE))
            (path / ENGINE_STATE).write_text(text)
        except (OSError, CheckpointError) as exc:
            error = exc
    if not all_ranks_ok(error is None):
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointWriteError(f"writing {engine.name}'s engine state to {path} failed"
                                   + (f": {error}" if error is not None else " on rank 0"))


def _first_failure(exc: CheckpointException) -> str:
    """The lowest failing rank's error, from DCP's gathered ``{rank: (exception, stack)}``."""
    failures = getattr(exc, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        first_line = (str(error).splitlines() or [""])[0][:300]
        return f"rank {rank}: {type(error).__name__}: {first_line}"
    return str(exc)


def load_checkpoint(engine: "ArchonEngine", path: Path) -> dict[str, Any]:
    """Load ``path`` (written by ``save_checkpoint``) into ``engine``; returns the caller's extra state.

    Raises ``CheckpointError`` for a folder that is not a checkpoint, is damaged, or does not
    match the engine; the same error on every rank.
    """
    meta_file = path / ENGINE_STATE
    if not meta_file.is_file() or not (path / DCP_DIR).is_dir():
        raise CheckpointError(f"'{path}' is not an Archon checkpoint (expected {ENGINE_STATE} and {DCP_DIR}/); "
                              "pass a folder written by ArchonEngine.save")
    try:
        meta = json.loads(meta_file.read_text())
        rng = load_file(str(path / RNG_STATE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"the engine state in '{path}' is damaged ({exc}); use an intact checkpoint") from None
    state, groups = _states(engine)
    if "optim" in state and not meta.get("optimizer_param_groups"):
        raise CheckpointError(f"'{path}' has no optimizer state for {engine.name}; it was saved from an "
                              "engine without an optimizer")
    try:
        dcp.load(state, storage_reader=_SafeFileSystemReader(str(path / DCP_DIR)), planner=_TensorOnlyLoadPlanner())
    except CheckpointException as exc:
        raise CheckpointError(f"reading the shards of '{path}' failed ({_first_failure(exc)}); the checkpoint "
                              "is damaged or was written for another model") from None
    set_model_state_dict(engine.model, state["model"], options=StateDictOptions(strict=True))
    if "optim" in state:
        optim = {"state": state["optim"]["state"],
                 "param_groups": _restore_groups(path, groups, meta["optimizer_param_groups"])}
        set_optimizer_state_dict(engine.model, engine.optimizer, optim)
    engine.step = meta["step"]
    if engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    torch.set_rng_state(rng["torch"])
    random.setstate(_python_rng_from_json(meta["python_rng"]))
    if engine.device_type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    return meta["extra"]
