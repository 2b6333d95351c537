"""The synchronous rollout strategy of agent workflows: each step runs its samples as recorded multi-turn episodes.

``rollout.workflow`` names the user's async function (``archon.rl.agent.workflow``).  Each step, rank 0 takes the
step's samples from the loader, starts a ``RecordingProxy`` over the trainer's ``RolloutClient`` with the trainer's
sampling parameters pinned, and runs every sample as one episode (``archon.rl.agent.episodes``, at most
``rollout.max_concurrent_rollouts`` at a time; 0: all), sample ``i`` seeded with ``rollout_seed(seed, step, i)``, so a
run repeats whatever the allocation.  The trajectories (recorded ids, behaviour logprobs, rewards, routing with
``actor.moe_routing_replay``) reach every rank, and the trainer builds the batch with ``build_agent_batch``: it trains
exactly the ids sampled.  With ``dynamic_filter`` the step draws rounds of episodes until it has a batch of prompt
groups whose episode rewards differ (``archon.rl.dynamic_filter``); refill rounds seed their samples after the
first round's, as single-turn rollouts do.

When servers fail under an episode (the proxy answered 502 for a lost server, not for a refused request), the round
is recovered as single-turn rollouts are: the lost servers are restarted and all of the round's episodes are run
again with the same seeds (``archon.rl.server_recovery``).  Asynchronous agent rollouts are
``archon.rl.agent.agent_worker``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from archon.data.rl_dataset import PromptSample
from archon.rl.agent.episodes import EpisodeSpec, open_proxy, run_episodes
from archon.rl.agent.trajectory import Trajectory
from archon.rl.rank0 import run_on_rank0
from archon.rl.rollout_strategy import RolloutInputs, StepRollout, SyncRollout, rollout_seed
from archon.rl.server_recovery import generate_or_recover, recover_servers
from archon.runtime.drill import drill_point

if TYPE_CHECKING:
    from archon.launch.recovery import ServerSupervisor

EpisodeRound = tuple[list[Trajectory], list[float], dict[str, float]]
"""One round of episodes: the trajectories, their episode rewards, and timings (seconds)."""


class AgentRollout(SyncRollout):
    """Each step runs its samples as agent episodes with the weights just published, recovering lost servers.

    A ``SyncRollout`` whose step batches are episodes: weight syncs, recovery and checkpoint state are its own."""

    def __init__(
        self,
        inputs: RolloutInputs,
        *,
        episodes: EpisodeSpec,
        supervisor: ServerSupervisor | None,
        served_version: str | None,
    ):
        """``episodes``: how each sample runs; ``supervisor``: rank 0's restarter of lost servers (None
        elsewhere); ``served_version``: the weights the servers hold (None: the model folder's)."""
        super().__init__(inputs, supervisor=supervisor, served_version=served_version)
        self.episodes = episodes

    def next_batch(self, step: int) -> StepRollout:
        """One round of episodes, or with ``dynamic_filter`` as many as it takes (``SyncRollout._rounds``)."""
        trajectories, rewards, metrics = self._rounds(step)
        return StepRollout([], rewards, metrics, trajectories=trajectories)

    def _round(self, step: int, round_idx: int = 0) -> EpisodeRound:
        """Rank 0 runs a round of samples as episodes; every rank gets the same trajectories."""
        samples = self.inputs.loader.next_rollout_batch()
        first_index = round_idx * len(samples)  # refill rounds of a step sample with seeds of their own

        def run() -> EpisodeRound | None:
            t0 = time.perf_counter()
            trajectories = generate_or_recover(
                self.supervisor, lambda: asyncio.run(self._episodes(step, samples, first_index))
            )
            if trajectories is None:
                return None  # servers lost: every rank recovers them, then the episodes are run again
            rewards = [t.episode_reward() for t in trajectories]
            return trajectories, rewards, {"rollout_time_s": time.perf_counter() - t0}

        while (out := run_on_rank0(run, f"agent episodes of step {step}")) is None:
            recover_servers(self.supervisor, self.inputs.weight_sync, self.served_version)
        return out

    async def _episodes(self, step: int, samples: Sequence[PromptSample], first_index: int) -> list[Trajectory]:
        """Rank 0: every sample as one episode, in the samples' order."""
        inputs = self.inputs
        assert inputs.client is not None  # rank 0 connected at setup
        limit = inputs.rollout.max_concurrent_rollouts
        seeds = [rollout_seed(inputs.seed, step, first_index + i) for i in range(len(samples))]
        async with open_proxy(self.episodes, inputs.client, inputs.sampling) as proxy:
            pending = asyncio.ensure_future(
                run_episodes(self.episodes, proxy, samples, seeds, asyncio.Semaphore(limit) if limit else None)
            )
            # Kill-and-resume drills stop here (in a thread: the episodes go on meanwhile); real runs pass at once.
            await asyncio.to_thread(drill_point, "rollout")
            trajectories = await pending
        if proxy.server_errors:  # servers were lost under some episodes: recover them and run the round again
            raise proxy.server_errors[0]
        return trajectories
