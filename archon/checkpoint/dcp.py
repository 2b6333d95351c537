"""One engine's resumable state with torch.distributed.checkpoint (DCP), read without running code.

The checkpoint code works on a dict of ``Stateful`` parts (``archon.checkpoint.state``: the
model, the optimizer, the LR scheduler and the train state), never on the engine itself.
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
``archon.checkpoint.manager``.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from archon.checkpoint.state import LR_SCHEDULER, MODEL, OPTIMIZER, TRAIN_STATE
from archon.errors import ArchonError, JobError

ENGINE_STATE = "engine_state.json"
RNG_STATE = "rng_state.safetensors"
DCP_DIR = "dcp"


class CheckpointError(ArchonError, ValueError):
    """An Archon checkpoint folder is missing, damaged, or does not match the engine.

    (A Hugging Face model folder that cannot be read is ``models.HFCheckpointError``.)
    """


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
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
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


class _SafeFileSystemReader(dcp.FileSystemReader):  # pyright: ignore[reportPrivateImportUsage]
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
        raise CheckpointError(
            f"the checkpoint stores '{read_item.dest_index.fqn}' as a pickled object, but Archon "
            "checkpoints hold tensors only; it was not written by Archon and is not loaded"
        )


# ---------------------------------------------------------------------------- state


def _split(states: Mapping[str, Stateful]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tensors DCP saves and loads (the model's, the optimizer's per-parameter state), and the
    optimizer's param groups without their parameter names.

    The param groups are the same on every rank (one config, one schedule), while the names are
    this rank's own (a pipeline stage's), so rank 0's are saved and every rank puts them on its
    own names.
    """
    tensors: dict[str, Any] = {"model": states[MODEL].state_dict()}
    groups: list[dict[str, Any]] = []
    if OPTIMIZER in states:
        optim = states[OPTIMIZER].state_dict()
        tensors["optim"] = {"state": optim["state"]}
        groups = [_json_numbers({k: v for k, v in g.items() if k != "params"}) for g in optim["param_groups"]]
    return tensors, groups


def _json_numbers(obj: Any) -> Any:
    """``obj`` with one-value tensors as numbers: torchao's low-bit AdamW keeps its learning rate as a tensor, and
    the LR scheduler's state copies it (the optimizer gets tensors back on load: ``OptimizerState``)."""
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, dict):
        return {k: _json_numbers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_json_numbers(v) for v in obj)
    return obj


def dcp_state_dict(states: Mapping[str, Stateful]) -> dict[str, Any]:
    """What ``states`` keep in DCP: ``{"model": ..., "optim": {"state": ...}}`` (tensors only)."""
    return _split(states)[0]


def _engine_state(
    states: Mapping[str, Stateful],
    groups: list[dict[str, Any]],
    extra_state: dict[str, Any],
    name: str,
    allocation: str,
) -> tuple[str, dict[str, torch.Tensor]]:
    """``engine_state.json``'s text and ``rng_state.safetensors``'s tensors."""
    train = states[TRAIN_STATE].state_dict()
    rng = {"torch": train["torch_rng"]}
    if train.get("cuda_rng") is not None:
        rng["cuda"] = train["cuda_rng"]
    state = {
        "step": train["step"],
        "allocation": allocation,
        "lr_scheduler": _json_numbers(states[LR_SCHEDULER].state_dict()) if LR_SCHEDULER in states else None,
        "optimizer_param_groups": groups,
        "python_rng": train["python_rng"],
        "extra": extra_state,
    }
    try:
        return json.dumps(state, allow_nan=False), rng
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the state saved with {name}'s checkpoint must be JSON data (numbers, strings, lists, dicts): {exc}"
        ) from None


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when ``ok`` holds on every rank (one collective, so no rank is left waiting)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_checkpoint(
    states: Mapping[str, Stateful],
    path: Path,
    extra_state: dict[str, Any],
    *,
    name: str = "the engine",
    allocation: str = "",
) -> None:
    """Every rank writes its DCP shards of ``states`` under ``path/dcp``; rank 0 the rest.

    ``name`` (the engine's, for messages) and ``allocation`` (recorded for whoever reads the
    folder; resuming under another allocation reshards) describe the owner.  A failure on
    any rank (disk full, unwritable folder) raises ``CheckpointWriteError`` on every rank.
    """
    tensors, groups = _split(states)
    try:
        dcp.save(tensors, checkpoint_id=str(path / DCP_DIR))  # pyright: ignore[reportPrivateImportUsage]
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises on all of them
        raise CheckpointWriteError(
            f"writing {name}'s shards to {path / DCP_DIR} failed: {_first_failure(exc)}"
        ) from None
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            text, rng = _engine_state(states, groups, extra_state, name, allocation)
            save_file(rng, str(path / RNG_STATE))
            (path / ENGINE_STATE).write_text(text)
        except (OSError, CheckpointError) as exc:
            error = exc
    if not all_ranks_ok(error is None):
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointWriteError(
            f"writing {name}'s engine state to {path} failed" + (f": {error}" if error is not None else " on rank 0")
        )


