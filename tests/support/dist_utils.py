"""Multi-process test helpers: forked gloo ranks, free ports, waiting for a state, process checks.

``run_distributed`` runs a worker function on N forked ranks through the library's harness
(``archon.runtime.fork_ranks``, which ``python -m archon.plan rehearse`` uses too) and reports a
failing rank with its whole traceback, which is what a failing test should show.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any

import archon.engine  # noqa: F401  (loaded before forking, so no rank pays for it)
from archon.runtime.fork_ranks import RankError, run_ranks


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedTestError(RankError):
    """A rank raised, died, or did not finish in time."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    threads: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked gloo ranks; return per-rank results.

    ``fn`` reads its rank from ``torch.distributed.get_rank()``.  Results must pickle.
    ``threads`` defaults to one intra-op thread per rank (see ``run_ranks``).
    Raises DistributedTestError with the failing rank's traceback.
    """

    try:
        return run_ranks(
            fn,
            world_size,
            args,
            kwargs,
            timeout_s=timeout,
            backend=backend,
            threads=1 if threads is None else threads,
            env=env,
            # The test's own ranks: any picklable result (tensors, tuples) comes back.
            encode=pickle.dumps,
            decode=pickle.loads,
        )
    except RankError as exc:
        # The whole traceback in the message: it is what pytest shows of a failing test.
        message = f"rank {exc.ranks[0]} failed:\n{exc.details}" if exc.details else str(exc)
        raise DistributedTestError(message, exc.ranks, exc.details) from None


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (for checks that launched servers were stopped).

    A zombie (exited, not yet reaped by whoever inherited it) counts as gone.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): existence is all we can tell
    return state not in ("Z", "X")


def pids_mentioning(text: str) -> list[int]:
    """Live processes with ``text`` in their command line (Linux /proc), this one excepted."""
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes() and pid_alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 120.0, poll_s: float = 0.01) -> None:
    """Poll ``pred`` until it holds.

    Tests wait for the state they assert, never for a fixed time; ``timeout`` is only the point
    at which a state that never comes is reported as a failure, so it is generous for a loaded
    2-core machine.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)
