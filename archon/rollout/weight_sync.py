"""Trainer side of weight sync: new actor weights reach every rollout server.

Three ways, chosen by ``rollout.weight_sync`` (the third, ``tensor``, for colocated servers, lives in
``archon.rollout.tensor_weight_sync``):

- ``distributed``: the trainer's rank 0 and every server process form a weight-update group
  (``weight_group.py``).  Per sync, all trainer ranks iterate ``engine.named_full_tensors()``
  (a collective that gathers one full tensor at a time); rank 0 packs them into buckets of at
  most ``chunk_mb`` MiB, and for each bucket tells the servers the names, dtypes and shapes
  (``/update_weights_from_distributed``) while it broadcasts the bucket's tensors in that order,
  or, flattened (``load_format = 'flattened_bucket'``: the built-in servers, SGLang on request),
  the bucket's bytes in one broadcast.  Only one bucket is ever held in memory, and only the last
  one carries the new weight version.
- ``disk``: the engine exports an HF folder (a collective; rank 0 writes) into a fresh temp
  dir, rank 0 renames it atomically to ``<folder>/v<version>`` and asks the servers to load it
  (SGLang's ``/update_weights_from_disk``; vLLM's reload sequence, see ``archon.rollout.vllm``).
  The folder must be visible to the servers.  This is the only way into vLLM servers.

The engine is duck-typed (``named_full_tensors(dtype=None)``, ``export_hf(path, dtype=None)``,
both taking ``extras=True`` when the servers are Archon's own: then the MoE routing bias,
which Qwen's HF format lacks, travels too), so this module does not import ``archon.engine``.  ``torch.distributed``
must be initialised on the trainer ranks (a single process without it acts as rank 0 of one).  Errors on rank 0
are broadcast so that every rank raises instead of waiting forever.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, Protocol, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from archon.alloc import ModelAllocation
from archon.config import Config, ConfigError
from archon.config.lora_sync import resolved_lora_sync
from archon.rollout.adapter_weight_sync import AdapterSyncEngine, AdapterWeightSync
from archon.rollout.client import api_for_backend
from archon.rollout.folder_publish import VersionFolders
from archon.rollout.sync_common import (
    MIB,
    WeightSyncError,
    broadcast_object,
    extras_kw,
    log_sync_stats,
    nbytes_of,
    raise_if_failed,
    trainer_rank,
)
from archon.rollout.tensor_weight_sync import TensorWeightSync
from archon.rollout.tied_embeddings import ties_word_embeddings, untie_in_place
from archon.runtime.drill import drill_point
from archon.wire.weight_group import (
    FLATTENED_BUCKET,
    destroy_weight_update_group,
    flatten_bucket,
    init_weight_update_group,
    listen_on,
    listening_port,
    ranks_per_server,
)
from parallel.dtypes import to_dtype

logger = logging.getLogger("archon.rollout.weight_sync")

# Broadcast polling starts short (a small model's bucket is received in about a millisecond) and
# backs off to _POLL_S.
_FIRST_POLL_S = 0.0001
_POLL_S = 0.002


class WeightSyncEngine(Protocol):
    """What weight sync needs from a training engine."""

    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None: ...


def weight_group_backend(server_backend: str, trainer_device_type: str) -> str:
    """The weight-update group's backend, from both ends: NCCL only between a CUDA trainer and GPU servers.

    The built-in server (``local:``) is a CPU process whatever the trainer runs on, so it joins over gloo; a CUDA
    trainer then stages each bucket on the CPU (``DistributedWeightSync.device``).
    """
    return "nccl" if trainer_device_type == "cuda" and server_backend in ("sglang", "vllm") else "gloo"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (what SGLang's update_weights_from_distributed expects)."""
    return str(dtype).removeprefix("torch.")


