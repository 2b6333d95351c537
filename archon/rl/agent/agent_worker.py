"""Asynchronous agent rollouts: rounds of episodes generated ahead of training, within the staleness bound.

With ``rollout.workflow`` and ``rollout.max_head_offpolicyness = k > 0`` the trainer's ``AsyncRollout`` runs an
``AgentRolloutWorker``: the ``RolloutWorker`` of ``archon.rl.async_rollout`` (rounds in data order, submitted under
AReaL's capacity rule, checkpointed by rounds taken) whose round is the batch's samples run as agent episodes
(``archon.rl.agent.episodes``) instead of one completion each.  Round ``r`` seeds sample ``i`` with
``rollout_seed(seed, r + 1, i)``, as its single-turn rounds do, so that without the filter round ``r`` is what step
``r + 1`` of a synchronous run would run.

One recording proxy serves every round, on the rollout client's event loop; each turn goes through the worker's own
generation (``RolloutWorker._generate``), so an episode's turns follow the worker's weight updates as single-turn
requests do:

- with ``rollout.partial_rollout`` (default), a weight update pauses the servers; a turn in flight keeps its tokens
  and continues under the new weights ('retract') or is sent again with its tokens appended ('abort'), and a turn
  not yet sent waits until the servers hold the new weights.  An episode whose turns span an update is then a
  partial rollout: every sampled id carries the version that sampled it, the decoupled loss treats it per token, and
  its staleness is its first sampled id's (which the capacity rule bounds by ``k``, as for a completion);
- with ``partial_rollout = false`` an update waits until every episode in flight has ended, so each episode comes
  from one version (reproducible runs).

Agents' episodes score themselves (the workflow returns the reward); servers lost under an episode fail the round,
as a lost server fails a round of completions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from archon.data.rl_dataset import PromptLoader, PromptSample
from archon.rl.agent.episodes import EpisodeSpec, open_proxy, run_episodes
from archon.rl.agent.proxy import RecordingProxy
from archon.rl.agent.trajectory import Trajectory
from archon.rl.async_rollout import RolloutWorker, Round
from archon.rl.rollout_batch import Completion
from archon.rl.rollout_strategy import rollout_seed


class AgentRolloutWorker(RolloutWorker):
    """Rank 0's generator of rounds of agent episodes (``RolloutWorker``'s capacity, pauses and state)."""

    def __init__(self, client: Any, loader: PromptLoader, *, episodes: EpisodeSpec, **kwargs: Any):
        """``episodes``: how each sample runs; ``kwargs``: ``RolloutWorker``'s (``max_concurrency`` bounds the
        episodes in flight over every round, 0: no bound; ``score_fn`` is not used)."""
        self.max_episodes = int(kwargs.pop("max_concurrency", 0) or 0)
        # Requests are not bounded on their own: an episode holding a slot must be able to send its turns.
        super().__init__(client, loader, max_concurrency=0, **kwargs)
        self.episodes = episodes
        self._proxy: RecordingProxy | None = None
        self._slots: asyncio.Semaphore | None = None

    async def _astart(self) -> None:
        proxy = open_proxy(self.episodes, self.client, self.sampling, generate=self._generate_turn)
        self._proxy = await proxy.start()
        self._slots = asyncio.Semaphore(self.max_episodes) if self.max_episodes > 0 else None
        await super()._astart()

    async def _generate_turn(self, prompt: list[int], params: dict[str, Any]) -> tuple[Completion, str]:
        """One turn of an episode (the proxy's ``TurnGenerator``), held back while new weights load."""
        assert self._open is not None  # started
        if self.partial_rollout:
            # Without partial rollouts an update waits for the episodes in flight, so their turns must not wait.
            await self._open.wait()
        known = self.version
        completion = (await self._generate([prompt], [params]))[0]
        versions = completion.output_versions
        return completion, str(versions[-1] if versions else known)

    async def _generate_round(self, r: int, prompts: list[PromptSample]) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        assert self._proxy is not None  # started
        try:
            seeds = [rollout_seed(self.seed, r + 1, i) for i in range(len(prompts))]
            trajectories = await run_episodes(self.episodes, self._proxy, prompts, seeds, self._slots)
        finally:
            self._generating.pop(r, None)
        if self._proxy.server_errors:  # a lost server: no recovery while rounds run ahead, as for completions
            raise self._proxy.server_errors[0]
        return trajectories, time.perf_counter() - t0

    async def _score_round(self, r: int, prompts: list[PromptSample], gen: asyncio.Task) -> Round:
        trajectories: list[Trajectory]
        trajectories, gen_time = await gen
        rewards = [t.episode_reward() for t in trajectories]
        timing = {"rollout_time_s": gen_time, "reward_time_s": 0.0}
        return Round(r, prompts, [], rewards, timing, trajectories=trajectories)

    async def _aclose(self) -> None:
        await super()._aclose()
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
