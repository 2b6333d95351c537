"""CPU runs: every device slot of the cluster plan gets a share of the node's cores of its own.

On a CPU node ``cluster.n_gpus_per_node`` counts processes, and the cluster plan gives every
training rank and every built-in rollout server one slot ``g`` of those ``n``.  With
``cluster.pin_cpu_cores`` each process is pinned (``sched_setaffinity``) to the ``g``-th of ``n``
contiguous, near-equal shares of the cores it was allowed at start (a Slurm or cgroup cpuset is
honoured), as a GPU process is given its own device; its torch thread pool is cut to its share.

Why: unpinned, the kernel moves the trainer's and the server's threads across all cores, so in
asynchronous RL, where both run at once, each keeps losing its caches and its core to the
other.  On the 2-core machine of the digits demo (3 runs of each, alternating), pinning took
the asynchronous step (k = 1) from 0.173 s to 0.148 s on average and the synchronous one from
0.222 s to 0.214 s.
With fewer cores than slots nothing is pinned and a warning says so.

The trainer's ranks (``archon.cli``), the launcher (``archon.launch.servers``) and the built-in
server (``--cpu-cores``) all use it, so it sits in ``archon.runtime`` and imports only torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger("archon.runtime")

_START_CORES: tuple[int, ...] | None = None


def start_cores() -> tuple[int, ...]:
    """The cores this process may use, as they were before it pinned itself (cached at first call)."""
    global _START_CORES
    if _START_CORES is None:
        _START_CORES = tuple(sorted(os.sched_getaffinity(0)))
    return _START_CORES


def slot_cores(slot: int, n_slots: int, cores: Sequence[int]) -> tuple[int, ...] | None:
    """The share of ``cores`` that slot ``slot`` of ``n_slots`` gets; None when there are fewer cores than slots.

    Shares are contiguous and differ in size by one core at most (the first slots get the extra cores).
    """
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} is outside the node's {n_slots} slots")
    if len(cores) < n_slots:
        return None
    base, extra = divmod(len(cores), n_slots)
    start = slot * base + min(slot, extra)
    return tuple(cores[start : start + base + (1 if slot < extra else 0)])


def share_of_slots(slots: Sequence[int], n_slots: int, who: str) -> tuple[int, ...] | None:
    """The cores of ``slots`` (of the node's ``n_slots``) from this process's start cores; None, with
    a warning naming ``who``, when the node has fewer allowed cores than slots."""
    shares = [slot_cores(s, n_slots, start_cores()) for s in slots]
    if any(share is None for share in shares):
        logger.warning(
            "cluster.pin_cpu_cores: %s is not pinned, because this node's %d allowed cores cannot give each "
            "of its %d processes (cluster.n_gpus_per_node) one of its own",
            who,
            len(start_cores()),
            n_slots,
        )
        return None
    return tuple(c for share in shares for c in share or ())


def pin_to_slot(slot: int, n_slots: int, who: str) -> tuple[int, ...] | None:
    """Pin this process (the calling thread and the threads it starts later) to its slot's cores.

    Call it before starting threads: threads that exist already keep their affinity.  ``who``
    names the process in the log.  Returns the cores, or None when nothing was pinned.
    """
    cores = share_of_slots([slot], n_slots, who)
    return None if cores is None else pin_process(cores, who)


def pin_process(cores: Sequence[int], who: str) -> tuple[int, ...]:
    """Run this process (the calling thread and the threads it starts later) on ``cores`` only,
    with at most that many torch threads; returns the cores.  ``who`` names it in the log."""
    cores = tuple(cores)
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:
        raise ValueError(
            f"cannot pin to CPU cores {','.join(map(str, cores))}: {exc.strerror}; name cores this process may use "
            f"({','.join(map(str, start_cores()))})"
        ) from None
    if torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))
    logger.info("%s pinned to CPU cores %s", who, ",".join(map(str, cores)))
    return cores


def parse_core_list(text: str) -> tuple[int, ...]:
    """'0,2,3' -> (0, 2, 3): the ``--cpu-cores`` of the built-in server."""
    try:
        cores = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--cpu-cores '{text}' must be comma-separated core numbers, e.g. 0,1") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"--cpu-cores '{text}' must name at least one core, each 0 or more")
    return cores
