"""The rollout strategies of agent workflows through the strategy interface, over a fake server whose answer to
each request encodes its sampling seed: the synchronous one recovers servers lost under episodes, the asynchronous
one at k = 0 runs the synchronous one's episodes, and a resumed asynchronous run continues with an uninterrupted
run's episodes (rounds in flight at the stop are run again, none twice)."""

from __future__ import annotations

import functools
from typing import Any, cast

import openai
from dist_utils import run_distributed
from fake_rollout import RecordingWeightSync, RestartingSupervisor, SeedEchoClient
from hf_fixtures import make_tiny_tokenizer

from archon.config import DynamicFilterConfig, RolloutConfig
from archon.data.rl_dataset import PromptLoader, RLPromptDataset
from archon.rl.agent.agent_rollout import AgentRollout
from archon.rl.agent.agent_worker import AgentRolloutWorker
from archon.rl.agent.episodes import EpisodeSpec
from archon.rl.agent.proxy import episode_turn_seed
from archon.rl.async_rollout import AsyncRollout
from archon.rl.rollout_strategy import RolloutInputs, RolloutStrategy, rollout_seed

SEED = 3
ROWS = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(4) for b in range(3)]


async def two_turns(sample: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again ?"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return float(sample["index"])


def _inputs(client: SeedEchoClient) -> RolloutInputs:
    tok = make_tiny_tokenizer()
    return RolloutInputs(
        loader=PromptLoader(RLPromptDataset(ROWS, tok), 2, seed=5, group_size=2),
        sampling={"max_new_tokens": 1},
        seed=SEED,
        n_samples=2,
        rollout=RolloutConfig(partial_rollout=False, workflow=f"{__name__}:two_turns", max_head_offpolicyness=0),
        dynamic_filter=DynamicFilterConfig(),
        weight_sync=cast(Any, RecordingWeightSync(client)),  # duck-typed fakes
        client=cast(Any, client),
        score=None,
    )


def _spec() -> EpisodeSpec:
    return EpisodeSpec(two_turns, make_tiny_tokenizer(), max_turns=4, max_total_tokens=256, timeout_s=60)


def _seeds(step: int, n: int = 4) -> list[list[int]]:
    """The seeds of each episode's two turns at ``step``."""
    return [[episode_turn_seed(rollout_seed(SEED, step, i), k) for k in range(2)] for i in range(n)]


def _batches(strategy: RolloutStrategy, first: int, last: int) -> list[tuple[list[list[int]], list[float]]]:
    """Each step's sampled ids per episode and rewards, publishing each step's weights."""
    out = []
    for step in range(first, last + 1):
        b = strategy.next_batch(step)
        assert b.trajectories is not None and not b.completions
        assert all(t.n_turns == 2 and t.truncation is None for t in b.trajectories)
        out.append(([[i for turn in t.turns for i in turn.output_ids] for t in b.trajectories], b.rewards))
        strategy.sync_weights(step)
    return out


def _recovered_episodes() -> tuple[list[list[int]], list[str], int, list[int]]:
    client = SeedEchoClient(failures=1)
    inputs = _inputs(client)
    supervisor = cast(Any, RestartingSupervisor(client))
    strategy = AgentRollout(inputs, episodes=_spec(), supervisor=supervisor, served_version="5")
    try:
        batch = strategy.next_batch(6)
    finally:
        client.close()
    assert batch.trajectories is not None
    ids = [[i for turn in t.turns for i in turn.output_ids] for t in batch.trajectories]
    weight_sync = cast(RecordingWeightSync, inputs.weight_sync)
    return ids, weight_sync.synced, weight_sync.rebuilds, client.seeds


def test_episodes_that_lost_their_server_are_run_again_after_it_gets_the_served_weights():
    ids, synced, rebuilds, seeds = run_distributed(_recovered_episodes, 1)[0]
    assert synced == ["5"] and rebuilds == 1  # the restarted server got the weights the servers held
    # Every episode was run again from its start, with the same seeds; none kept the failed attempt.
    assert ids == _seeds(6)
    assert sorted(seeds[-8:]) == sorted(s for pair in _seeds(6) for s in pair)


def _run(asynchronous: bool, steps: int, stop_after: int | None = None) -> list:
    """Steps 1..``steps`` of one strategy; with ``stop_after``, stopped then resumed from its checkpoint state."""
    batches: list = []
    resumed: dict[str, Any] = {}
    loader_state = None
    spans = [(1, steps)] if stop_after is None else [(1, stop_after), (stop_after + 1, steps)]
    for first, last in spans:
        client = SeedEchoClient()
        inputs = _inputs(client)
        if loader_state is not None:
            inputs.loader.load_state_dict(loader_state)
        if asynchronous:
            strategy: RolloutStrategy = AsyncRollout(
                inputs,
                start_step=first - 1,
                total_steps=steps,
                resumed=resumed,
                decoupled=True,
                make_worker=functools.partial(AgentRolloutWorker, episodes=_spec()),
            )
        else:
            supervisor = cast(Any, RestartingSupervisor(client))
            strategy = AgentRollout(inputs, episodes=_spec(), supervisor=supervisor, served_version=None)
        try:
            batches += _batches(strategy, first, last)
            resumed, loader_state = strategy.state_dict(), inputs.loader.state_dict()
        finally:
            strategy.close()
            client.close()
    return batches


def _strategies() -> dict[str, list]:
    return {"sync": _run(False, 3), "async": _run(True, 3), "full": _run(True, 4), "resumed": _run(True, 4, 2)}


def test_asynchronous_episodes_at_k0_and_after_a_resume_are_the_synchronous_and_uninterrupted_ones():
    out = run_distributed(_strategies, 1)[0]
    assert [ids for ids, _ in out["sync"]] == [_seeds(step) for step in (1, 2, 3)]
    assert out["async"] == out["sync"]
    assert out["resumed"] == out["full"] and out["full"][:3] == out["sync"]
