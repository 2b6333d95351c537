"""Where the RL loop's batches come from: the rollout strategy interface, and the synchronous strategy.

The trainer (``archon.rl.trainer``) builds one strategy at setup and calls only this interface:
``SyncRollout`` (``rollout.max_head_offpolicyness = 0``) generates each step's batch when the step
asks for it, with the weights the previous step published; ``AsyncRollout``
(``archon.rl.async_rollout``, ``> 0``) keeps generating while the ranks train.  A strategy is given
what it works with (``RolloutInputs``), never the trainer.

Every method is collective: every training rank calls it in the same order.  Rank 0 talks to the
rollout servers and the reward workers and broadcasts what it got, so every rank holds the whole
batch.  Sampling seeds depend only on ``seed``, the step and the sample's index (``rollout_seed``),
so a run does not depend on the allocation and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from archon.config import DynamicFilterConfig, RolloutConfig
from archon.data.rl_dataset import PromptLoader
from archon.rl.dynamic_filter import collect_mixed_groups
from archon.rl.rank0 import run_on_rank0
from archon.rl.rollout_batch import Completion, routed_experts_array
from archon.rl.scoring import ScoreFn
from archon.rl.server_recovery import generate_or_recover, recover_servers, sync_with_recovery
from archon.runtime.drill import drill_point

if TYPE_CHECKING:
    from archon.launch.recovery import ServerSupervisor
    from archon.rl.agent.trajectory import Trajectory
    from archon.rollout.client import RolloutClient
    from archon.rollout.weight_sync import WeightSync

_SEED_MOD = 2**31 - 1


def rollout_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of sample ``index`` of RL step ``step``: a function of these only."""
    return (seed * 1_000_003 + step * 65_537 + index * 7_919 + 12_345) % _SEED_MOD


@dataclass
class RolloutInputs:
    """What either strategy generates from and publishes weights through; the trainer builds it at setup."""

    loader: PromptLoader
    """The run's prompts in data order; its position (checkpointed) counts the rounds that steps took."""
    sampling: dict[str, Any]
    """The servers' sampling parameters (each sample adds its ``sampling_seed``)."""
    seed: int
    """The run's seed, from which every sampling seed derives (``rollout_seed``)."""
    n_samples: int
    """Samples per prompt (``gconfig.n_samples``): the dynamic filter's group size."""
    rollout: RolloutConfig
    """The ``rollout`` config section (concurrency, off-policyness, pauses)."""
    dynamic_filter: DynamicFilterConfig
    """The ``dynamic_filter`` config section."""
    weight_sync: WeightSync
    """Every rank's side of publishing new weights to the servers."""
    client: RolloutClient | None
    """Rank 0's client of the rollout servers; None on the other ranks."""
    score: ScoreFn | None
    """Rank 0's rewards of a round; None on the other ranks."""


@dataclass
class StepRollout:
    """One step's batch, the same on every rank."""

    completions: list[Completion]
    """The completions to train on (each prompt's ``n_samples`` in a row)."""
    rewards: list[float]
    """One reward per completion."""
    metrics: dict[str, float]
    """``rollout_time_s``, ``reward_time_s`` and the strategy's own (dynamic filter, staleness)."""
    fresh_version: int | None = None
    """The policy version the step trains, when tokens carry their versions: its tokens are the train/inference
    mismatch's.  None: the weights trained generated every token."""
    trajectories: list[Trajectory] | None = None
    """Agent episodes (``archon.rl.agent``), in place of ``completions``: the batch is their recorded ids, and
    ``rewards`` are their episode rewards."""


class RolloutStrategy(ABC):
    """How the RL loop gets each step's batch and publishes each step's weights."""

    off_policy: bool
    """Whether batches may come from older policy versions (rollout runs ahead of training): the step then
    reports the behaviour-to-proximal ratio statistics."""

    @abstractmethod
    def next_batch(self, step: int) -> StepRollout:
        """Collective: the batch step ``step`` trains on."""

    @abstractmethod
    def sync_weights(self, step: int) -> dict[str, float]:
        """Collective: give the servers the policy after step ``step`` (version ``step``); the sync's metrics."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Entries of the checkpoint's extra state; a resumed run passes them back to the strategy it builds."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the strategy started; called before the client it sends through is closed."""


