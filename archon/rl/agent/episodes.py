"""Running a round of samples as agent episodes: what both rollout strategies of workflows share.

A round is one batch of samples from the data loader (each prompt ``gconfig.n_samples`` times in a row, as GRPO
groups them).  ``run_episodes`` runs every sample of a round as one episode of a ``RecordingProxy`` whose sampling is
the trainer's (``open_proxy``), sample ``i`` with the seed the strategy gives it, so a run repeats whatever the order
in which episodes interleave.  The synchronous strategy (``agent_rollout``) runs a round per step on its own event
loop; the asynchronous one (``agent_worker``) runs rounds ahead of training on the rollout client's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from archon.data.rl_dataset import PromptSample
from archon.rl.agent.proxy import RecordingProxy, TurnGenerator
from archon.rl.agent.trajectory import Trajectory
from archon.rl.agent.workflow import Workflow, run_episode
from archon.rollout.aio import gather_or_cancel
from archon.rollout.client import RolloutClient


@dataclass
class EpisodeSpec:
    """How every sample runs as an agent episode (from the ``rollout`` config section)."""

    workflow: Workflow
    """The user's async agent function (``rollout.workflow``)."""
    tokenizer: Any
    """Renders the episodes' chat messages (its chat template)."""
    max_turns: int
    """Requests an episode may make (``rollout.max_turns``)."""
    max_total_tokens: int
    """Ids an episode may hold, prompts and sampled (``rollout.max_total_tokens``, resolved)."""
    timeout_s: float
    """Seconds an episode may run before it is cancelled (``rollout.workflow_timeout_s``)."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every workflow call gets (``rollout.workflow_kwargs``)."""
    routed_experts: tuple[int, int] | None = None
    """The policy's ``(n_layers, top_k)`` when turns record the experts each token was routed to (MoE routing
    replay); None otherwise."""


def sample_fields(sample: PromptSample) -> dict[str, Any]:
    """What a workflow gets as ``sample``: the row's fields (``messages`` too: a plain prompt becomes one user
    message), its ``prompt`` text, reference ``answer``, ``solution`` and row ``index``."""
    fields: dict[str, Any] = {
        **sample.extra,
        "index": sample.index,
        "prompt": sample.prompt,
        "answer": sample.answer,
        "solution": sample.solution,
    }
    fields.setdefault("messages", [{"role": "user", "content": sample.prompt}])
    return fields


def open_proxy(
    spec: EpisodeSpec, client: RolloutClient, sampling: Mapping[str, Any], generate: TurnGenerator | None = None
) -> RecordingProxy:
    """A recording proxy (not started) that pins the trainer's ``sampling`` for every turn (each episode's seed
    replaces ``sampling_seed``); ``generate``: how turns reach the servers (default: one request each)."""
    pinned = {k: v for k, v in sampling.items() if k != "sampling_seed"}
    return RecordingProxy(
        client,
        spec.tokenizer,
        max_turns=spec.max_turns,
        max_total_tokens=spec.max_total_tokens,
        default_max_tokens=int(pinned.get("max_new_tokens", 512)),
        sampling=pinned,
        routed_experts=spec.routed_experts,
        generate=generate,
    )


async def run_episodes(
    spec: EpisodeSpec,
    proxy: RecordingProxy,
    samples: Sequence[PromptSample],
    seeds: Sequence[int],
    slots: asyncio.Semaphore | None = None,
) -> list[Trajectory]:
    """Every sample as one episode of the serving ``proxy`` (sample ``i`` seeded with ``seeds[i]``), at most as
    many at a time as ``slots`` lets through; the trajectories in the samples' order.  A failure (not of a
    workflow: those cost only their episode) cancels the other episodes and is raised."""

    async def one(sample: PromptSample, seed: int) -> Trajectory:
        async def run() -> Trajectory:
            return await run_episode(
                spec.workflow, sample_fields(sample), proxy, timeout_s=spec.timeout_s, seed=seed, **spec.workflow_kwargs
            )

        if slots is None:
            return await run()
        async with slots:
            return await run()

    return await gather_or_cancel(one(s, seed) for s, seed in zip(samples, seeds, strict=True))