def reachable_address(server_url: str) -> str:
    """This host's address as seen from ``server_url`` (loopback for local servers)."""
    host = urlsplit(server_url if "://" in server_url else f"http://{server_url}").hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    # Connecting a UDP socket sends nothing; it only asks the kernel which interface routes there.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class DiskWeightSync:
    """Weights through an HF folder on a disk the servers can read."""

    def __init__(
        self,
        engine: WeightSyncEngine,
        client: Any,
        folder: str | Path,
        *,
        dtype: torch.dtype | None = None,
        keep_last: int = 1,
        extras: bool = False,
        untie_embeddings: bool = False,
    ):
        self.engine = engine
        self.client = client
        self.folders = VersionFolders(folder, "disk", keep_last)
        self.dtype = dtype
        self.extras = extras
        # vLLM: a tied LM head is never reloaded, so tied models are served and synced untied.
        self.untie_embeddings = untie_embeddings

    def setup(self) -> None:
        """Nothing to prepare beyond the folder (collective, for symmetry with DistributedWeightSync)."""
        self.folders.setup()

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Collective: export, publish as ``<folder>/v<version>``, make every server load it.

        ``servers_quiet`` is accepted for symmetry with the broadcast (a server loads a folder in one go).
        """
        version = str(version)

        def untie(tmp: str) -> None:
            if self.untie_embeddings and ties_word_embeddings(tmp):
                untie_in_place(tmp)

        return self.folders.publish(
            version,
            lambda tmp: self.engine.export_hf(tmp, dtype=self.dtype, **extras_kw(self.extras)),
            lambda final: self.client.update_weights_from_disk(str(final), version),
            prepare=untie,
        )

    def rebuild(self) -> None:
        """Nothing to re-form: ``sync`` reaches whichever servers are up (for symmetry with the broadcast)."""

    def close(self) -> None:
        pass


class DistributedWeightSync:
    """Weights through a broadcast group shared by trainer rank 0 and every server process."""

    def __init__(
        self,
        engine: WeightSyncEngine,
        client: Any,
        *,
        chunk_mb: float = 512,
        backend: str | None = None,
        master_address: str | None = None,
        ranks_per_server: int = 1,
        group_name: str = "archon_weight_update",
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
        extras: bool = False,
        pause_mode: str | None = None,
        flattened: bool = False,
    ):
        if chunk_mb <= 0:
            raise ConfigError(f"rollout.weight_chunk_mb = {chunk_mb} must be positive")
        self.engine = engine
        self.client = client
        self.chunk_bytes = int(chunk_mb * MIB)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address = master_address
        self.ranks_per_server = ranks_per_server
        self.group_name = group_name
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._rebuilds: tuple[str, int] | None = None  # (first group name, groups formed again by rebuild())
        self.extras = extras
        # How the servers pause around the broadcast (SGLang's mode; None: abort). Asynchronous RL
        # sets 'retract' so that requests in flight continue with the new weights.
        self.pause_mode = pause_mode
        # One broadcast of each bucket's bytes (load_format 'flattened_bucket') instead of one per tensor.
        self.flattened = flattened
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self._pg: dist.ProcessGroup | None = None

    def setup(self) -> None:
        """Collective: rank 0 creates the group with every server (both sides join concurrently)."""
        error = None
        if trainer_rank() == 0:
            try:
                self._setup_rank0()
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = str(exc)
        raise_if_failed(error)

    def rebuild(self) -> None:
        """Collective: abandon the group and form a new one with the servers that are up now.

        Called after servers were lost or restarted.  The new group gets a new name: a surviving
        server still holds the old one, and a restarted server has none.
        """
        if trainer_rank() == 0:
            self._abandon_group()
        base, n = self._rebuilds or (self.group_name, 0)
        self._rebuilds = (base, n + 1)
        self.group_name = f"{base}_r{n + 1}"
        self.setup()

    def _setup_rank0(self) -> None:
        addr = self.master_address or reachable_address(self.client.up_addrs[0])
        world_size, _ = self.client.weight_group_layout(self.ranks_per_server)
        # Listen before telling the servers where: a port picked free now could be taken before we bind it.
        fd = listen_on(addr, 0)
        port = listening_port(fd)
        # The servers' HTTP call only returns once everybody joined, so it must be in flight while we join.
        request = self.client.submit(
            self.client.ainit_weights_update_group(addr, port, self.group_name, self.backend, self.ranks_per_server)
        )
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["pg"] = init_weight_update_group(
                    addr, port, 0, world_size, self.group_name, self.backend, self.timeout_s, listen_fd=fd
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                joined["error"] = exc

        # Joining in a daemon thread lets a server's early refusal surface now instead of after the timeout.
        thread = threading.Thread(target=join, name="archon-weight-group-join", daemon=True)
        thread.start()
        while thread.is_alive():
            if request.done() and request.exception() is not None:
                raise WeightSyncError(
                    f"rollout servers did not join weight-update group '{self.group_name}' at "
                    f"{addr}:{port}: {request.exception()}"
                )
            thread.join(0.05)
        if "error" in joined:
            cause = request.exception() if request.done() else None
            raise WeightSyncError(
                f"trainer rank 0 could not form weight-update group '{self.group_name}' at "
                f"{addr}:{port} (world size {world_size}): {cause or joined['error']}; check that "
                "the servers can reach this address (set master_address) and the port is open"
            )
        request.result(timeout=self.timeout_s)
        self._pg = joined["pg"]
        logger.info(
            "weight-update group '%s' formed at %s:%d with %d ranks (%s)",
            self.group_name,
            addr,
            port,
            world_size,
            self.backend,
        )

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Collective: stream every full tensor to the servers in buckets of at most chunk_mb MiB.

        The servers are paused around the buckets unless ``servers_quiet``: the caller guarantees
        that no request runs or is sent until this returns (asynchronous rollout holds them back).
        """
        version = str(version)
        t0 = time.perf_counter()
        rank0 = trainer_rank() == 0
        error: str | None = None
        if rank0 and self._pg is None:
            error = (
                "DistributedWeightSync.sync() without a weight-update group; call setup() first (again after "
                "a failed sync)"
            )
        bucket: list[tuple[str, torch.Tensor]] = []
        bucket_bytes = 0
        total = 0
        n_buckets = 0
        paused = False
        if rank0 and error is None and not servers_quiet:
            # Each bucket is applied on its own: without a pause, a request admitted between two
            # buckets would run on half-updated weights.
            try:
                self.client.pause_generation(self.pause_mode)
                paused = True
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"could not pause the rollout servers before weight sync {version}: {exc}"
        # Every rank walks the whole generator (it is collective) even if rank 0 already failed.
        for name, tensor in self.engine.named_full_tensors(self.dtype, **extras_kw(self.extras)):
            size = nbytes_of(tensor)
            total += size
            if not rank0 or error is not None:
                continue
            if bucket and bucket_bytes + size > self.chunk_bytes:
                error = self._send_safely(bucket, version, flush=False)
                n_buckets += 1
                bucket, bucket_bytes = [], 0
            bucket.append((name, tensor.detach().to(self.device).contiguous()))
            bucket_bytes += size
        if rank0 and error is None:
            if not bucket:
                error = "the engine yielded no tensors, so there was nothing to send"
            else:
                error = self._send_safely(bucket, version, flush=True)
                n_buckets += 1
        if paused:
            try:
                self.client.continue_generation()
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = error or f"could not resume the rollout servers after weight sync {version}: {exc}"
        raise_if_failed(error)
        stats = {
            "weight_sync_time_s": time.perf_counter() - t0,
            "weight_sync_bytes": float(total),
            "weight_sync_buckets": float(broadcast_object(n_buckets)),
        }
        log_sync_stats("distributed", version, stats)
        return stats

    def _send_safely(self, bucket: list[tuple[str, torch.Tensor]], version: str, flush: bool) -> str | None:
        try:
            self._send_bucket(bucket, version, flush)
            return None
        except Exception as exc:  # noqa: BLE001 - reported on every rank by sync()
            self._abandon_group()
            return (
                f"distributed weight sync of version {version} failed: {exc}; the weight-update group was "
                "abandoned, so call setup() again (after fixing the servers) before the next sync"
            )

    def _abandon_group(self) -> None:
        from torch.distributed.distributed_c10d import _abort_process_group

        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            _abort_process_group(pg)
        except Exception as exc:  # noqa: BLE001 - best effort; the sync error is what matters
            logger.warning("could not abort weight-update group '%s': %s", self.group_name, exc)
        # Broadcasts that a failed server never receives stay pending until the group timeout, and
        # a gloo group's destructor joins its worker threads, so freeing it would block here (or at
        # interpreter exit) for up to timeout_s.  The aborted group is deliberately never freed.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str, flush: bool) -> None:
        names = [n for n, _ in bucket]
        # SGLang sets its weight version after every bucket that carries one: only the last bucket
        # (the one that flushes) carries it, so a sync failing half-way leaves the old version.
        request = self.client.submit(
            self.client.aupdate_weights_from_distributed(
                names,
                [dtype_name(t.dtype) for _, t in bucket],
                [list(t.shape) for _, t in bucket],
                self.group_name,
                version if flush else None,
                flush_cache=flush,
                load_format=FLATTENED_BUCKET if self.flattened else None,
            )
        )
        sent = [flatten_bucket([t for _, t in bucket])] if self.flattened else [t for _, t in bucket]
        issued = self._issue_broadcasts(sent)
        drill_point("weight_sync")
        # Poll instead of blocking in wait(): a server that refuses the bucket never receives, and its
        # HTTP error must not be hidden behind a broadcast that waits for the group timeout.
        deadline = time.monotonic() + self.timeout_s
        poll = _FIRST_POLL_S
        while not (issued.done() and all(w.is_completed() for w in issued.result())):
            if request.done() and request.exception() is not None:
                raise WeightSyncError(f"a rollout server failed while receiving {names[0]}..: {request.exception()}")
            if time.monotonic() > deadline:
                stage = "did not finish" if issued.done() else "could not connect to every server"
                raise WeightSyncError(
                    f"broadcast of {len(names)} tensor(s) starting at {names[0]} {stage} within {self.timeout_s:g} s"
                )
            time.sleep(poll)
            poll = min(2 * poll, _POLL_S)
        for w in issued.result():
            w.wait()  # surfaces a failed collective as an exception
        request.result(timeout=self.timeout_s)

    def _issue_broadcasts(self, tensors: list[torch.Tensor]) -> Future[list[dist.Work]]:
        """Start the broadcasts of ``tensors`` from a thread of their own; their Works once issued.

        NCCL connects a group lazily, inside its first collective, and that call blocks until every
        rank has joined: a server that refuses the bucket never joins, so issued from this thread the
        call would hang before any error could be polled.  Gloo connects when the group forms, and
        its call returns at once.  A thread stuck connecting is left behind with the abandoned group.
        """
        issued: Future[list[dist.Work]] = Future()
        # Bound now: a server refusing fast makes _abandon_group set self._pg to None before this
        # thread runs, and group=None would broadcast on the trainer's default group instead.
        group = self._pg
        assert group is not None, "_send_bucket without a weight-update group"

        def issue() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # a new thread starts on device 0
                # async_op=True: each returns its Work.
                works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
                issued.set_result(cast("list[dist.Work]", works))
            except BaseException as exc:  # noqa: BLE001 - handed to the polling thread
                issued.set_exception(exc)

        threading.Thread(target=issue, name="archon-weight-broadcast", daemon=True).start()
        return issued

    def close(self) -> None:
        if self._pg is not None:
            destroy_weight_update_group(self._pg)
            self._pg = None