class SyncRollout(RolloutStrategy):
    """Each step generates and scores its batch with the weights just published, recovering lost servers."""

    off_policy = False

    def __init__(
        self,
        inputs: RolloutInputs,
        *,
        supervisor: ServerSupervisor | None,
        served_version: str | None,
        routed_experts: tuple[int, int] | None = None,
    ):
        """``supervisor``: rank 0's restarter of lost servers (None elsewhere); ``served_version``: the weights
        the servers hold (None: the model folder's); ``routed_experts``: the actor's ``(n_layers, top_k)``
        when the servers return the experts each token was routed to (``actor.moe_routing_replay``)."""
        self.inputs = inputs
        self.supervisor = supervisor
        self.served_version = served_version
        self.routed_experts = routed_experts

    def next_batch(self, step: int) -> StepRollout:
        completions, rewards, metrics = self._rounds(step)
        return StepRollout(completions, rewards, metrics)

    def _rounds(self, step: int) -> tuple[list[Any], list[float], dict[str, float]]:
        """One rollout round (``_round``), or with ``dynamic_filter`` as many as it takes
        (``archon.rl.dynamic_filter``)."""
        dyn = self.inputs.dynamic_filter
        if not dyn.enable:
            return self._round(step)
        return collect_mixed_groups(
            lambda round_idx: self._round(step, round_idx),
            group_size=self.inputs.n_samples,
            max_rounds=dyn.max_num_gen_batches,
        )

    def _round(self, step: int, round_idx: int = 0) -> tuple[list[Any], list[float], dict[str, float]]:
        """Rank 0 generates and scores; every rank gets the same completions and rewards."""
        inputs = self.inputs
        prompts = inputs.loader.next_rollout_batch()
        first_index = round_idx * len(prompts)  # refill rounds of a step sample with seeds of their own

        def generate_and_score() -> tuple[list[Completion], list[float], dict[str, float]] | None:
            t0 = time.perf_counter()
            params = [
                {**inputs.sampling, "sampling_seed": rollout_seed(inputs.seed, step, first_index + i)}
                for i in range(len(prompts))
            ]

            def generate() -> list:
                client = inputs.client
                assert client is not None  # rank 0 connected at setup
                pending = client.submit(
                    client.agenerate_many(
                        [p.input_ids for p in prompts],
                        params,
                        max_concurrency=inputs.rollout.max_concurrent_rollouts,
                        return_routed_experts=self.routed_experts is not None,
                    )
                )
                drill_point("rollout")  # kill-and-resume drills stop here, requests in flight
                return client.result(pending)

            results = generate_or_recover(self.supervisor, generate)
            if results is None:
                return None  # servers lost: every rank recovers them, then the rollout is repeated
            shape = self.routed_experts
            completions = [
                Completion(
                    p.input_ids,
                    r.output_ids,
                    r.output_logprobs,
                    r.finish_reason,
                    routed_experts_array(r.routed_experts, *shape) if shape is not None else None,
                )
                for p, r in zip(prompts, results)
            ]
            t1 = time.perf_counter()
            assert inputs.score is not None  # rank 0 started the reward workers at setup
            rewards = inputs.score(prompts, completions)
            timing = {"rollout_time_s": t1 - t0, "reward_time_s": time.perf_counter() - t1}
            return completions, rewards, timing

        while (out := run_on_rank0(generate_and_score, f"rollout of step {step}")) is None:
            recover_servers(self.supervisor, self.inputs.weight_sync, self.served_version)
        return out

    def sync_weights(self, step: int) -> dict[str, float]:
        """Recover servers lost during the step, then sync (``archon.rl.server_recovery``)."""
        stats = sync_with_recovery(self.supervisor, self.inputs.weight_sync, str(step))
        self.served_version = str(step)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {}  # each step starts afresh from the data position the trainer checkpoints

    def close(self) -> None:
        pass  # nothing runs between steps
