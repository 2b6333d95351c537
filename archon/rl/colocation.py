"""Colocated servers and trainer taking turns on the same GPUs (``rollout.colocate``): the phases of one RL step.

A synchronous step on shared GPUs runs as::

    generate (servers hold weights + KV cache; the trainer only what actor.offload leaves)
    -> release: servers give back their weights and KV cache; the trainer brings back what it offloaded
    -> train (the whole GPU but the servers' small remainder)
    -> resume the servers' weights -> weight sync (by reference: rollout.weight_sync = 'tensor')
    -> trainer offloads (actor.offload) -> resume the servers' KV cache -> next generate

The servers' side is SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` (vLLM's sleep mode,
the built-in server's own accounting; ``archon.rollout.client``).  Every method is collective: rank 0 talks to the
servers, every rank moves its own training state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from archon.engine import TrainEngine
from archon.rl.rank0 import run_on_rank0
from archon.rollout.client import RolloutClient

logger = logging.getLogger("archon.rl")

WEIGHTS = ["weights"]
"""The servers' memory a weight update needs back first."""
GENERATION = ["kv_cache", "cuda_graph"]
"""The rest of the servers' memory, taken back once the new weights are in."""


class ColocatedPhases:
    """Hands the GPUs back and forth between colocated servers and the training engines."""

    def __init__(self, client: RolloutClient | None, engines: list[TrainEngine], offload: bool):
        self.client = client
        """Rank 0's client of the servers; None on the other ranks."""
        self.engines = engines
        """The engines whose state ``actor.offload`` moves to the CPU while the servers generate."""
        self.offload = offload
        self.offloaded = False
        self.transition_s = 0.0
        """Seconds spent releasing, resuming and moving state this step (reported with the step)."""
        self.server_bytes: dict[str, float] = {}
        """What the servers held while generating and while training, by their own accounting (built-in servers)."""

    def start(self) -> None:
        """Collective, before the first rollout: the servers hold everything; the trainer steps aside if configured."""
        self._offload()

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Collective, around a rollout: afterwards the servers release their memory and the trainer takes it."""
        yield
        t0 = time.perf_counter()
        held = self._server_bytes()
        self._servers("release_memory_occupation", None)
        left = self._server_bytes()
        if held is not None and left is not None:
            self.server_bytes = {"colocate/server_bytes_generating": held, "colocate/server_bytes_training": left}
        if self.offloaded:
            for engine in self.engines:
                engine.onload()
            self.offloaded = False
        self.transition_s += time.perf_counter() - t0

    @contextmanager
    def syncing(self) -> Iterator[None]:
        """Collective, around the weight sync: the servers' weights first, the rest once the new ones are in."""
        t0 = time.perf_counter()
        self._servers("resume_memory_occupation", WEIGHTS)
        self.transition_s += time.perf_counter() - t0
        yield
        t0 = time.perf_counter()
        self._offload()
        self._servers("resume_memory_occupation", GENERATION)
        self.transition_s += time.perf_counter() - t0

    def take_metrics(self) -> dict[str, float]:
        """This step's hand-overs: seconds spent, and the servers' bytes in each phase where they report them."""
        metrics = {"colocate/transition_s": self.transition_s, **self.server_bytes}
        self.transition_s, self.server_bytes = 0.0, {}
        return metrics

    def _server_bytes(self) -> float | None:
        """Collective: the bytes of weights and KV cache every server holds (None: a server does not say)."""

        def read() -> float | None:
            assert self.client is not None
            infos = self.client.server_info().values()
            if not all(isinstance(i, dict) and "weight_bytes" in i for i in infos):
                return None  # SGLang and vLLM report memory in their own terms
            return float(sum(i["weight_bytes"] + i["kv_cache_bytes"] for i in infos))

        return run_on_rank0(read, "reading the colocated rollout servers' memory")

    def _offload(self) -> None:
        if self.offload and not self.offloaded:
            for engine in self.engines:
                engine.offload()
            self.offloaded = True

    def _servers(self, method: str, tags: list[str] | None) -> None:
        def call() -> None:
            assert self.client is not None
            getattr(self.client, method)(tags)

        run_on_rank0(call, f"{method.replace('_', ' ')} on the colocated rollout servers")
