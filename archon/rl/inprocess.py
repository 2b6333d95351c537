"""The in-process rollout engine (``rollout.backend = "inprocess:d1"``): generation on the actor's own weights.

For a small model, or a debugging session, rollout servers cost more than they give: a process, a copy of the
weights, and a weight sync after every step.  Here the trainer serves its own rollouts: a ``Generator`` (the built-in
server's engine) runs in the training process over the actor engine's model itself (on CPU the trainer's thread
runs it while it waits for a rollout, ``InProcessRollout.serve``; its own thread serves what comes at other times),
and the built-in server's app (``archon.server.app``: the same endpoints, sampling, logprobs, pause and abort as a
``local`` server) answers the rollout client in process, through httpx's ASGI transport (no socket, no HTTP server).
Everything above the client (both rollout strategies, agent workflows, the weight check) runs unchanged.

The optimizer steps the very tensors generation reads, so a weight "sync" only publishes the new version
(``InProcessWeightSync``).  Generation and training take turns (a synchronous run: the config refuses
``max_head_offpolicyness > 0``), and generation runs under the engine's autocast, so it computes in ``actor.dtype``
as training does.

Under data parallel (``archon:dN`` with ``inprocess:dN``) each rank holds a shard of the weights: for the rollout
every rank gathers the whole parameters (``parallel.fsdp.gathered_parameters``, FSDP's own unshard, in the
training compute dtype) and rank 0 generates the batch with them, as it would talk to servers; the others wait,
and everyone reshards before training.  Tensor, pipeline and context parallel split what a forward needs across
ranks, so they are refused.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch.distributed as dist

from archon.config import Config, ConfigError
from archon.engine import ArchonEngine, TrainEngine
from archon.launch.server_commands import resolve_context_length
from archon.rollout.client import RolloutClient
from archon.server.app import RolloutServer, ServerArgs
from archon.server.generator import Generator
from archon.server.weight_update import read_eos_token_ids
from parallel.dtypes import to_dtype
from parallel.fsdp import gathered_parameters

logger = logging.getLogger("archon.rl")

T = TypeVar("T")

INPROCESS_ADDR = "http://in-process"
"""The address the rollout client knows the in-process server by (never resolved: the app answers it)."""


class InProcessWeightSync:
    """The weight sync of the in-process engine: the weights are shared, so only the served version changes."""

    def __init__(self, generator: Generator | None):
        self.generator = generator
        """Rank 0's generator; None on the other ranks, which have nothing to publish."""

    def setup(self) -> None:
        """Nothing to connect."""

    def sync(self, version: int | str, servers_quiet: bool = False) -> dict[str, float]:
        """Publish ``version`` once no request runs (new requests then report it); no bytes move."""
        t0 = time.perf_counter()
        if self.generator is not None:
            self.generator.publish_weights(str(version)).result()
        return {"weight_sync_time_s": time.perf_counter() - t0, "weight_sync_bytes": 0.0}

    def rebuild(self) -> None:
        """Nothing to re-form."""

    def close(self) -> None:
        """Nothing to release (the generator is closed with its ``InProcessRollout``)."""


class InProcessRollout:
    """The generator over ``engine``'s model, its app and a rollout client of it (rank 0), and the rollout phase.

    Built on every training rank (collective); ``client`` and ``generator`` are None on the others.
    """

    def __init__(self, engine: TrainEngine, cfg: Config):
        where = f"rollout.backend = '{cfg.rollout.backend}'"
        if not isinstance(engine, ArchonEngine) or engine.model is None:
            raise ConfigError(
                f"{where} generates with Archon's own models, but actor.backend = '{cfg.actor.backend}' is "
                "not an archon: engine; use actor.backend = 'archon:d1' or a local/sglang/vllm rollout backend"
            )
        dims = engine.parallel_dims
        if dims.tp > 1 or dims.pp > 1 or dims.cp > 1 or dims.ep > 1:
            raise ConfigError(
                f"{where} generates on whole weights, which actor.backend = '{cfg.actor.backend}' splits across "
                "ranks for every forward (t, p, c or e > 1); use a data-parallel actor (archon:dN), or rollout "
                "servers ('local:d1', 'sglang:d1')"
            )
        self.model = engine.model
        # The trainer's thread, which serves the engine while it waits on CPU (serve); None: it never does.
        self._serve_on = threading.current_thread() if engine.device.type == "cpu" else None
        self.generator: Generator | None = None
        self.client: RolloutClient | None = None
        self.weight_sync = InProcessWeightSync(None)
        if dist.get_rank() != 0:
            return
        compute_dtype = to_dtype(cfg.actor.dtype)
        param_dtype = next(engine.model.parameters()).dtype
        context = resolve_context_length(cfg.sglang.context_length, cfg.actor.path, "sglang.context_length")
        seed = cfg.sglang.random_seed
        self.generator = Generator(
            engine.model,
            eos_token_ids=read_eos_token_ids(cfg.actor.path),
            context_length=context,
            random_seed=seed,
            shared_weights=True,
            # Autocast where training uses it (a low-precision dtype without FSDP), so both compute alike.
            compute=(lambda: engine.layout.autocast(cfg.actor.dtype)) if compute_dtype != param_dtype else None,
            cache_dtype=compute_dtype,
            batch_invariant=cfg.sglang.enable_deterministic_inference,
            # One OpenMP team per process (Generator's compute_threads): the trainer's thread keeps the cores' team
            # and runs the engine itself while it waits for rollouts (serve below); the generation thread, which
            # serves what arrives at other times, computes with one.  Measured on 2 cores: a generation thread
            # with a team of its own slowed every training kernel (the step's training half 0.44 -> 0.39 s without
            # it), and a decode step of 64 rows takes ~20 ms on one thread, ~15 ms on the trainer's two.
            compute_threads=1 if engine.device.type == "cpu" else None,
        )
        args = ServerArgs(
            model_path=cfg.actor.path,
            device=str(engine.device),
            random_seed=seed,
            context_length=self.generator.context_length,
            max_running_requests=self.generator.max_running_requests,
            enable_deterministic_inference=cfg.sglang.enable_deterministic_inference,
        )
        self.server = RolloutServer(self.generator, args)
        self.client = RolloutClient.from_config(cfg.rollout, [INPROCESS_ADDR], app=self.server.app, serve=self.serve)
        self.weight_sync = InProcessWeightSync(self.generator)
        logger.info(
            "in-process rollout: generating on the actor's weights (%s, %s), context length %d",
            engine.device,
            compute_dtype,
            self.generator.context_length,
        )

    def serve(self, future: Future[T]) -> T:
        """Wait for ``future``: the trainer's thread runs the engine meanwhile on CPU (``Generator.serve_until``);
        other threads, and other devices, just wait."""
        generator = self.generator
        if generator is None or self._serve_on is not threading.current_thread():
            return future.result()
        return generator.serve_until(future)

    def generating(self) -> AbstractContextManager[None]:
        """Collective, around a rollout: every rank's parameters whole (under data parallel) until it ends."""
        return gathered_parameters(self.model)

    def close(self) -> None:
        """Stop the client and the generator thread (the model stays the engine's)."""
        if self.client is not None:
            self.client.close()
        if self.generator is not None:
            self.generator.close()

    def __enter__(self) -> InProcessRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