class WeightSync(Protocol):
    """What the RL loop asks of a weight sync (``DiskWeightSync``, ``DistributedWeightSync``, ``TensorWeightSync``,
    ``AdapterWeightSync`` and the in-process engine's ``archon.rl.inprocess.InProcessWeightSync``); every method is
    collective."""

    def setup(self) -> None: ...

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]: ...

    def rebuild(self) -> None: ...

    def close(self) -> None: ...


def build_weight_sync(
    mode: Literal["distributed", "disk", "tensor"],
    engine: WeightSyncEngine,
    client: Any,
    *,
    folder: str | Path | None = None,
    chunk_mb: float = 512,
    backend: str | None = None,
    master_address: str | None = None,
    ranks_per_server: int = 1,
    dtype: torch.dtype | None = None,
    extras: bool = False,
    flattened: bool = False,
    untie_embeddings: bool = False,
    share_format: str = "sglang",
) -> WeightSync:
    """The weight sync for ``rollout.weight_sync`` (call ``.setup()`` once, then ``.sync(version)`` per step).

    ``extras``: the servers are Archon's own and also take what HF formats lack (the MoE routing bias).
    ``flattened``: each distributed bucket goes as one broadcast of its bytes (``load_format = 'flattened_bucket'``).
    ``untie_embeddings``: disk folders of a model with tied word embeddings are written untied (vLLM servers).
    ``share_format``: how trainer ranks share tensors with colocated servers (``ServerAPI.tensor_share_format``).
    """
    if mode == "distributed":
        return DistributedWeightSync(
            engine,
            client,
            chunk_mb=chunk_mb,
            backend=backend,
            master_address=master_address,
            ranks_per_server=ranks_per_server,
            dtype=dtype,
            extras=extras,
            flattened=flattened,
        )
    if mode == "disk":
        if folder is None:
            raise ConfigError(
                "rollout.weight_sync = 'disk' needs a folder the servers can read (e.g. <run_dir>/weights)"
            )
        return DiskWeightSync(engine, client, folder, dtype=dtype, extras=extras, untie_embeddings=untie_embeddings)
    if mode == "tensor":
        return TensorWeightSync(
            engine,
            client,
            chunk_mb=int(chunk_mb),
            dtype=dtype,
            extras=extras,
            ranks_per_server=ranks_per_server,
            share_format=share_format,
        )
    raise ConfigError(f"rollout.weight_sync = '{mode}' must be 'distributed', 'disk' or 'tensor'")


