"""How a process shares its tensors with a rollout server on the same machine, in the form the server takes.

``ServerAPI.tensor_share_format`` names the form: SGLang's (and the built-in server's) serialized named tensors
(``archon.wire.tensor_ipc``), or vLLM's per-GPU CUDA IPC handles (``archon.wire.vllm_ipc``).  Each function
makes one process's part of an ``update_weights_from_tensor`` call from ``(name, tensor)`` pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from archon.wire.tensor_ipc import serialize_named_tensors
from archon.wire.vllm_ipc import share_cuda_tensors

SHARE_TENSORS: dict[str, Callable[[Sequence[tuple[str, torch.Tensor]]], Any]] = {
    "sglang": serialize_named_tensors,
    "vllm_ipc": share_cuda_tensors,
}
"""Tensor-sharing function of each ``ServerAPI.tensor_share_format``."""
