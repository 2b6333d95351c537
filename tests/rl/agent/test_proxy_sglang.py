"""The recording proxy in front of SGLang's native ``/generate`` (the fake SGLang of ``tests/support``, which
samples as SGLang 0.5 does; no SGLang build runs on CPU): an episode's turns are the ids SGLang sampled for the
prompts the proxy sent, with the trainer's sampling pinned and each turn's own seed, and the versions SGLang
reports; the reference is the fake's model run directly on those prompts."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from fake_model import fake_completion
from fake_sglang import FakeSGLang
from hf_fixtures import make_tiny_tokenizer

from archon.rl.agent import RecordingProxy, Trajectory, run_episode
from archon.rl.agent.proxy import episode_turn_seed
from archon.rollout.client import RolloutClient

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3}


async def two_questions(sample: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = [{"role": "user", "content": "what is 1 + 2 ?"}]
    for follow_up in ("again ?", None):
        # The agent's own sampling fields are replaced by the trainer's (temperature 0 here would be greedy).
        resp = await client.chat.completions.create(model="policy", messages=messages, temperature=0.0)
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return 1.0


def test_episode_turns_are_what_sglang_sampled_for_the_recorded_prompts():
    server = FakeSGLang(deterministic=True, health_delay_s=0.0).start()
    client = RolloutClient([server.addr], retries=0)

    async def main() -> Trajectory:
        async with RecordingProxy(client, make_tiny_tokenizer(), sampling=SAMPLING) as proxy:
            return await run_episode(two_questions, {}, proxy, seed=11)

    try:
        traj = asyncio.run(main())
    finally:
        client.close()
        server.stop()
    assert traj.n_turns == 2 and traj.truncation is None
    prefix: list[int] = []
    for k, turn in enumerate(traj.turns):
        prompt = prefix + turn.context_ids
        ids, lps, finish = fake_completion(prompt, SAMPLING, seed=episode_turn_seed(11, k))
        assert turn.output_ids == ids and turn.finish_reason == finish["type"]
        assert turn.output_logprobs == pytest.approx(lps)
        assert turn.output_versions == [0] * len(ids)  # SGLang's version '0' for every token
        prefix = prompt + ids
    assert traj.ids() == prefix
