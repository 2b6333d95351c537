"""The synchronous rollout strategy of agent workflows: each step runs its samples as recorded multi-turn episodes.

``rollout.workflow`` names the user's async function (``archon.rl.agent.workflow``).  Each step, rank 0 takes the
step's samples from the loader (each prompt ``gconfig.n_samples`` times in a row, as GRPO groups them), starts a
``RecordingProxy`` over the trainer's ``RolloutClient`` with the trainer's sampling parameters pinned, and runs
every sample as one episode (``run_episode``, at most ``rollout.max_concurrent_rollouts`` at a time; 0: all).  Each
episode's turns are seeded from ``rollout_seed(seed, step, index)``, so a run repeats whatever the order in which
episodes interleave, and whatever the allocation.  The trajectories (recorded ids, behaviour logprobs, rewards)
reach every rank, and the trainer builds the batch with ``build_agent_batch``: it trains exactly the ids sampled.

When servers fail under an episode (the proxy answered 502 for a lost server, not for a refused request), the step
is recovered as single-turn rollouts are: the lost servers are restarted and all of the step's episodes are run
again with the same seeds (``archon.rl.server_recovery``).  Asynchronous agent rollouts are not built
yet (the config refuses ``rollout.max_head_offpolicyness > 0`` with a workflow).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from archon.data.rl_dataset import PromptSample
from archon.rl.agent.agent_batch import agent_metrics
from archon.rl.agent.proxy import RecordingProxy
from archon.rl.agent.trajectory import Trajectory
from archon.rl.agent.workflow import Workflow, run_episode
from archon.rl.rank0 import run_on_rank0
from archon.rl.rollout_strategy import RolloutInputs, StepRollout, SyncRollout, rollout_seed
from archon.rl.server_recovery import generate_or_recover, recover_servers
from archon.runtime.drill import drill_point

if TYPE_CHECKING:
    from archon.launch.recovery import ServerSupervisor


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


class AgentRollout(SyncRollout):
    """Each step runs its samples as agent episodes with the weights just published, recovering lost servers.

    A ``SyncRollout`` whose step batches are episodes: weight syncs, recovery and checkpoint state are its own."""

    def __init__(
        self,
        inputs: RolloutInputs,
        *,
        workflow: Workflow,
        workflow_kwargs: Mapping[str, Any],
        tokenizer: Any,
        max_turns: int,
        max_total_tokens: int,
        timeout_s: float,
        supervisor: ServerSupervisor | None,
        served_version: str | None,
    ):
        """``tokenizer`` renders the episodes' chat messages (its chat template); the limits are per episode;
        ``supervisor``: rank 0's restarter of lost servers (None elsewhere); ``served_version``: the weights the
        servers hold (None: the model folder's)."""
        super().__init__(inputs, supervisor=supervisor, served_version=served_version)
        self.workflow = workflow
        self.workflow_kwargs = dict(workflow_kwargs)
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.timeout_s = timeout_s

    def next_batch(self, step: int) -> StepRollout:
        samples = self.inputs.loader.next_rollout_batch()

        def run() -> tuple[list[Trajectory], dict[str, float]] | None:
            t0 = time.perf_counter()
            trajectories = generate_or_recover(self.supervisor, lambda: self._run_episodes(step, samples))
            if trajectories is None:
                return None  # servers lost: every rank recovers them, then the episodes are run again
            return trajectories, {"rollout_time_s": time.perf_counter() - t0, **agent_metrics(trajectories)}

        while (out := run_on_rank0(run, f"agent episodes of step {step}")) is None:
            recover_servers(self.supervisor, self.inputs.weight_sync, self.served_version)
        trajectories, metrics = out
        return StepRollout([], [t.episode_reward() for t in trajectories], metrics, trajectories=trajectories)

    def _run_episodes(self, step: int, samples: Sequence[PromptSample]) -> list[Trajectory]:
        """Rank 0: every sample as one episode, in the samples' order."""
        return asyncio.run(self._episodes(step, samples))

    async def _episodes(self, step: int, samples: Sequence[PromptSample]) -> list[Trajectory]:
        inputs = self.inputs
        assert inputs.client is not None  # rank 0 connected at setup
        limit = inputs.rollout.max_concurrent_rollouts or len(samples)
        slots = asyncio.Semaphore(limit)
        sampling = {k: v for k, v in inputs.sampling.items() if k != "sampling_seed"}
        proxy = RecordingProxy(
            inputs.client,
            self.tokenizer,
            max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens,
            default_max_tokens=int(sampling.get("max_new_tokens", 512)),
            sampling=sampling,
        )

        async def one(index: int, sample: PromptSample) -> Trajectory:
            async with slots:
                return await run_episode(
                    self.workflow,
                    sample_fields(sample),
                    proxy,
                    timeout_s=self.timeout_s,
                    seed=rollout_seed(inputs.seed, step, index),
                    **self.workflow_kwargs,
                )

        async with proxy:
            pending = asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
            # Kill-and-resume drills stop here (in a thread: the episodes go on meanwhile); real runs pass at once.
            await asyncio.to_thread(drill_point, "rollout")
            trajectories = list(await pending)
        if proxy.server_errors:  # servers were lost under some episodes: recover them and run the step again
            raise proxy.server_errors[0]
        return trajectories
