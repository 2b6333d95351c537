"""Weight sync to colocated servers (``rollout.weight_sync = 'tensor'``): the trainer's own tensors, not a copy.

A colocated server (``rollout.colocate``) runs on the GPUs of some trainer ranks (server i on ranks
``i*t .. i*t + t - 1``, one per tensor-parallel rank of it), so the weights need not travel.  Every trainer rank
iterates ``engine.named_full_tensors()`` (a collective: every rank gets every full tensor, one at a time) and
packs them into the same buckets of at most ``chunk_mb`` MiB; per bucket, every rank hands out its own copy by
reference (``archon.wire.tensor_share``: for SGLang and the built-in server a CUDA IPC handle of its GPU's
memory or shared memory on CPU, one part per tensor-parallel rank of ``/update_weights_from_tensor``; for vLLM
CUDA IPC handles keyed by its GPU, merged into one ``/update_weights``), rank 0 gathers the parts and sends
server i those of its ranks.  So each server process maps memory of its own GPU, never a
neighbour's.  The servers copy from the trainer's memory into theirs; every rank holds its bucket until rank 0
says the servers have answered, one bucket at a time, and only the last one carries the new weight version.
No process group with the servers is formed, which is also why this is the way for processes sharing a GPU
(NCCL does not put two ranks on one device).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from archon.rollout.sync_common import (
    MIB,
    extras_kw,
    gather_to_rank0,
    log_sync_stats,
    nbytes_of,
    raise_if_failed,
    trainer_rank,
)
from archon.runtime.drill import drill_point
from archon.wire.tensor_share import SHARE_TENSORS


class TensorWeightSync:
    """Weights handed to colocated servers by reference, bucket by bucket, each server its own ranks' copies."""

    def __init__(
        self,
        engine: Any,
        client: Any,
        *,
        chunk_mb: int = 512,
        dtype: torch.dtype | None = None,
        extras: bool = False,
        ranks_per_server: int = 1,
        share_format: str = "sglang",
    ):
        self.engine = engine
        self.client = client
        self.chunk_bytes = max(1, chunk_mb) * MIB
        self.dtype = dtype
        self.extras = extras
        self.ranks_per_server = ranks_per_server
        self.share = SHARE_TENSORS[share_format]

    def setup(self) -> None:
        """Collective: the servers get ready for updates from tensors (vLLM's transfer engine; else nothing)."""
        error: str | None = None
        if trainer_rank() == 0:
            try:
                self.client.setup_tensor_weights()
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"preparing the rollout servers for weights from tensors failed: {exc}"
        raise_if_failed(error)

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Collective: the engine's full tensors reach every server; the last bucket makes ``version`` current."""
        version = str(version)
        t0 = time.perf_counter()
        nbytes = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        held = 0
        first = True
        for name, tensor in self.engine.named_full_tensors(dtype=self.dtype, **extras_kw(self.extras)):
            if bucket and held + nbytes_of(tensor) > self.chunk_bytes:
                self._send(bucket, None, first)
                bucket, held, first = [], 0, False
            # A gathered tensor may be a view of a larger buffer; the servers open whole tensors.
            bucket.append((name, tensor.contiguous()))
            held += nbytes_of(tensor)
            nbytes += nbytes_of(tensor)
        drill_point("weight_sync")
        self._send(bucket, version, first)
        stats = {"weight_sync_time_s": time.perf_counter() - t0, "weight_sync_bytes": float(nbytes)}
        log_sync_stats("tensor", version, stats)
        return stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None, first: bool) -> None:
        """Collective: one bucket to every server (``version`` on the last); every rank raises on a failure."""
        parts = gather_to_rank0(self.share(bucket))
        error: str | None = None
        if parts is not None:  # rank 0
            k = self.ranks_per_server
            try:
                per_server = [parts[i : i + k] for i in range(0, len(parts), k)]
                self.client.update_weights_from_parts(per_server, version, first=first)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                names = f"{bucket[0][0]} .. {bucket[-1][0]}" if bucket else "(empty bucket)"
                error = f"tensor weight sync of version {version or '(bucket)'} failed at {names}: {exc}"
        # Every rank keeps its bucket (the memory the servers read) until rank 0 has their answers.
        raise_if_failed(error)

    def rebuild(self) -> None:
        """Collective, after servers restarted: prepare them again (``setup``)."""
        self.setup()

    def close(self) -> None:
        """Nothing to release."""
