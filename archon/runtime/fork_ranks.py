"""Run a function on N forked processes that form a process group on this machine.

The laptop rehearsal (``python -m archon.plan rehearse``) and the multi-process tests both need
N real ranks without a launcher.  Forking after ``import torch`` starts a rank in ~0.1 s
(torchrun takes ~5 s).  Each rank reports its result, or its traceback, through a pipe; noise
at exit ("terminate called without an active exception" from gloo) after a successful report is
ignored, because the report is what counts.  The parent waits until every rank has reported or
the deadline passed, then makes sure that no rank is left running.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

POLL_S = 0.5
"""How long the parent waits for a rank's message before it checks the deadline again."""
EXIT_GRACE_S = 10.0
"""How long ranks that all reported get to leave the group and exit before they are killed."""


class RankError(RuntimeError):
    """A forked rank raised, died without reporting, or did not finish in time.

    The message is one line; ``details`` holds the failing rank's traceback ("" when it sent none).
    """

    def __init__(self, message: str, ranks: Sequence[int], details: str = "") -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        """The ranks at fault: the one that failed or died, or every one still running at the deadline."""
        self.details = details
        """The failing rank's traceback."""


Encode = Callable[[Any], bytes]
"""Turns a rank's message (status, payload) into bytes for the pipe."""
Decode = Callable[[bytes], Any]
"""Turns the bytes back into the message."""


def encode_json(message: Any) -> bytes:
    """The default wire format: JSON, so the parent never runs code a child could send (results must be JSON values)."""
    return json.dumps(message).encode()


def decode_json(data: bytes) -> Any:
    return json.loads(data)


def _send(conn: mp_connection.Connection, encode: Encode, status: str, payload: Any) -> None:
    # Bytes, not multiprocessing's own send: that pickles, and torch would share tensors through
    # file descriptors that vanish when this rank exits right after sending.
    conn.send_bytes(encode((status, payload)))


def _join_group(
    conn: mp_connection.Connection,
    encode: Encode,
    port_conn: mp_connection.Connection,
    backend: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
) -> None:
    """Rank 0 hosts the group's store on a port the kernel chooses and tells the parent, which
    passes it on to the other ranks.  A port the parent picked for rank 0 to bind later could be
    taken by another process in between (it was, under load).  The parent itself holds no store:
    its server thread, alive at fork time, could leave a lock held in every child."""
    if rank == 0:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        _send(conn, encode, "port", store.port)
    else:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port_conn.recv(), world_size, is_master=False, timeout=timeout
        )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _run_rank(
    conn: mp_connection.Connection,
    encode: Encode,
    port_conn: mp_connection.Connection,
    rank: int,
    world_size: int,
    backend: str,
    group_timeout: timedelta,
    threads: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
) -> None:
    """The body of one forked rank: join the group, run ``fn``, report, leave the group, exit."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(threads)
    try:
        _join_group(conn, encode, port_conn, backend, rank, world_size, group_timeout)
        _send(conn, encode, "ok", fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        try:
            # Stamped: a rank whose peer failed fails later in a collective, and the parent names the first.
            _send(conn, encode, "err", (time.monotonic(), traceback.format_exc()))
        finally:
            os._exit(1)
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        # gloo may abort at interpreter exit after all work succeeded; the report is what counts.
        os._exit(0)


def _relay_store_port(port: int, receivers: Sequence[mp_connection.Connection]) -> None:
    for conn in receivers:
        try:
            conn.send(port)
        except OSError:
            pass  # that rank died already; its own report says so


def _first_failure(
    rank: int,
    failure: RankError,
    stamp: float,
    conns: list[mp_connection.Connection],
    pending: set[int],
    procs: list[Any],
    decode: Decode,
) -> RankError:
    """The failure that came first, among ``failure`` (read from ``rank``) and the reports already waiting.

    When one rank fails, its peers fail after it inside collectives ("Connection reset by peer"),
    so their reports are stamped later; and the first failure was sent (or the rank died) before
    any peer noticed, so its report is already readable.  A death without a report comes first.
    """
    best, best_stamp = failure, stamp
    others = [conns[r] for r in pending if r != rank]
    for ready in mp_connection.wait(others, timeout=0) if others else []:
        other = conns.index(cast(mp_connection.Connection, ready))
        try:
            status, payload = decode(conns[other].recv_bytes())
        except EOFError:
            procs[other].join(1)
            return RankError(f"rank {other} died without reporting (exit code {procs[other].exitcode})", [other])
        if status == "err" and payload[0] < best_stamp:
            best_stamp, tb = payload
            best = RankError(f"rank {other} failed: {_last_line(tb)}", [other], tb)
    return best


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else "unknown error"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = 300.0,
    group_timeout_s: float | None = None,
    backend: str = "gloo",
    threads: int = 1,
    env: dict[str, str] | None = None,
    encode: Encode = encode_json,
    decode: Decode = decode_json,
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` forked ranks of one process group; their results by rank.

    ``fn`` reads its rank from ``torch.distributed.get_rank()``; its result travels as ``encode`` writes
    it (JSON by default; a caller that trusts its ranks with other objects passes its own pair).
    ``timeout_s`` is the deadline for every rank to report; ``group_timeout_s`` (default: the same)
    is the process group's timeout for a collective.  Each rank runs ``threads`` intra-op threads:
    GNU OpenMP is not fork-safe (a child that opens a parallel region after the parent used its
    thread pool can hang), one thread never opens one, and the ranks share the machine's cores.
    ``env`` is added to each rank's environment before ``RANK``, ``WORLD_SIZE`` and the like.
    Raises ``RankError`` for the first failure (a rank blocked in a collective with a rank that
    failed fails too, later) or death, or for the ranks still running at the deadline; no rank
    outlives the call.
    """
    group_timeout = timedelta(seconds=timeout_s if group_timeout_s is None else group_timeout_s)
    ctx = mp.get_context("fork")
    procs, conns, port_conns = [], [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        port_in, port_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_run_rank,
            args=(
                child_conn,
                encode,
                port_in,
                rank,
                world_size,
                backend,
                group_timeout,
                threads,
                env or {},
                fn,
                args,
                kwargs or {},
            ),
        )
        proc.start()
        child_conn.close()
        port_in.close()
        procs.append(proc)
        conns.append(parent_conn)
        port_conns.append(port_out)

    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            if time.monotonic() > deadline:
                raise RankError(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s", sorted(pending))
            for conn in mp_connection.wait([conns[r] for r in pending], timeout=POLL_S):
                rank = conns.index(conn)
                try:
                    status, payload = decode(conns[rank].recv_bytes())
                except EOFError:
                    procs[rank].join(1)  # so that its exit code is known
                    raise RankError(
                        f"rank {rank} died without reporting (exit code {procs[rank].exitcode})", [rank]
                    ) from None
                if status == "port":  # rank 0 hosts the group's store: tell the others where
                    _relay_store_port(payload, port_conns[1:])
                    continue
                if status == "err":
                    stamp, tb = payload
                    failure = RankError(f"rank {rank} failed: {_last_line(tb)}", [rank], tb)
                    raise _first_failure(rank, failure, stamp, conns, pending, procs, decode)
                results[rank] = payload
                pending.discard(rank)
    finally:
        for proc in procs:
            proc.join(timeout=EXIT_GRACE_S if not pending else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns + port_conns:
            conn.close()
    return results
