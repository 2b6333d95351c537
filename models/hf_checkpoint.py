"""Streaming Hugging Face safetensors I/O, DTensor-aware.

Reading opens one shard at a time and reads one tensor at a time (``safe_open``); only the
shards holding tensors this model (or pipeline stage) owns are opened.  A DTensor parameter
gets its local shard from the full tensor every rank reads (``distribute_tensor`` with
``src_data_rank=None``: no communication).  Writing streams ``(name, tensor)`` pairs into
size-limited shards plus ``model.safetensors.index.json`` and ``config.json``.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from models.registry import spec_for_model
from models.state_dict_adapter import BaseStateDictAdapter, HFKeyTarget, UnknownKeyError
from parallel.fqn import clean_fqn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    """A Hugging Face model folder (config.json, safetensors) is missing, damaged, or does not match the model.

    Archon's own resumable checkpoints have their own error, ``archon.checkpoint.dcp.CheckpointError``.
    """


# ---- reading ---------------------------------------------------------------------------


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model folder, as a dict."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFCheckpointError(f"{folder} is not a directory; pass the folder of a Hugging Face model.")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise HFCheckpointError(
            f"{path} does not exist; a Hugging Face model folder needs config.json next to its safetensors."
        )
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} is not valid JSON ({e}).") from None


def open_safetensors(path: Path) -> Any:
    """``safe_open(path)``; a truncated or corrupt file is a ``HFCheckpointError`` naming it."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise HFCheckpointError(
            f"{path} is not a readable safetensors file ({e}); it is probably truncated or "
            "corrupt, so copy or export it again."
        ) from None


def checkpoint_key_files(folder: str | os.PathLike) -> dict[str, str]:
    """Map every tensor key of the checkpoint in ``folder`` to the safetensors file holding it.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else
    every ``*.safetensors`` file in the folder.
    """
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFCheckpointError(f"{index_path} is not a safetensors index (needs a weight_map): {e}") from None
        for fname in sorted(set(weight_map.values())):
            if not (folder / fname).is_file():
                raise HFCheckpointError(f"{index_path} lists shard {fname}, which is missing from {folder}.")
        return dict(weight_map)
    files = [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        hint = ""
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            hint = (
                "; it has PyTorch .bin/.pt weights, which Archon never unpickles, so convert them to safetensors "
                "first (transformers: save_pretrained(..., safe_serialization=True))"
            )
        raise HFCheckpointError(f"{folder} has no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file{hint}.")
    key_files: dict[str, str] = {}
    for fname in files:
        with open_safetensors(folder / fname) as f:
            for key in f.keys():
                if key in key_files:
                    raise HFCheckpointError(f"tensor {key!r} appears in both {key_files[key]} and {fname} in {folder}.")
                key_files[key] = fname
    return key_files


@dataclass
class HFLoadResult:
    """What ``load_hf_weights`` did not fill or did not use."""

    missing: list[str] = field(default_factory=list)
    """Model tensors left unfilled (only non-empty with ``strict=False``)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys the model has no place for (only non-empty with ``strict=False``)."""
    initialised: list[str] = field(default_factory=list)
    """Model tensors the adapter allows to keep their initial value (a critic's value head)."""


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones under every name) and persistent buffers, by wrapper-free name."""
    tensors: dict[str, torch.Tensor] = {clean_fqn(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for buf_name, buf in mod.named_buffers(prefix=mod_name, recurse=False):
            if buf is not None and buf_name.rsplit(".", 1)[-1] not in mod._non_persistent_buffers_set:
                tensors[clean_fqn(buf_name)] = buf
    return tensors


def _full_model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Global shapes of every tensor of the *whole* model (before pipeline splitting).

    A pipeline stage has only some layers; building the full model on the meta device tells
    "belongs to another stage" (skip) apart from "not part of this architecture" (error).
    """
    shapes = {name: t.shape for name, t in _model_tensors(model).items()}
    args = getattr(model, "args", None)
    if args is None:
        return shapes
    try:
        with torch.device("meta"):
            full = type(model)(args)
    except Exception:  # a model class that cannot be rebuilt from args: trust the model as is
        return shapes
    full_shapes = {name: t.shape for name, t in _model_tensors(full).items()}
    full_shapes.update(shapes)
    return full_shapes


