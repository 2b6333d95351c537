"""Partial rollouts on the built-in server: a request paused in retract mode across a weight update
continues with the new weights, and every token reports the version and the logprob of the
weights that produced it.

References recompute the whole sequence with each version's model (no KV cache, no engine).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from generation_refs import _Triggered, greedy_reference, logprob_reference
from hf_fixtures import random_tokens, save_tiny_hf

import models
from archon.rollout.server_api import token_versions
from archon.server.generator import GenerationRequest, Generator
from archon.server.protocol import generate_response
from archon.server.sampling import SamplingParams

ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    save_tiny_hf(root / "old", "qwen3", seed=21)
    save_tiny_hf(root / "new", "qwen3", seed=22)
    return models.load_hf_model(root / "old"), models.load_hf_model(root / "new")


def _request(prompt: list[int], n: int, temperature: float, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        prompt,
        SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True, sampling_seed=seed),
        return_logprob=True,
    )


def _interrupted(model, requests, after_forward: int, update=None):
    """Run ``requests`` together, retract them after forward call ``after_forward``, optionally run
    ``update`` (a weight update) while paused, resume; the results."""
    triggered = _Triggered(model)
    pausing: list = []
    fired = threading.Event()

    def pause() -> None:
        pausing.append(gen.pause("retract"))
        fired.set()

    triggered.triggers[after_forward] = pause
    with Generator(triggered) as gen:
        # Queued while paused, the requests are admitted together by one prefill (forward 1): the
        # forward counts below then mean the same tokens whatever the engine thread's timing.
        gen.pause().result(timeout=60)
        futures = [gen.submit(r) for r in requests]
        gen.resume()
        assert fired.wait(60)
        assert triggered.calls[0][0] == len(requests), triggered.calls  # one prefill for all of them
        pausing[0].result(timeout=60)
        stats = gen.stats()
        assert (stats["num_running_reqs"], stats["num_queued_reqs"]) == (0, len(requests))
        assert not any(f.done() for f in futures)  # retracted, not finished
        if update is not None:
            gen.run_exclusive(update, weight_version="1").result(timeout=60)
        gen.resume()
        return [f.result(timeout=60) for f in futures]


def test_retract_and_resume_without_an_update_changes_nothing(old_and_new):
    old, _ = old_and_new
    requests = [_request(random_tokens(5, 1), 10, 1.0, seed=3), _request(random_tokens(8, 2), 7, 0.0)]
    with Generator(old) as gen:
        alone = gen.generate(copy.deepcopy(requests))
    # Forward 1 is the prefill (one token each), 2..4 decode: 4 tokens each before the retract.
    again = _interrupted(old, copy.deepcopy(requests), after_forward=4)
    for a, b in zip(alone, again):
        assert a.output_ids == b.output_ids  # the request's own random stream goes on where it was
        assert a.output_logprobs is not None and b.output_logprobs is not None
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < ATOL
        assert b.weight_versions == [("default", 0, len(b.output_ids))] and b.weight_version == "default"


def test_a_weight_update_during_a_retract_is_a_partial_rollout(old_and_new):
    old, new = old_and_new
    p, q = random_tokens(5, 3), random_tokens(7, 4)
    requests = [_request(p, 10, 0.0), _request(q, 9, 1.0, seed=11)]

    def load_new(model) -> None:
        model.inner.load_state_dict(new.state_dict())

    results = _interrupted(copy.deepcopy(old), requests, after_forward=4, update=load_new)
    greedy, sampled = results
    for r, n in ((greedy, 10), (sampled, 9)):
        assert len(r.output_ids) == n
        # Tokens 0..3 came from the old weights, the rest from the new ones.
        assert r.weight_versions == [("default", 0, 4), ("1", 4, n)] and r.weight_version == "1"
    # Greedy: the old model's first 4 tokens, then the new model's continuation of that prefix.
    head = greedy_reference(old, p, 4)
    assert greedy.output_ids == head + greedy_reference(new, p + head, 6)
    # Each token's logprob is its own version's, recomputed over the whole sequence.
    for r, prompt, t in ((greedy, p, 1.0), (sampled, q, 1.0)):
        by_old = logprob_reference(old, prompt, r.output_ids, t)
        by_new = logprob_reference(new, prompt, r.output_ids, t)
        expected = torch.cat([by_old[:4], by_new[4:]])
        assert torch.allclose(torch.tensor(r.output_logprobs), expected, atol=ATOL)
        assert (by_old[4:] - by_new[4:]).abs().max() > 1e-2  # the versions really differ there
    # The HTTP answer carries SGLang's spans, and the client expands them per token.
    meta = generate_response(sampled)["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": 4},
        {"version": "1", "start": 4, "end": 9},
    ]
    assert token_versions(meta, 9) == ["default"] * 4 + ["1"] * 5


def test_token_versions_follow_sglang_spans_or_fall_back_to_the_answer_version():
    # SGLang 0.5.x: spans (objects, or msgspec's arrays); older servers: only weight_version.
    assert token_versions(
        {
            "weight_version": "3",
            "weight_versions": [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}],
        },
        5,
    ) == ["2", "2", "3", "3", "3"]
    assert token_versions({"weight_version": "3", "weight_versions": [["2", 0, 1], ["3", 1, 3]]}, 3) == ["2", "3", "3"]
    assert token_versions({"weight_version": "7"}, 3) == ["7"] * 3
    assert token_versions({"weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 0}]}, 0) == []
