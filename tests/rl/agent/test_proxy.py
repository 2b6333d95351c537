"""The recording proxy between an agent written with the official ``openai`` client and a real built-in server:
the trajectory holds exactly the ids each request sent and the server sampled (checked against what the server
answered and against the same weights run directly), refused history rewrites, limits and failing workflows."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from generation_refs import greedy_reference, logprob_reference
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf

import models
from archon.data.encoding import encode_messages
from archon.rl.agent import ERROR, MAX_TOKENS, MAX_TURNS, RecordingProxy, Trajectory, run_episode
from archon.rollout.client import BuiltinServerAPI, GenerateResult, RolloutClient
from archon.server.app import serve_in_thread
from archon.server.generator import Generator
from archon.server.openai_api import load_tokenizer
from archon.server.weight_update import read_eos_token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 3  # <|im_end|> of make_tiny_tokenizer
WORDS = ["user", "assistant", "system", "tool", "tools", "call", "calc", "sep", ":", "+", "=", "?"]
WORDS += ["what", "is", "the", "answer", "again"] + [str(i) for i in range(100)] + [f"w{i}" for i in range(7)]
# Renders every message the same whatever follows it, with the tool names in a system preamble.
TEMPLATE = (
    "{% if tools %}<|im_start|>system tools : {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|> sep {% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> sep "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}
]
ATOL = 1e-5


class SpyClient(RolloutClient):
    """A RolloutClient that keeps every request's ids and the server's answer."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.calls: list[tuple[list[int], dict[str, Any], GenerateResult]] = []
        self.gate: threading.Event | None = None
        """When set, requests wait for it before they are sent (after setting ``arrived``)."""
        self.arrived = threading.Event()

    async def agenerate(self, input_ids, sampling_params, **kw) -> GenerateResult:
        if self.gate is not None:
            self.arrived.set()
            await asyncio.to_thread(self.gate.wait, 60)
        result = await super().agenerate(input_ids, sampling_params, **kw)
        self.calls.append((list(input_ids), dict(sampling_params), result))
        return result


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "model"
    save_tiny_hf(path, "qwen3", seed=7, eos_token_id=EOS)
    tok = make_tiny_tokenizer(vocab=WORDS)
    assert len(tok) == 128
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(folder: Path) -> Any:
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.nn.Module:
    return models.load_hf_model(folder)


@pytest.fixture(scope="module")
def client(folder: Path):
    gen = Generator(models.load_hf_model(folder), eos_token_ids=read_eos_token_ids(folder), context_length=256)
    server = serve_in_thread(gen, model_path=str(folder))
    spy = SpyClient([server.url], api=BuiltinServerAPI(), retries=0)
    yield spy
    spy.close()
    server.stop()


def _episode(client: SpyClient, tok: Any, workflow: Any, sample: dict[str, Any], **kw: Any) -> Trajectory:
    """``workflow`` run as one episode through a fresh proxy (the spy's calls cleared first)."""
    client.calls.clear()
    limits = {k: kw.pop(k) for k in ("max_turns", "max_total_tokens") if k in kw}

    async def main() -> Trajectory:
        async with RecordingProxy(client, tok, **limits) as proxy:
            return await run_episode(workflow, sample, proxy, **kw)

    return asyncio.run(main())


async def three_turns(
    sample: dict[str, Any], client: openai.AsyncOpenAI, answers: list[Any], messages: list[Any]
) -> list[float]:
    """user -> assistant -> tool result -> assistant -> user -> assistant, the way an agent author writes it."""
    messages.append({"role": "user", "content": sample["question"]})
    follow_ups = [{"role": "tool", "content": "3", "tool_call_id": "c0"}, {"role": "user", "content": "answer again ?"}]
    for k in range(3):
        resp = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
        )
        answers.append(resp.model_dump())
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        if k < 2:
            messages.append(follow_ups[k])
    return [0.0, 0.5, 1.0]


def test_three_turn_episode_records_exact_ids(client, tok, reference):
    answers: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    traj = _episode(client, tok, three_turns, {"question": "what is 1 + 2 ?"}, answers=answers, messages=messages)
    assert traj.truncation is None and traj.turn_rewards == [0.0, 0.5, 1.0] and traj.n_turns == 3
    assert len(client.calls) == 3
    # The first prompt is the chat template's render of the question (with the tools, generation prompt).
    question = [{"role": "user", "content": "what is 1 + 2 ?"}]
    assert client.calls[0][0] == encode_messages(tok, question, tools=TOOLS)
    expected: list[int] = []
    for k, ((prompt, params, result), turn, answer) in enumerate(zip(client.calls, traj.turns, answers)):
        # Each prompt is every id recorded so far plus the turn's context, then exactly the server's sampled ids.
        assert prompt[: len(expected)] == expected and prompt[len(expected) :] == turn.context_ids
        assert turn.output_ids == result.output_ids and turn.output_logprobs == result.output_logprobs
        assert params["max_new_tokens"] == 4 and params["temperature"] == 0
        # Independent reference: the same weights decoded greedily without the server.
        assert result.output_ids == greedy_reference(reference, prompt, 4, stop={EOS})
        ref_lps = logprob_reference(reference, prompt, result.output_ids, 1.0)
        assert torch.allclose(torch.tensor(turn.output_logprobs), ref_lps, atol=ATOL)
        choice = answer["choices"][0]
        assert choice["token_ids"] == result.output_ids and answer["prompt_token_ids"] == prompt
        assert choice["message"]["content"] == tok.decode(result.output_ids, skip_special_tokens=True)
        assert answer["weight_version"] == result.weight_version
        assert choice["finish_reason"] == ("stop" if result.output_ids[-1] == EOS else "length")
        assert turn.context[-1].role == ["prompt", "tool", "user"][k]
        expected = prompt + result.output_ids
    flat = traj.tokens()
    assert traj.ids() == flat.input_ids == expected
    sampled = [i for i, m in enumerate(flat.loss_mask) if m]
    starts = [len(p) for p, _, _ in client.calls]
    assert sampled == [s + j for s, (_, _, r) in zip(starts, client.calls) for j in range(len(r.output_ids))]
    assert [flat.logprobs[i] for i in sampled] == [x for _, _, r in client.calls for x in r.output_logprobs]
    assert all(flat.logprobs[i] == 0.0 for i, m in enumerate(flat.loss_mask) if not m)
    # Re-tokenising the conversation gives other ids (a sampled special token is not in the decoded text), so the
    # ids above are the recorded ones, not a re-render.
    assert encode_messages(tok, messages[:-1], tools=TOOLS) != client.calls[2][0]


