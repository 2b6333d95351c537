"""Process-group setup shared by every engine of a run, and which GPU a training rank uses.

The GPU rule (one for every launcher).  The cluster plan (``archon.plan``) gives training rank
``RANK`` a node-local GPU id ``g``.  The process then uses:

1. ``cuda:g`` when ``CUDA_VISIBLE_DEVICES`` is unset: every GPU of the node is visible, so ids
   and indices agree (plain torchrun on one node: servers on GPUs ``0..R-1``, rank ``r`` on
   ``R + r``, nothing to set by hand);
2. the position of ``g`` in ``CUDA_VISIBLE_DEVICES`` when a launcher exported a list of
   node-local ids that includes it (e.g. a Slurm step that shows each node its training GPUs);
3. the one visible GPU when the launcher bound the process to a single GPU that the list
   names differently (Ray gives each bundle its own GPU);
4. entry ``g`` of a longer list that does not name ``g``: the job's GPUs renumbered from 0 (a
   container or a job holding part of a node, ``CUDA_VISIBLE_DEVICES=4,5,6,7``), as the rollout
   servers' GPUs are mapped (``archon.launch.servers.visible_devices``);
5. otherwise an error that names the rank, ``g`` and the list.

Without a plan (an engine used on its own under torchrun) the rank uses visible device
``LOCAL_RANK``, as torchrun expects.  ``LOCAL_RANK``, when set, must be the rank's position
among its node's training ranks in the plan: a launcher that put ranks on nodes differently
from the plan is refused, because the plan's GPUs would then collide.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from archon.config import ConfigError
from archon.errors import ArchonError

if TYPE_CHECKING:
    from archon.placement import ClusterPlan


logger = logging.getLogger("archon.engine")


class DeviceSelectionError(ArchonError, RuntimeError):
    """This training process cannot tell which GPU is its own; the message says why and how to fix it."""


def resolve_device_type(device: str = "auto") -> str:
    """'cuda' when asked or available (for 'auto'), else 'cpu'."""
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        warn_unusable_gpus()
        return "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but no CUDA device is visible; set device = 'cpu' or 'auto'")
    return device


def nvidia_smi_gpus() -> list[str]:
    """``name, driver version`` of every GPU ``nvidia-smi`` lists (empty without nvidia-smi or GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def warn_unusable_gpus() -> None:
    """Say loudly that ``device = 'auto'`` falls back to the CPU on a machine whose GPUs this torch cannot use."""
    gpus = nvidia_smi_gpus()
    if not gpus:
        return
    cuda = torch.version.cuda
    why = (
        f"this torch {torch.__version__} is a CPU build"
        if cuda is None
        else f"this torch {torch.__version__} was built for CUDA {cuda}, which needs a newer driver than the GPUs' "
        f"({gpus[0].rsplit(',', 1)[-1].strip()}), or the GPUs are not visible to this process"
    )
    logger.warning(
        "device = 'auto' runs on the CPU although nvidia-smi lists %d GPU(s) (%s): %s; install a torch built for this "
        "driver (https://pytorch.org/get-started/locally/, `make install TORCH_SPEC=...`), or set device = 'cpu' to "
        "run on the CPU on purpose",
        len(gpus),
        gpus[0],
        why,
    )


def plan_gpu(plan: ClusterPlan, env: Mapping[str, str] = os.environ) -> int:
    """The node-local GPU id ``plan`` gives this process's training rank (``RANK``), checked against ``LOCAL_RANK``."""
    rank = int(env.get("RANK", "0"))
    proc = plan.rank(rank)
    local = env.get("LOCAL_RANK")
    if local is not None and int(local) != proc.local_index:
        raise DeviceSelectionError(
            f"training rank {rank} was started as local rank {local}, but the cluster plan puts it on node "
            f"{proc.node} as local rank {proc.local_index} (GPU {proc.gpus[0]}); start "
            f"{len(plan.train_gpus(proc.node))} training processes on that node as `python -m archon.plan` shows, "
            "or fix cluster.n_nodes / cluster.n_gpus_per_node"
        )
    return proc.gpus[0]


def cuda_device_index(gpu: int | None, env: Mapping[str, str] = os.environ) -> int:
    """The CUDA device index this process uses for plan GPU ``gpu`` (None: no plan), by the rule above."""
    visible_env = env.get("CUDA_VISIBLE_DEVICES")
    if gpu is None:
        index = int(env.get("LOCAL_RANK", "0"))
        where = f"LOCAL_RANK={index}"
    elif visible_env is None:
        index, where = gpu, f"the plan's GPU {gpu}"
    else:
        visible = [v.strip() for v in visible_env.split(",") if v.strip()]
        if str(gpu) in visible:
            index = visible.index(str(gpu))
        elif len(visible) == 1:
            index = 0
        elif gpu < len(visible):
            index = gpu
        else:
            raise DeviceSelectionError(
                f"the cluster plan gives this training rank (RANK={env.get('RANK', '0')}) GPU {gpu} of its node, "
                f"but CUDA_VISIBLE_DEVICES={visible_env!r} does not list it; export the node's GPU ids as the plan "
                "gives them (or one GPU per process), or leave CUDA_VISIBLE_DEVICES unset"
            )
        where = f"the plan's GPU {gpu} (CUDA_VISIBLE_DEVICES={visible_env!r})"
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceSelectionError(
            f"this training process should use CUDA device {index} ({where}), but only "
            f"{count} are visible; set cluster.n_gpus_per_node to the node's GPU count and "
            "check the launcher's CUDA_VISIBLE_DEVICES"
        )
    return index


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


def init_distributed(device_type: str, timeout_s: float = 1800.0, plan: ClusterPlan | None = None) -> None:
    """Select this rank's GPU (``plan``: see the module docstring) and join the job's process group.

    Joins torchrun's group (env) or makes a one-process group: a single process still gets a
    group so that every engine runs the same DTensor/DCP code paths whatever the allocation.
    """
    if dist.is_initialized():
        return
    exit_with_launcher()
    if device_type == "cuda":
        torch.cuda.set_device(cuda_device_index(plan_gpu(plan) if plan is not None else None))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # An in-process store: a picked TCP port could be taken by another process before we bind it.
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def current_device(device_type: str) -> torch.device:
    """The device this process computes on (the GPU ``init_distributed`` selected, or the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave the process group; skip the barrier after a failure (the other ranks may be gone)."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
