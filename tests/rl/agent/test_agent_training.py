"""RL on agent episodes end to end: ``rollout.workflow`` runs each sample as a two-turn chat through the recording
proxy, with a built-in server (``local:d1``) and forked trainer ranks, exactly as ``scripts/train_rl.py`` would.

The trainer recomputes the logprobs of the ids it trains with the weights that sampled them: they equal the
servers' behaviour logprobs only if every trained id is the id that was generated, in its place, turn after turn
(a re-tokenised transcript or a shifted turn would not match).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from rl_runs import _run, overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def two_turns(sample: dict[str, Any], client: openai.AsyncOpenAI, bonus: float = 0.0) -> float:
    """Asks, replies as the user with the reference answer, asks again; rewarded by the characters it wrote."""
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3, temperature=0.1)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": f"the answer is {sample['answer']}"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return len(first.choices[0].message.content or "") + len(second.choices[0].message.content or "") + bonus


def _agent_overrides(model, data, out, backend: str = "archon:d1", **extra: Any) -> list[str]:
    return overrides(
        model,
        data,
        out,
        backend,
        **{
            "rollout.workflow": f"{__name__}:two_turns",
            "rollout.workflow_kwargs": "{bonus = 0.5}",
            "total_train_steps": 2,
            "train_dataset.batch_size": 2,
            **extra,
        },
    )


def _kwargs_override(args: list[str]) -> list[str]:
    # overrides() quotes strings; the workflow's keyword arguments are a TOML inline table.
    return [a.replace('"{bonus = 0.5}"', "{bonus = 0.5}") for a in args]


def test_agent_episodes_train_on_the_ids_they_generated(rl_setup):
    model, data, root = rl_setup
    history = _run(1, _kwargs_override(_agent_overrides(model, data, root / "agent_d1")))
    for record in history:
        assert record["agent/turns_mean"] == 2.0 and record["agent/truncated_frac"] == 0.0, record
        # The trainer's logprobs of the recorded ids equal the servers' (both turns' sampled ids are trained).
        assert record["behav_prox_logprob_diff"] < 1e-5, record
        assert abs(record["actor/ratio_mean"] - 1.0) < 1e-5
        assert record["reward_mean"] >= 0.5  # the workflow got rollout.workflow_kwargs
        assert record["reward_std"] > 0 and record["actor/grad_norm"] > 0
        # Sampled ids of two turns: the first asked at most 3, the second up to gconfig.max_new_tokens (5).
        assert 2 <= record["response_len_mean"] <= 8


@pytest.mark.slow
def test_agent_runs_do_not_depend_on_the_allocation(rl_setup):
    model, data, root = rl_setup
    extra: dict[str, Any] = {"actor.ppo_n_minibatches": 2}
    d1 = _run(1, _kwargs_override(_agent_overrides(model, data, root / "agent_inv_d1", **extra)))
    d2 = _run(2, _kwargs_override(_agent_overrides(model, data, root / "agent_inv_d2", "archon:d2", **extra)))
    for key in ("actor/loss", "reward_mean", "actor/grad_norm", "actor/entropy", "response_len_mean"):
        a, b = [r[key] for r in d1], [r[key] for r in d2]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (key, a, b)
