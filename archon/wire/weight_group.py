"""A process group for weight updates that lives beside (not inside) the default group.

The trainer's rank 0 and every rollout server process join one extra group
(``init_weights_update_group`` in SGLang's protocol): the trainer is rank 0 and hosts the
rendezvous store, server process ``i`` is ``rank_offset + i``.  Both sides call
``init_weight_update_group`` with the same address, port, world size and group name; the
trainer then broadcasts each tensor from rank 0.

The rendezvous matches what SGLang's own ``init_custom_process_group`` does (a TCP store
hosted by rank 0, a ``PrefixStore`` named after the group, torch's process-group
constructor), so the trainer side also works against real SGLang servers.  Rank 0's store
listens on ``master_address`` only (loopback in a single-node run), not on every interface.  A process may hold
several such groups (one per trainer it serves) without a default group of its own.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world

from archon.alloc import ModelAllocation


def ranks_per_server(rollout: ModelAllocation) -> int:
    """Processes one server contributes to a weight-update group (SGLang: its tp size; built-in: 1)."""
    return rollout.parallel.tp_size * rollout.parallel.pp_size if rollout.backend != "local" else 1


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    listen_fd: int | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``group_name``; returns a group usable with ``dist.broadcast``.

    Rank 0 hosts on ``listen_fd`` when given (a socket from ``listen_on``, now this function's).
    """
    timeout = timedelta(seconds=timeout_s)
    # The store is built directly rather than through ``rendezvous("tcp://...")``: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) that helper makes even rank 0 a client of the agent's
    # store, so nobody would host this group's rendezvous and every rank would wait forever.
    if rank == 0:
        # Left to itself the store listens on every interface; it only needs the one the servers dial.
        fd = listen_on(master_address, master_port) if listen_fd is None else listen_fd
        try:
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                master_address,
                master_port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
    else:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            master_address, master_port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        PrefixStore(group_name, store),
        group_name=GroupName(group_name),
        timeout=timeout,
    )
    # Register ranks so that dist.broadcast(..., group=pg) maps group rank == global rank here.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return cast(dist.ProcessGroup, pg)  # a member's group: every rank 0..world_size-1 is one


def listen_on(address: str, port: int) -> int:
    """A socket listening on exactly ``address:port`` (not on every interface); returns its fd, now the caller's."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot listen on {address}:{port} for the weight-update group: {exc.strerror}"
        ) from None
    return sock.detach()


def listening_port(fd: int) -> int:
    """The port a socket from ``listen_on`` (asked for port 0: the kernel's choice) listens on."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return sock.getsockname()[1]


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    """Free a group made by ``init_weight_update_group``."""
    dist.destroy_process_group(pg)


def broadcast_tensor(tensor: torch.Tensor, pg: dist.ProcessGroup, src: int = 0) -> None:
    """In-place broadcast from ``src`` over a weight-update group."""
    dist.broadcast(tensor, src=src, group=pg)


FLATTENED_BUCKET = "flattened_bucket"
"""``load_format`` of a distributed update whose tensors come as one broadcast of their bytes (SGLang's name).

One broadcast per bucket instead of one per tensor: each broadcast is a round trip between the
trainer and every server, which on a small model is most of a sync (24 tensors of the digits
demo's model: 3.8 ms of receiving, 0.3 ms flattened) and on a large MoE model thousands of them.
"""


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` (contiguous), one after another, as one uint8 tensor (SGLang's layout)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of ``dtypes`` and ``shapes`` whose bytes ``flat`` (uint8, from ``flatten_bucket``) holds."""
    if flat.numel() != bucket_nbytes(dtypes, shapes):
        raise ValueError(
            f"a flattened bucket of {flat.numel()} bytes cannot hold tensors of {bucket_nbytes(dtypes, shapes)} bytes"
        )
    out = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes):
        size = _nbytes(dtype, shape)
        part = flat[offset : offset + size]
        # A view in another dtype must start at a multiple of its element size; mixed dtypes may not.
        if offset % dtype.itemsize:
            part = part.clone()
        out.append(part.view(dtype).view(shape))
        offset += size
    return out


def bucket_nbytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    """Bytes of the tensors of ``dtypes`` and ``shapes`` (the length of their flattened bucket)."""
    return sum(_nbytes(dtype, shape) for dtype, shape in zip(dtypes, shapes))


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * dtype.itemsize
