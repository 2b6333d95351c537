"""Weight sync to colocated servers (``rollout.weight_sync = 'tensor'``): the trainer's own tensors, not a copy.

A colocated server (``rollout.colocate``) runs on the trainer's GPUs, so the weights need not travel: every trainer
rank iterates ``engine.named_full_tensors()`` (a collective gathering one full tensor at a time), rank 0 packs
them into buckets of at most ``chunk_mb`` MiB and hands each bucket to every server by reference (SGLang's
``/update_weights_from_tensor``: CUDA tensors as IPC handles, CPU tensors through shared memory,
``archon.wire.tensor_ipc``).  The servers copy from the trainer's memory into theirs; only one bucket is held at
once, and only the last one carries the new weight version.  No process group is formed, which is also why this
is the way for processes sharing a GPU (NCCL does not put two ranks on one device).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from archon.rollout.sync_common import (
    MIB,
    broadcast_object,
    extras_kw,
    log_sync_stats,
    nbytes_of,
    raise_if_failed,
    trainer_rank,
)
from archon.runtime.drill import drill_point


class TensorWeightSync:
    """Weights handed to colocated servers by reference, bucket by bucket."""

    def __init__(
        self, engine: Any, client: Any, *, chunk_mb: int = 512, dtype: torch.dtype | None = None, extras: bool = False
    ):
        self.engine = engine
        self.client = client
        self.chunk_bytes = max(1, chunk_mb) * MIB
        self.dtype = dtype
        self.extras = extras

    def setup(self) -> None:
        """Nothing to connect: every sync is a set of requests (collective, for symmetry with the broadcast)."""

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Collective: the engine's full tensors reach every server; the last bucket makes ``version`` current."""
        version = str(version)
        t0 = time.perf_counter()
        error: str | None = None
        nbytes = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        held = 0
        tensors = self.engine.named_full_tensors(dtype=self.dtype, **extras_kw(self.extras))
        for name, tensor in tensors:
            if trainer_rank() != 0 or error is not None:
                continue  # every rank keeps iterating: each full tensor is a collective
            if bucket and held + nbytes_of(tensor) > self.chunk_bytes:
                error = self._send(bucket, None)
                bucket, held = [], 0
            # A gathered tensor may be a view of a larger buffer; the servers open whole tensors.
            bucket.append((name, tensor.contiguous()))
            held += nbytes_of(tensor)
            nbytes += nbytes_of(tensor)
        if trainer_rank() == 0 and error is None:
            drill_point("weight_sync")
            error = self._send(bucket, version)
        raise_if_failed(error)
        stats = {"weight_sync_time_s": time.perf_counter() - t0, "weight_sync_bytes": float(broadcast_object(nbytes))}
        log_sync_stats("tensor", version, stats)
        return stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> str | None:
        """Rank 0: one bucket to every server (``version`` on the last); the error, or None."""
        try:
            self.client.update_weights_from_tensor(bucket, version)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
            names = f"{bucket[0][0]} .. {bucket[-1][0]}" if bucket else "(empty bucket)"
            return f"tensor weight sync of version {version or '(bucket)'} failed at {names}: {exc}"
        return None

    def rebuild(self) -> None:
        """Nothing to re-form: ``sync`` reaches whichever servers are up."""

    def close(self) -> None:
        """Nothing to release."""