async def rewrites_history(sample: dict[str, Any], client: openai.AsyncOpenAI, errors: list[str]) -> float:
    messages: list[Any] = [{"role": "user", "content": "what is 1 + 2 ?"}]
    resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2, temperature=0)
    messages.append({"role": "assistant", "content": (resp.choices[0].message.content or "") + " 5"})
    messages.append({"role": "user", "content": "again ?"})
    try:
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=2, temperature=0)
    except openai.BadRequestError as exc:
        errors.append(str(exc))
    messages[1] = resp.choices[0].message.model_dump(exclude_none=True)  # the history as answered is accepted
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2, temperature=0)
    return 1.0


def test_history_rewrite_is_refused(client, tok):
    errors: list[str] = []
    traj = _episode(client, tok, rewrites_history, {}, errors=errors)
    assert len(errors) == 1 and "message 1 (assistant) differs from the recorded conversation" in errors[0]
    assert traj.n_turns == 2 and traj.truncation is None and traj.reward == 1.0 and len(client.calls) == 2


async def chats(sample: dict[str, Any], client: openai.AsyncOpenAI, turns: int, max_tokens: int = 3) -> float:
    """``turns`` requests, each adding a user message; raises ``RuntimeError`` after them when asked."""
    messages: list[Any] = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"what is {k} ?"})
        resp = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=max_tokens, temperature=0
        )
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
    if sample.get("raise"):
        raise RuntimeError("the agent's tool broke")
    return 1.0


def test_max_turns_truncates(client, tok):
    traj = _episode(client, tok, chats, {}, turns=3, max_turns=2)
    # The third request was answered 400, which the workflow did not catch: the limit's reason wins.
    assert traj.truncation == MAX_TURNS and traj.n_turns == 2 and traj.reward == 0.0 and len(client.calls) == 2


def test_max_total_tokens_cuts_the_turn(client, tok):
    first = encode_messages(tok, [{"role": "user", "content": "what is 0 ?"}])
    assert EOS not in greedy_free_prefix(client, first, 2)
    traj = _episode(client, tok, chats, {}, turns=1, max_total_tokens=len(first) + 2, max_tokens=5)
    assert client.calls[0][1]["max_new_tokens"] == 2 and len(traj.turns[0].output_ids) == 2
    assert traj.truncation == MAX_TOKENS and traj.reward == 1.0 and traj.turns[0].finish_reason == "length"


def greedy_free_prefix(client: SpyClient, prompt: list[int], n: int) -> list[int]:
    """The server's greedy first ``n`` ids of ``prompt`` (to check the test's premise)."""
    return client.generate(prompt, {"max_new_tokens": n, "temperature": 0}).output_ids


def test_workflow_error_after_a_turn_is_recorded(client, tok):
    traj = _episode(client, tok, chats, {"raise": True}, turns=1)
    assert traj.truncation == ERROR and traj.reward == 0.0 and traj.n_turns == 1
    assert traj.turns[0].output_ids == client.calls[0][2].output_ids


def test_turn_in_flight_when_the_episode_closes_is_not_recorded(client, tok):
    """A workflow cancelled (timeout) mid-request: its episode is closed, and the answer that comes later is not
    recorded into the returned trajectory."""
    client.calls.clear()
    client.gate = gate = threading.Event()
    client.arrived.clear()

    async def main() -> tuple[Trajectory, str]:
        async with RecordingProxy(client, tok) as proxy:
            eid = proxy.open_episode()
            oai = openai.AsyncOpenAI(base_url=proxy.base_url(eid), api_key="unused", max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "what is 1 ?"}]
            request = asyncio.ensure_future(oai.chat.completions.create(model="p", messages=messages, max_tokens=2))
            assert await asyncio.to_thread(client.arrived.wait, 60)
            traj = proxy.close_episode(eid)
            gate.set()
            with pytest.raises(openai.BadRequestError) as info:
                await request
            await oai.close()
            return traj, str(info.value)

    try:
        traj, error = asyncio.run(main())
    finally:
        client.gate = None
    assert "the episode was closed while this request was generating" in error
    assert traj.n_turns == 0 and len(client.calls) == 1
