"""Trainer tensors handed to colocated vLLM servers by CUDA IPC: vLLM's ``ipc`` weight-transfer backend.

Written against vLLM 0.32's ``vllm/distributed/weight_transfer/ipc_engine.py`` (the worker side) and
``clients.py`` (the HTTP form).  Each trainer rank describes its copy of a bucket: per tensor
``{its GPU's UUID: the rebuild_cuda_tensor arguments of torch's reduce_tensor}``.  The parts of the ranks on
one server's GPUs merge into one dict per tensor; each vLLM worker picks the entry of its own GPU, rebuilds
the tensor on its device and loads it by HF name (its tensor-parallel shard of it).  Over HTTP the handles
travel pickled and base64-encoded (``ipc_handles_pickled``), which vLLM unpickles only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; the server also needs ``--weight-transfer-config
'{"backend": "ipc"}'`` (both set by the launcher).  The sender keeps its tensors alive until the server has
answered.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

IPC_INIT_INFO = {"packed": False}
"""``init_info`` of ``/init_weight_transfer_engine``: one handle per tensor (vLLM's unpacked form)."""


def share_cuda_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """This rank's part of a vLLM update: names, dtype names, shapes and ``{GPU UUID: IPC arguments}`` per tensor."""
    part: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
    for name, tensor in named_tensors:
        if not tensor.is_cuda:
            raise ValueError(
                f"'{name}' is on {tensor.device}: vLLM's IPC weight transfer maps CUDA memory only; set "
                "rollout.weight_sync = 'disk' for vLLM servers without a GPU"
            )
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        _, args = reduce_tensor(tensor.detach())
        part["names"].append(name)
        part["dtype_names"].append(str(tensor.dtype).removeprefix("torch."))
        part["shapes"].append(list(tensor.shape))
        part["ipc_handles"].append({uuid: args})
    return part


def vllm_update_info(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One server's ``/update_weights`` ``update_info`` from the parts of the ranks on its GPUs."""
    first = parts[0]
    for part in parts[1:]:
        if part["names"] != first["names"] or part["shapes"] != first["shapes"]:
            raise ValueError("trainer ranks shared different tensors for one vLLM server; every rank syncs alike")
    merged: list[dict[str, Any]] = [{} for _ in first["names"]]
    for part in parts:
        for handles, own in zip(merged, part["ipc_handles"]):
            handles.update(own)
    return {
        "names": first["names"],
        "dtype_names": first["dtype_names"],
        "shapes": first["shapes"],
        # A standard pickle stream (vLLM reads it with pickle.loads); no tensor travels in it, only handles.
        "ipc_handles_pickled": base64.b64encode(bytes(ForkingPickler.dumps(merged))).decode("ascii"),
    }
