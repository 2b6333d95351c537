"""MoE routing replay over agent episodes: the proxy records each turn's routed experts from a real built-in server,
and the trajectory's routing of every id equals the routing of one plain forward of the same weights over the
episode's ids (the reference), whatever turn's request first ran the id."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import openai
import pytest
import torch
from hf_fixtures import decoder, make_tiny_tokenizer, save_tiny_hf
from moe_refs import routing_of

import models
from archon.rl.agent import RecordingProxy, Trajectory, build_agent_batch, run_episode
from archon.rollout.client import BuiltinServerAPI, RolloutClient
from archon.server.app import serve_in_thread
from archon.server.generator import Generator
from archon.server.openai_api import load_tokenizer
from archon.server.weight_update import read_eos_token_ids
from models.common.args import MoEArgs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def three_questions(sample: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = []
    for k in range(3):
        messages.append({"role": "user", "content": f"what is {k} + {k} ?"})
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
    return 1.0


def test_episode_routing_equals_a_plain_forward_over_its_ids(tmp_path):
    folder = tmp_path / "moe"
    tok = make_tiny_tokenizer(folder)
    save_tiny_hf(folder, "qwen3_moe", seed=11, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    reference = models.load_hf_model(folder)
    n_layers, top_k = decoder(reference).args.n_layers, cast(MoEArgs, decoder(reference).args).top_k
    gen = Generator(models.load_hf_model(folder), eos_token_ids=read_eos_token_ids(folder), context_length=256)
    server = serve_in_thread(gen, model_path=str(folder))
    client = RolloutClient([server.url], api=BuiltinServerAPI(), retries=0)
    sampling = {"temperature": 1.0, "max_new_tokens": 4}

    async def main() -> Trajectory:
        proxy = RecordingProxy(client, load_tokenizer(folder), sampling=sampling, routed_experts=(n_layers, top_k))
        async with proxy:
            return await run_episode(three_questions, {}, proxy, seed=5)

    try:
        traj = asyncio.run(main())
    finally:
        client.close()
        server.stop()
    assert traj.n_turns == 3 and traj.truncation is None
    ids = traj.ids()
    routed = traj.routed_experts()
    assert routed.shape == (len(ids) - 1, n_layers, top_k)
    assert torch.equal(torch.as_tensor(routed).int(), routing_of(reference, ids[:-1]))
    batch = build_agent_batch([traj])
    assert torch.equal(batch["routed_experts"][0, : len(ids) - 1].int(), routing_of(reference, ids[:-1]))
