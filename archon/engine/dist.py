"""Process-group setup shared by every engine of a run."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from archon.config import ConfigError


def resolve_device_type(device: str = "auto") -> str:
    """'cuda' when asked or available (for 'auto'), else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but no CUDA device is visible; set device = 'cpu' or 'auto'")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str, timeout_s: float = 1800.0) -> None:
    """Join the job's process group (torchrun env) or make a one-process group.

    A single process still gets a group so that every engine runs the same DTensor/DCP code
    paths whatever the allocation.
    """
    if dist.is_initialized():
        return
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=timeout)


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave the process group; skip the barrier after a failure (the other ranks may be gone)."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
