"""Deterministic training, as the Archon document lists it.

Call ``apply_determinism`` before the first kernel runs and before any NCCL communicator or
cuBLAS handle exists: the environment variables are read when those are created.
"""

from __future__ import annotations

import os

import torch


def apply_determinism(device_type: str = "cuda") -> dict[str, str]:
    """Deterministic algorithms (warn only), cuBLAS workspace, NCCL Ring, deterministic compile.

    Activation checkpointing must also preserve RNG state (``preserve_rng_state=True``); the
    parallelize functions do that when ``use_deterministic_algorithms`` is set.  Returns the
    environment variables it set.
    """
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "TORCH_COMPILE_DETERMINISTIC": "1"}
    os.environ.update(env)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device_type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return env
