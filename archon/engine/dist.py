"""Process-group setup shared by every engine of a run."""

from __future__ import annotations

import os
import signal
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_device_type(device: str = "auto") -> str:
    """'cuda' when asked or available (for 'auto'), else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device = 'cuda' but no CUDA device is visible; set device = 'cpu' or 'auto'")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_with_launcher() -> None:
    """Under torchrun: be killed as soon as the torchrun agent dies, however it dies (Linux).

    torchrun starts every worker in a session of its own, so when the agent is SIGKILLed (by a
    user, a scheduler or the OOM killer) nothing tells the workers: they would hold their
    memory and ports until the collective timeout (30 minutes).  The kernel's parent-death
    signal tells them; the rollout servers rank 0 started follow through their own.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before the request above: nobody would signal us
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(device_type: str, timeout_s: float = 1800.0) -> None:
    """Join the job's process group (torchrun env) or make a one-process group.

    A single process still gets a group so that every engine runs the same DTensor/DCP code
    paths whatever the allocation.
    """
    if dist.is_initialized():
        return
    exit_with_launcher()
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