def _first_failure(exc: CheckpointException) -> str:
    """The lowest failing rank's error, from DCP's gathered ``{rank: (exception, stack)}``."""
    failures = getattr(exc, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        first_line = (str(error).splitlines() or [""])[0][:300]
        return f"rank {rank}: {type(error).__name__}: {first_line}"
    return str(exc)


def load_checkpoint(states: Mapping[str, Stateful], path: Path, *, name: str = "the engine") -> dict[str, Any]:
    """Load ``path`` (written by ``save_checkpoint``) into ``states``; returns the caller's extra state.

    Raises ``CheckpointError`` for a folder that is not a checkpoint, is damaged, or does not
    match the states; the same error on every rank.
    """
    meta_file = path / ENGINE_STATE
    if not meta_file.is_file() or not (path / DCP_DIR).is_dir():
        raise CheckpointError(
            f"'{path}' is not an Archon checkpoint (expected {ENGINE_STATE} and {DCP_DIR}/); "
            "pass a folder written by ArchonEngine.save"
        )
    try:
        meta = json.loads(meta_file.read_text())
        rng = load_file(str(path / RNG_STATE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"the engine state in '{path}' is damaged ({exc}); use an intact checkpoint") from None
    if OPTIMIZER in states and not meta.get("optimizer_param_groups"):
        raise CheckpointError(
            f"'{path}' has no optimizer state for {name}; it was saved from an engine without an optimizer"
        )
    tensors, _ = _split(states)
    try:
        dcp.load(tensors, storage_reader=_SafeFileSystemReader(str(path / DCP_DIR)), planner=_TensorOnlyLoadPlanner())  # pyright: ignore[reportPrivateImportUsage]
    except CheckpointException as exc:
        raise CheckpointError(
            f"reading the shards of '{path}' failed ({_first_failure(exc)}); the checkpoint "
            "is damaged or was written for another model"
        ) from None
    states[MODEL].load_state_dict(tensors["model"])
    if OPTIMIZER in states:
        try:
            states[OPTIMIZER].load_state_dict(
                {"state": tensors["optim"]["state"], "param_groups": meta["optimizer_param_groups"]}
            )
        except ValueError as exc:
            raise CheckpointError(f"'{path}' does not fit {name}: {exc}") from None
    if LR_SCHEDULER in states and meta["lr_scheduler"] is not None:
        states[LR_SCHEDULER].load_state_dict(meta["lr_scheduler"])
    states[TRAIN_STATE].load_state_dict(
        {"step": meta["step"], "python_rng": meta["python_rng"], "torch_rng": rng["torch"], "cuda_rng": rng.get("cuda")}
    )
    return meta["extra"]
