"""Fork-based multi-process launcher for tests.

Forking after ``import torch`` starts a rank in ~0.1 s (torchrun takes ~5 s), so
multi-process tests run a worker function in N forked children that form a gloo
group.  A rank reports its real result through a pipe; exit-time noise from gloo
("terminate called without an active exception") after a successful report is
ignored, because the report is what counts.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedTestError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _child(
    conn,
    port_conn,
    rank: int,
    world_size: int,
    threads: int,
    backend: str,
    timeout: float,
    env: dict[str, str],
    fn: Callable,
    args: tuple,
    kwargs: dict,
) -> None:
    import torch
    import torch.distributed as dist

    from archon.engine.dist import init_forked_group

    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(threads)
    try:
        init_forked_group(
            backend,
            rank,
            world_size,
            timedelta(seconds=timeout),
            send_port=lambda port: conn.send_bytes(pickle.dumps(("port", port))),
            receive_port=port_conn.recv,
        )
        result = fn(*args, **kwargs)
        # Plain pickle, not multiprocessing's: torch would share tensors through file
        # descriptors that vanish when this rank exits right after sending.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        try:
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        finally:
            os._exit(1)
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)


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
    Raises DistributedTestError with the failing rank's traceback.
    """
    from archon.engine.dist import relay_store_port  # imported before forking, so no rank pays for it

    ctx = mp.get_context("fork")
    if threads is None:
        # GNU OpenMP is not fork-safe: a child that opens a parallel region after the parent
        # used its thread pool can hang.  One intra-op thread per rank never opens one.
        threads = 1
    procs, conns, port_conns = [], [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        port_in, port_out = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(child_conn, port_in, rank, world_size, threads, backend, timeout, env or {}, fn, args, kwargs),
        )
        p.start()
        child_conn.close()
        port_in.close()
        procs.append(p)
        conns.append(parent_conn)
        port_conns.append(port_out)

    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    try:
        while pending:
            if time.monotonic() > deadline:
                raise DistributedTestError(f"ranks {sorted(pending)} did not finish within {timeout:.0f}s")
            ready = multiprocessing.connection.wait([conns[r] for r in pending], timeout=0.5)
            for conn in ready:
                rank = conns.index(conn)
                try:
                    status, payload = pickle.loads(conns[rank].recv_bytes())  # conn itself, as a Connection
                except EOFError:
                    procs[rank].join(1)
                    raise DistributedTestError(
                        f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                    ) from None
                if status == "port":  # rank 0 hosts the group's store: tell the others where
                    relay_store_port(payload, port_conns[1:])
                    continue
                if status == "err":
                    raise DistributedTestError(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
                pending.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=10 if not pending else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns + port_conns:
            c.close()
    return results


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
