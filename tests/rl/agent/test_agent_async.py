"""Asynchronous agent rollouts (``rollout.workflow`` with ``rollout.max_head_offpolicyness > 0``) end to end, and the
dynamic filter over episodes: a built-in server, forked trainer ranks, two-turn episodes through the proxy.

References: at k = 0 the asynchronous loop runs the same episodes as the synchronous trainer (same seeds, weights);
with ``partial_rollout = false`` round ``r`` comes from version ``max(0, r - 1)``, which fixes the staleness of every
step; and whenever a sampled id is labelled with the version being trained, the trainer's logprob of it equals the
server's (the mismatch over fresh ids), which holds only if every id of every turn carries the version that sampled it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import openai
import pytest
from dist_utils import run_distributed
from rl_runs import _run, overrides, train_forced_async

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMINGS = ("_time_s", "_s", "peak_mem_gb")


PUBLISHED = threading.Condition()
"""Notified with ``PUBLISHED.count`` (versions the trainer of this process published) after each weight update."""
PUBLISHED.count = 0  # type: ignore[attr-defined]


async def two_turns(sample: dict[str, Any], client: openai.AsyncOpenAI, tool_s: float = 0.0) -> float:
    """Asks, replies as the user with the reference answer, asks again; rewarded by the characters it wrote.

    ``tool_s`` > 0: the reply is a slow tool that answers once the trainer published new weights (or after
    ``tool_s`` seconds: the round the trainer waits for would wait forever), so the turns span an update."""
    seen = PUBLISHED.count  # type: ignore[attr-defined]
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    if tool_s:

        def wait() -> None:
            with PUBLISHED:
                PUBLISHED.wait_for(lambda: PUBLISHED.count > seen, tool_s)  # type: ignore[attr-defined]

        await asyncio.to_thread(wait)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": f"the answer is {sample['answer']}"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(first.choices[0].message.content or "") + len(second.choices[0].message.content or ""))


async def parity(sample: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """One turn rewarded 1 when it wrote an even number of characters: many groups get equal rewards."""
    resp = await client.chat.completions.create(model="policy", messages=list(sample["messages"]), max_tokens=2)
    return float(len(resp.choices[0].message.content or "") % 2 == 0)


def _train_publishing(args: list[str]) -> list[dict] | None:
    """An asynchronous run whose training steps take 0.3 s more, counting its weight updates in ``PUBLISHED``."""
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    class Publishing(RLTrainer):
        def _prepare(self, batch):
            time.sleep(0.3)
            return super()._prepare(batch)

        def _build_rollout_strategy(self, *args, **kwargs) -> None:
            super()._build_rollout_strategy(*args, **kwargs)
            strategy = self._strategy()
            sync = strategy.sync_weights

            def counted(step: int) -> dict[str, float]:
                out = sync(step)
                with PUBLISHED:
                    PUBLISHED.count += 1  # type: ignore[attr-defined]
                    PUBLISHED.notify_all()
                return out

            strategy.sync_weights = counted  # type: ignore[method-assign]

    history = Publishing(load_config(None, args)).run()
    return history if dist.get_rank() == 0 else None


def _agent(model, data, out, workflow: str = "two_turns", backend: str = "archon:d1", **extra: Any) -> list[str]:
    settings: dict[str, Any] = {"rollout.workflow": f"{__name__}:{workflow}", "actor.use_decoupled_loss": True}
    return overrides(model, data, out, backend, **{**settings, **extra})


def test_k0_asynchronous_agent_rollout_equals_the_synchronous_one(rl_setup):
    model, data, root = rl_setup
    extra: dict[str, Any] = {"total_train_steps": 2, "actor.ppo_n_minibatches": 2}
    sync = _run(1, _agent(model, data, root / "ag_k0_sync", **extra))
    async0 = run_distributed(train_forced_async, 1, _agent(model, data, root / "ag_k0_async", **extra), timeout=600)[0]
    for s, a in zip(sync, async0):
        assert a["async/staleness_max"] == 0 and a["agent/turns_mean"] == 2.0
        for key in ("reward_mean", "reward_std", "response_len_mean", "n_samples", "agent/turns_mean"):
            assert a[key] == s[key], key
        for key, value in s.items():
            if isinstance(value, float) and not key.endswith(TIMINGS) and not key.startswith("weight_check/"):
                assert a[key] == pytest.approx(value, abs=1e-5), key


def test_asynchronous_agent_episodes_are_stale_by_the_bound_and_train_their_own_ids(rl_setup):
    model, data, root = rl_setup
    # Updates wait for the episodes in flight: round r comes from version max(0, r - 1).
    extra = {"rollout.max_head_offpolicyness": 1, "rollout.partial_rollout": False}
    history = _run(1, _agent(model, data, root / "ag_k1", **extra))
    assert [r["async/staleness_max"] for r in history] == [0, 1, 1]
    assert [r["async/partial_frac"] for r in history] == [0, 0, 0]  # each episode from one version
    assert all(r["agent/turns_mean"] == 2.0 and r["n_samples"] == 16 for r in history)
    # Step 1 trains version 0's episodes: both turns' ids are the ones sampled, so the logprobs agree.
    assert history[0]["mismatch/logprob_diff"] < 1e-5 and history[0]["behav_prox_logprob_diff"] < 1e-5
    assert history[1]["behav_prox_logprob_diff"] > 1e-3  # stale episodes: the policy moved since
    assert [r["async/data_position"] for r in history] == [4.0, 8.0, 12.0]


@pytest.mark.slow
def test_weight_updates_interrupt_agent_episodes_and_versions_follow_each_id(rl_setup):
    model, data, root = rl_setup
    k = 2
    # The tool between the turns answers after the next weight update: rounds running ahead span updates.
    extra = {"rollout.max_head_offpolicyness": k, "total_train_steps": 5, "rollout.workflow_kwargs": "{tool_s = 2.0}"}
    args = [a.replace('"{tool_s = 2.0}"', "{tool_s = 2.0}") for a in _agent(model, data, root / "ag_partial", **extra)]
    history = run_distributed(_train_publishing, 1, args, timeout=600)[0]
    measured = []
    for r in history:
        assert r["async/staleness_max"] <= k and r["agent/turns_mean"] == 2.0, r
        assert 0.0 <= r["async/token_staleness_mean"] <= r["async/staleness_mean"]
        if r.get("mismatch/logprob_diff") is not None:  # ids labelled with the version trained: the engines' difference
            assert r["mismatch/logprob_diff"] < 1e-5, r
            measured.append(r)
    # Episodes whose second turn came from newer weights than their first, and fresh ids measured after step 1.
    assert max(r["async/partial_frac"] for r in history) > 0
    assert any(r["step"] > 1 and r["async/staleness_max"] > 0 for r in measured), history


def test_dynamic_filter_keeps_episode_groups_whose_rewards_differ(rl_setup):
    model, data, root = rl_setup
    extra = {"dynamic_filter.enable": True, "dynamic_filter.max_num_gen_batches": 3, "total_train_steps": 2}
    history = _run(1, _agent(model, data, root / "ag_filter", "parity", **extra))
    assert any(r["dynamic_filter/rounds"] > 1 for r in history)  # equal-reward groups made the step draw again
    for r in history:
        assert r["n_samples"] == 16
        kept_and_dropped = 4 - r["dynamic_filter/taken_back_groups"] + r["dynamic_filter/dropped_groups"]
        assert kept_and_dropped + r["dynamic_filter/taken_back_groups"] <= 4 * r["dynamic_filter/rounds"]
        if r["dynamic_filter/taken_back_groups"] == 0:
            assert r["reward_std"] > 0