def server_dtype(cfg: Config) -> str:
    """The dtype the rollout servers compute in: SGLang's and vLLM's own, the actor's for the built-in server."""
    backend = ModelAllocation.from_str(cfg.rollout.backend).backend
    return {"sglang": cfg.sglang.dtype, "vllm": cfg.vllm.dtype}.get(backend, cfg.actor.dtype)


def weight_sync_for(cfg: Config, engine: WeightSyncEngine, client: Any, trainer_device_type: str) -> WeightSync:
    """The weight sync a run of ``cfg`` uses between ``engine`` (the actor's, on ``trainer_device_type``) and its
    servers: tensors in the servers' dtype, the group's backend from both ends, what each server kind takes; a LoRA
    actor's adapters alone where ``rollout.lora_sync`` resolves to 'adapter'."""
    if resolved_lora_sync(cfg) == "adapter":
        return AdapterWeightSync(cast("AdapterSyncEngine", engine), client, cfg.run_dir / "lora_sync")
    rollout = ModelAllocation.from_str(cfg.rollout.backend)
    fmt = cfg.rollout.weight_load_format
    return build_weight_sync(
        cfg.rollout.weight_sync,
        engine,
        client,
        folder=cfg.run_dir / "weights",
        chunk_mb=cfg.rollout.weight_chunk_mb,
        backend=weight_group_backend(rollout.backend, trainer_device_type),
        ranks_per_server=ranks_per_server(rollout),
        dtype=to_dtype(server_dtype(cfg)),
        extras=rollout.backend == "local",  # the built-in servers also take what HF formats lack
        flattened=fmt == "flattened_bucket" or (fmt == "auto" and rollout.backend == "local"),
        untie_embeddings=rollout.backend == "vllm",
        share_format=api_for_backend(rollout.backend).tensor_share_format,
    )