def _expected_hf_keys(adapter: BaseStateDictAdapter, name: str, shape: torch.Size) -> list[str]:
    try:
        return [k for k, _ in adapter.to_hf_tensors(name, torch.empty(shape, device="meta"))]
    except (UnknownKeyError, NotImplementedError):
        return []


@torch.no_grad()
def _copy_full(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the global tensor ``full`` into ``dst`` (a plain tensor or a DTensor's local shard)."""
    if _is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        local = dst.to_local()
        full = full.to(device=local.device, dtype=local.dtype)
        # Every rank holds the full tensor, so no rank needs to send anything.
        dst.copy_(distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None))
    else:
        dst.copy_(full)


@torch.no_grad()
def _copy_local(dst: DTensor, local: torch.Tensor) -> None:
    """Copy this rank's slice into a DTensor's local shard."""
    dst.to_local().copy_(local)


def _local_box(dst: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(local_shape, global_offset)`` of a DTensor's shard, when it is one rectangular slice.

    Plain ``Shard``/``Replicate`` placements give one box per rank, so the rank can read just
    that slice from the checkpoint; so do strided shards (FSDP over a dim TP or EP already
    split) whose indices form one range.  Other placements (partial) return None and go
    through ``distribute_tensor`` on the full tensor instead.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if any(type(p) is _StridedShard for p in dst.placements):
        return _strided_local_box(dst)
    if not all(type(p) in (Shard, Replicate) for p in dst.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
    return tuple(local_shape), tuple(offset)


def _strided_local_box(dst: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``_local_box`` for FSDP over an already sharded dim (experts under EP, FSDP x TP).

    Such a dim carries a ``_StridedShard``; which of its indices this rank holds is found by
    distributing an index vector with the same placements (local chunking, no
    communication).  None unless every dim's indices form one range.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    local_shape, offset = [], []
    device = dst.to_local().device
    for d, size in enumerate(dst.shape):
        on_d = []
        for p in dst.placements:
            if type(p) not in (Shard, Replicate, _StridedShard):
                return None
            if type(p) is Replicate or cast("Shard | _StridedShard", p).dim != d:
                on_d.append(Replicate())
            elif type(p) is Shard:
                on_d.append(Shard(0))
            else:
                on_d.append(_StridedShard(0, split_factor=cast(_StridedShard, p).split_factor))
        index = distribute_tensor(
            torch.arange(size, device=device), dst.device_mesh, on_d, src_data_rank=None
        ).to_local()
        start = int(index[0]) if index.numel() else 0
        if not torch.equal(index, torch.arange(start, start + index.numel(), device=device)):
            return None
        local_shape.append(index.numel())
        offset.append(start)
    if tuple(local_shape) != tuple(dst.to_local().shape):
        return None
    return tuple(local_shape), tuple(offset)


def _target_shape(hf_shape: tuple[int, ...], t: HFKeyTarget) -> tuple[int, ...]:
    shape = list(hf_shape)
    if t.narrow is not None:
        dim, _, length = t.narrow
        shape[dim] = length
    return tuple(shape)


def _source_index(t: HFKeyTarget, local_shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices of the HF tensor that hold the box ``(local_shape, offset)`` of target ``t``."""
    index = []
    for d, (n, o) in enumerate(zip(local_shape, offset)):
        start = o + (t.narrow[1] if t.narrow is not None and t.narrow[0] == d else 0)
        index.append(slice(start, start + n))
    return tuple(index)


class _TensorReader:
    """One checkpoint tensor: its shape without reading it, then the whole of it or slices."""

    def __init__(self, f: Any, key: str, path: Path) -> None:
        self._f, self._key = f, key
        try:
            self._slice = f.get_slice(key)
        except Exception as e:  # the index lists a key the shard does not hold
            raise HFCheckpointError(f"cannot read tensor {key!r} from {path}: {e}") from None
        self.shape = tuple(self._slice.get_shape())
        self._full: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        full = self._full
        if full is None:
            full = self._full = self._f.get_tensor(self._key)
        return full

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        if self._full is not None:
            return self._full[index]
        return self._slice[index]


def adapter_for(model: nn.Module) -> BaseStateDictAdapter:
    """The state-dict adapter of the registered spec that built ``model``."""
    if not hasattr(model, "args"):
        raise HFCheckpointError(f"{type(model).__name__} has no .args; pass a state-dict adapter explicitly.")
    return spec_for_model(model).state_dict_adapter_class(model.args)


def load_hf_weights(
    model: nn.Module, folder: str | os.PathLike, adapter: BaseStateDictAdapter | None = None, strict: bool = True
) -> HFLoadResult:
    """Fill ``model``'s parameters from the Hugging Face safetensors checkpoint in ``folder``.

    Tensors are read one at a time and only from the shards that hold tensors this model
    owns; tensors of layers a pipeline stage does not hold are skipped.  DTensor parameters
    receive their local shard.  Per-expert HF tensors fill one slice of a grouped expert
    tensor.  With ``strict`` (default), a checkpoint tensor the model has no place for, a
    model tensor the checkpoint lacks, or a shape mismatch raises ``HFCheckpointError`` naming
    the tensor and file.  The model must already be materialised (``to_empty``), not on meta.
    """
    folder = Path(folder)
    adapter = adapter if adapter is not None else adapter_for(model)
    key_files = checkpoint_key_files(folder)
    targets = _model_tensors(model)
    full_shapes = _full_model_shapes(model)
    on_meta = [n for n, t in targets.items() if t.device.type == "meta"]
    if on_meta:
        raise HFCheckpointError(
            f"model tensor {on_meta[0]!r} is on the meta device; materialise the model "
            "(model.to_empty(device=...)) before loading weights."
        )

    # 1. Plan from key names alone: which tensors to read and where they go.
    plan: dict[str, list[tuple[str, list[HFKeyTarget]]]] = defaultdict(list)
    unexpected: list[str] = []
    for key in sorted(key_files):
        fname = key_files[key]
        try:
            key_targets = adapter.hf_key_targets(key)
        except UnknownKeyError:
            unexpected.append(f"{key!r} (in {fname})")
            continue
        keep = []
        for t in key_targets:
            shape = full_shapes.get(t.name)
            if shape is None or (t.expert is not None and not 0 <= t.expert < shape[0]):
                where = f"{t.name}[{t.expert}]" if t.expert is not None else t.name
                unexpected.append(f"{key!r} (in {fname}; maps to {where!r}, which the model does not have)")
            elif t.name in targets:  # else: held by another pipeline stage
                keep.append(t)
        if keep:
            plan[fname].append((key, keep))
    if unexpected and strict:
        raise HFCheckpointError(
            f"checkpoint {folder} has {len(unexpected)} tensor(s) {type(model).__name__} does not use: "
            + ", ".join(unexpected[:10])
            + (" ..." if len(unexpected) > 10 else "")
            + "; use the config.json that came with these weights, or weights made for this architecture."
        )

    # 2. Read shard by shard, tensor by tensor (only the local slice for sharded targets).
    filled: set[int] = set()  # id() of tensors filled whole (tied parameters share one)
    experts_filled: dict[str, set[int]] = defaultdict(set)
    expert_buffers: dict[str, torch.Tensor] = {}  # full tensors being assembled for DTensor targets
    for fname in sorted(plan):
        with open_safetensors(folder / fname) as f:
            for key, key_targets in plan[fname]:
                reader = _TensorReader(f, key, folder / fname)
                for t in key_targets:
                    dst = targets[t.name]
                    want = full_shapes[t.name] if t.expert is None else full_shapes[t.name][1:]
                    got = _target_shape(reader.shape, t)
                    if got != tuple(want):
                        raise HFCheckpointError(
                            f"checkpoint tensor {key!r} (in {folder / fname}) has shape {got}, "
                            f"but model tensor {t.name!r}{'' if t.expert is None else f' expert {t.expert}'} "
                            f"expects {tuple(want)}; the checkpoint does not match config.json, so use the "
                            "config.json that came with these weights."
                        )
                    box = _local_box(dst) if _is_dtensor(dst) else None
                    if t.expert is None:
                        if box is not None:
                            # (a box is only found for a DTensor)
                            _copy_local(cast("DTensor", dst), reader.read(_source_index(t, *box)))
                        else:
                            _copy_full(dst, t.take(reader.full()))
                        filled.add(id(dst))
                        continue
                    experts_filled[t.name].add(t.expert)
                    if box is not None:
                        local_shape, offset = box
                        if offset[0] <= t.expert < offset[0] + local_shape[0]:  # else another rank's expert
                            index = _source_index(t, local_shape[1:], offset[1:])
                            with torch.no_grad():
                                cast("DTensor", dst).to_local()[t.expert - offset[0]].copy_(reader.read(index))
                    elif _is_dtensor(dst):
                        buf = expert_buffers.get(t.name)
                        if buf is None:
                            buf = expert_buffers[t.name] = torch.empty(full_shapes[t.name], dtype=dst.dtype)
                        buf[t.expert].copy_(t.take(reader.full()))
                        if len(experts_filled[t.name]) == full_shapes[t.name][0]:
                            _copy_full(dst, expert_buffers.pop(t.name))
                    else:
                        with torch.no_grad():
                            dst[t.expert].copy_(t.take(reader.full()))
                del reader

    # 3. Every model tensor must have been filled.
    result = HFLoadResult(unexpected=unexpected)
    for name, tensor in targets.items():
        if id(tensor) in filled:
            continue
        n_experts = full_shapes[name][0] if tensor.dim() > 0 else 0
        if name in experts_filled and len(experts_filled[name]) == n_experts:
            filled.add(id(tensor))
            continue
        if adapter.is_optional(name):
            result.initialised.append(name)
            continue
        if name in experts_filled:
            absent = sorted(set(range(n_experts)) - experts_filled[name])
            result.missing.append(f"{name!r} (experts {absent[:8]}{' ...' if len(absent) > 8 else ''} absent)")
        else:
            keys = _expected_hf_keys(adapter, name, full_shapes[name])
            hint = f" (checkpoint key {keys[0]!r}{' ...' if len(keys) > 1 else ''})" if keys else ""
            result.missing.append(f"{name!r}{hint}")
    if result.missing and strict:
        raise HFCheckpointError(
            f"checkpoint {folder} lacks {len(result.missing)} tensor(s) {type(model).__name__} needs: "
            + ", ".join(result.missing[:10])
            + (" ..." if len(result.missing) > 10 else "")
            + "; check that the checkpoint is complete and matches its config.json."
        )
    return result


# ---- writing ---------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"500MB"``, ``"20KiB"``."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot read shard size {size!r}; use bytes or a string like '5GB' or '500MB'.")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _remove_old_weights(folder: Path) -> None:
    # A stale index or shard from an earlier save would shadow or pollute the new one.
    for p in list(folder.glob("model*.safetensors")) + [folder / INDEX_FILE]:
        if p.is_file():
            p.unlink()


def save_hf_tensors(
    named_hf_tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config_dict: dict[str, Any],
    folder: str | os.PathLike,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write ``(hf_name, tensor)`` pairs as sharded safetensors + index + ``config.json``.

    Streams: at most one shard's tensors are held in memory.  A single shard is written as
    ``model.safetensors`` without an index, as transformers does.  DTensors are gathered
    with ``full_tensor()`` (every rank must then iterate the same tensors).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(folder)
    limit = parse_size(max_shard_size)

    partial_files: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    total_bytes = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = folder / f"model-{len(partial_files) + 1:05d}.safetensors.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        partial_files.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in named_hf_tensors:
        if name in seen:
            raise HFCheckpointError(f"tensor {name!r} was given twice while saving to {folder}.")
        seen.add(name)
        if _is_dtensor(tensor):
            tensor = tensor.full_tensor()
        # A private contiguous CPU copy: safetensors refuses views that share storage.
        tensor = tensor.detach().to("cpu").contiguous().clone()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > limit:
            flush()
        shard[name] = tensor
        shard_bytes += nbytes
        total_bytes += nbytes
    flush()

    if len(partial_files) == 1:
        partial_files[0][0].rename(folder / SINGLE_FILE)
    elif partial_files:
        n = len(partial_files)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(partial_files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(folder / final)
            weight_map.update({k: final for k in names})
        with open(folder / INDEX_FILE, "w") as f:
            json.dump(
                {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
            )
    with open(folder / CONFIG_NAME, "w") as f:
        json.dump(hf_config_dict, f, indent=2, sort_keys=True)
