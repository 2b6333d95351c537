"""The rollout strategies (``archon.rl.rollout_strategy``, ``archon.rl.async_rollout``) through their common
interface, built from explicit inputs (no trainer) over a fake server whose answers encode each sampling seed.

The whole RL loop with either strategy is tested end to end in ``test_trainer.py`` and ``test_async_trainer.py``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

from dist_utils import run_distributed
from hf_fixtures import make_tiny_tokenizer

from archon.config import DynamicFilterConfig, RolloutConfig
from archon.data.rl_dataset import PromptLoader, RLPromptDataset
from archon.launch.recovery import Recovery
from archon.rl.async_rollout import AsyncRollout
from archon.rl.rollout_strategy import RolloutInputs, RolloutStrategy, SyncRollout, rollout_seed
from archon.rollout.client import RolloutError
from archon.rollout.server_api import GenerateResult

SEED = 3
ROWS = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(4) for b in range(3)]


class _SeedEchoClient:
    """A rollout client whose 'server' answers each request with its sampling seed as the only token,
    tagged with the weight version it holds; ``failures`` first calls raise ``RolloutError``."""

    def __init__(self, failures: int = 0) -> None:
        self.version = "default"
        self.failures = failures
        self.up_addrs = ["fake"]
        self.lost: list[str] = []
        """Servers a failed call lost (the supervisor's ``down`` list)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def agenerate_many(self, prompts, params, **_: Any) -> list[GenerateResult]:
        if self.failures:
            self.failures -= 1
            self.lost.append("fake")
            raise RolloutError("the only server went away")
        return [
            GenerateResult(
                [p["sampling_seed"]], [-1.0], "stop", len(ids), self.version, "fake", output_versions=[self.version]
            )
            for ids, p in zip(prompts, params)
        ]

    async def apause_generation(self, mode=None) -> None:
        pass

    async def acontinue_generation(self) -> None:
        pass

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _RecordingWeightSync:
    """Every version sent (the fake server then holds it) and every re-formed group."""

    def __init__(self, client: _SeedEchoClient) -> None:
        self.client = client
        self.synced: list[str] = []
        self.rebuilds = 0

    def sync(self, version: str, servers_quiet: bool = False) -> dict[str, float]:
        self.synced.append(version)
        self.client.version = version
        return {"weight_sync_time_s": 0.0}

    def rebuild(self) -> None:
        self.rebuilds += 1


class _RestartingSupervisor:
    """Restarts every server the client failed on."""

    def __init__(self, client: _SeedEchoClient) -> None:
        self.client = client
        self.down = client.lost

    def lost(self) -> list[str]:
        return list(self.down)

    def can_restart(self, lost: list[str]) -> bool:
        return True

    def recover(self) -> Recovery:
        restarted = list(self.down)
        self.down.clear()
        return Recovery(restarted=restarted)


def _reward(seed: int, filtered: bool) -> float:
    # 0 or 1 for the dynamic filter: a group of two samples (seeds 7919 apart) has equal rewards a third of the time.
    return float(seed % 3 == 0) if filtered else float(seed % 10)


def _inputs(client: _SeedEchoClient, weight_sync: _RecordingWeightSync, filtered: bool = False) -> RolloutInputs:
    """``filtered``: the dynamic filter on (up to 3 rounds a step), rewards of 0 or 1."""
    loader = PromptLoader(RLPromptDataset(ROWS, make_tiny_tokenizer()), 2, seed=5, group_size=2)
    return RolloutInputs(
        loader=loader,
        sampling={"max_new_tokens": 1},
        seed=SEED,
        n_samples=2,
        rollout=RolloutConfig(partial_rollout=False),
        dynamic_filter=DynamicFilterConfig(enable=filtered, max_num_gen_batches=3),
        weight_sync=cast(Any, weight_sync),  # duck-typed fakes
        client=cast(Any, client),
        score=lambda prompts, completions: [_reward(c.output_ids[0], filtered) for c in completions],
    )


def _drive(strategy: RolloutStrategy, steps: int) -> list[tuple[list[int], list[float], int | None, list[int]]]:
    """Each step's (tokens, rewards, fresh version, token versions), publishing each step's weights."""
    batches = []
    for step in range(1, steps + 1):
        b = strategy.next_batch(step)
        versions = [v for c in b.completions for v in (c.output_versions or [])]
        batches.append(([c.output_ids[0] for c in b.completions], b.rewards, b.fresh_version, versions))
        strategy.sync_weights(step)
    return batches


def _both_strategies(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("sync", "async"):
        client = _SeedEchoClient()
        weight_sync = _RecordingWeightSync(client)
        inputs = _inputs(client, weight_sync)
        if name == "sync":
            supervisor = cast(Any, _RestartingSupervisor(client))
            strategy: RolloutStrategy = SyncRollout(inputs, supervisor=supervisor, served_version=None)
        else:  # k = 0 through the asynchronous machinery, each round generated by one version
            strategy = AsyncRollout(inputs, start_step=0, total_steps=steps, resumed={}, decoupled=True)
        try:
            out[name] = (_drive(strategy, steps), weight_sync.synced, strategy.state_dict(), strategy.off_policy)
        finally:
            strategy.close()
            client.close()
    return out


def test_both_strategies_give_the_same_batches_with_the_seeds_of_the_step_and_sample():
    steps = 3
    out = run_distributed(_both_strategies, 1, steps)[0]
    sync, synced, state, off_policy = out["sync"]
    # Each step's requests carry the seeds of that step and sample index only.
    assert [tokens for tokens, *_ in sync] == [[rollout_seed(SEED, s, i) for i in range(4)] for s in range(1, 4)]
    assert [fresh for *_, fresh, _ in sync] == [None] * steps and not off_policy and state == {}
    assert synced == ["1", "2", "3"]
    a_batches, a_synced, a_state, a_off_policy = out["async"]
    assert [b[:2] for b in a_batches] == [b[:2] for b in sync]  # same tokens and rewards
    # Step s trains version s - 1, which generated every token of its batch (k = 0).
    assert [b[2] for b in a_batches] == [0, 1, 2] and a_off_policy
    assert [set(b[3]) for b in a_batches] == [{0}, {1}, {2}]  # the server's 'default' is version 0
    assert a_synced == ["1", "2", "3"] and a_state == {"async_rollout": {"rounds_taken": steps}}


def _recovered_rollout() -> tuple[list[int], list[str], int]:
    client = _SeedEchoClient(failures=1)
    weight_sync = _RecordingWeightSync(client)
    strategy = SyncRollout(
        _inputs(client, weight_sync), supervisor=cast(Any, _RestartingSupervisor(client)), served_version="5"
    )
    try:
        batch = strategy.next_batch(6)
    finally:
        client.close()
    return [c.output_ids[0] for c in batch.completions], weight_sync.synced, weight_sync.rebuilds


def test_a_rollout_that_lost_its_servers_is_repeated_after_they_get_the_served_weights():
    tokens, synced, rebuilds = run_distributed(_recovered_rollout, 1)[0]
    # The restarted server got the version the servers held before the rollout, then the same requests.
    assert synced == ["5"] and rebuilds == 1
    assert tokens == [rollout_seed(SEED, 6, i) for i in range(4)]


def _resumed_run(steps: int, stop_after: int) -> tuple[list, list, dict[str, Any]]:
    """An asynchronous run of ``steps`` steps with the dynamic filter, and one stopped after ``stop_after`` and
    resumed from its state (returned too)."""
    runs = []
    for stops in ([], [stop_after]):
        batches: list = []
        resumed: dict[str, Any] = {}
        loader_state = None
        for first, last in zip([0, *stops], [*stops, steps]):
            client = _SeedEchoClient()
            inputs = _inputs(client, _RecordingWeightSync(client), filtered=True)
            if loader_state is not None:
                inputs.loader.load_state_dict(loader_state)
            strategy = AsyncRollout(inputs, start_step=first, total_steps=steps, resumed=resumed, decoupled=True)
            try:
                for step in range(first + 1, last + 1):
                    batch = strategy.next_batch(step)
                    batches.append([c.output_ids[0] for c in batch.completions])
                    strategy.sync_weights(step)
                if last == stop_after:
                    resumed, loader_state = strategy.state_dict(), inputs.loader.state_dict()
            finally:
                strategy.close()
                client.close()
        runs.append(batches)
    return runs[0], runs[1], resumed


def test_a_resumed_asynchronous_strategy_continues_with_the_rounds_of_an_uninterrupted_one():
    full, resumed, state = run_distributed(_resumed_run, 1, 4, 2)[0]
    # Refill rounds make the rounds taken differ from the steps: the checkpointed count is what resumes.
    assert state["async_rollout"]["rounds_taken"] > 2
    assert resumed == full
