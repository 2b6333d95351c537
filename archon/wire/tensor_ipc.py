"""Named tensors handed to a server on the same machine without copying them over HTTP
(SGLang's ``update_weights_from_tensor``).

The form is SGLang's ``MultiprocessingSerializer.serialize(named_tensors, output_str=True)``: a list of
``(name, tensor)`` pickled with ``multiprocessing``'s ``ForkingPickler``, whose torch reductions send
storage handles instead of bytes, then base64, so it travels in a JSON string.  A CUDA tensor travels
as a CUDA IPC handle (the receiver maps the sender's memory on the same GPU); a CPU tensor's storage
is moved into a named shared-memory file (in place, by torch's ``file_system`` sharing: the sender's
tensor keeps its values and stays shared for later calls; it needs room in ``/dev/shm``) and travels
as that name, which any process of the machine can open.  Torch's default CPU form, a file descriptor
fetched from the sender's ``multiprocessing`` resource sharer, only reaches the sender's own children
(it checks their shared authkey), so it is not used.  The sender must keep its tensors alive until
the receiver has answered.

Unpickling runs no code but torch's tensor and storage rebuilders: ``deserialize_named_tensors``
refuses any other global (SGLang restricts its unpickler the same way, CVE-2025-10164).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_storage_empty, rebuild_storage_filename, reduce_storage

_ALLOWED_GLOBALS = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_storage_fd",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
    },
    "torch": {"Tensor", "Size"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "multiprocessing.resource_sharer": {"DupFd"},
}


class _TensorUnpickler(pickle.Unpickler):
    """Loads only what ``ForkingPickler`` writes for tensors: torch's rebuilders, storages, dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor")


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """Torch's ``file_system`` reduction of a CPU storage, whatever the process's sharing strategy."""
    if storage.device.type != "cpu":
        return reduce_storage(storage)  # CUDA storages travel inside their tensors' IPC handles
    if storage.nbytes() == 0:
        return rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild decrements it: the file outlives the sender's unpickled copy
    return rebuild_storage_filename, (type(storage), manager, handle, size)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``named_tensors`` as one JSON-safe string for one receiver on this machine (see the module docstring)."""
    items = []
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"named_tensors must hold (str, torch.Tensor) pairs, got ({type(name).__name__}, ...)")
        items.append((name, tensor.detach()))
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name
    pickler.dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list of ``serialize_named_tensors``; ``ValueError`` for anything else."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(
            "a serialized_named_tensors entry is not base64; send what serialize_named_tensors makes."
        ) from None
    try:
        items = _TensorUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError) as e:
        raise ValueError(
            f"a serialized_named_tensors entry could not be loaded ({e}); send named tensors only."
        ) from None
    except (OSError, RuntimeError) as e:  # a handle that does not open here (another machine, a dead sender)
        raise ValueError(
            f"the tensors of a serialized_named_tensors entry could not be opened ({e}); the sender must be on the "
            "same machine and keep them alive until the call returns."
        ) from None
    if not isinstance(items, list) or not all(
        isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], torch.Tensor)
        for it in items
    ):
        raise ValueError("a serialized_named_tensors entry must hold a list of (name, tensor) pairs.")
    return items
