"""The built-in server's OpenAI API (``/v1/completions``, ``/v1/chat/completions``) driven by the official
``openai`` client, and request validation on every endpoint.

Expected tokens and logprobs come from the same weights loaded separately and run without KV cache
(``generation_refs``); expected chat prompts from the template rendered by hand and tokenized.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from dist_utils import find_free_port
from generation_refs import greedy_reference, logprob_reference
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from server_utils import REPO, start_server

import models
from archon.server.app import RunningServer, parse_args, serve_in_thread
from archon.server.generator import Generator
from archon.server.openai_api import load_tokenizer
from archon.server.protocol import MAX_JSON_DEPTH
from archon.server.weight_update import read_eos_token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 3  # <|im_end|> of make_tiny_tokenizer
ATOL = 1e-5
# Every id of the 128-token model decodes to a word ("\n" left out: whitespace splitting would drop it on re-encoding).
WORDS = ["user", "assistant", "system", "tool", "+", "=", "?", "what", "is", "the", "answer", "calc"]
WORDS += [str(i) for i in range(100)] + [f"w{i}" for i in range(12)]
# Like make_tiny_tokenizer's template, plus the tool names, so the test sees that tools reach the template.
TEMPLATE = (
    "{% if tools %}<|im_start|>system {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|im_end|> "
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oai") / "model"
    save_tiny_hf(path, "qwen3", seed=41, eos_token_id=EOS)
    tok = make_tiny_tokenizer(vocab=WORDS)
    assert len(tok) == 128
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(folder: Path):
    model = models.load_hf_model(folder)
    gen = Generator(model, eos_token_ids=read_eos_token_ids(folder), random_seed=0, context_length=64)
    server = serve_in_thread(gen, model_path=str(folder), tokenizer=load_tokenizer(folder))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.nn.Module:
    return models.load_hf_model(folder)


@pytest.fixture(scope="module")
def tok(folder: Path) -> Any:
    return load_tokenizer(folder)


@pytest.fixture
def client(served: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _check_text(tok: Any, text: str, ids: list[int]) -> None:
    """``text`` is the decoding of ``ids`` and encodes back to them (special tokens aside)."""
    plain = [t for t in ids if t not in tok.all_special_ids]
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == plain


def test_completion_greedy_matches_reference(client, reference, tok):
    prompt = tok.encode("what is 3 + 4 ?")
    resp = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0, extra_body={"return_token_ids": True}
    ).model_dump()
    choice = resp["choices"][0]
    expected = greedy_reference(reference, prompt, 6, stop={EOS})
    assert choice["token_ids"] == expected and choice["prompt_token_ids"] == prompt
    assert choice["finish_reason"] == ("stop" if expected[-1] == EOS else "length")
    _check_text(tok, choice["text"], expected)
    lps = choice["logprobs"]["token_logprobs"]
    assert torch.allclose(torch.tensor(lps), logprob_reference(reference, prompt, expected, 1.0), atol=ATOL)
    tokens = choice["logprobs"]["tokens"]
    assert "".join(tokens) == choice["text"] and len(tokens) == len(expected)
    assert [choice["text"][o : o + len(t)] for o, t in zip(choice["logprobs"]["text_offset"], tokens)] == tokens
    assert resp["object"] == "text_completion" and resp["model"] == "tiny" and resp["weight_version"] == "default"
    usage = {k: resp["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt) + len(expected),
    }


def test_completion_text_prompt_sampled_with_seed(client, reference, tok):
    text = "the answer is 7 + 5"
    kwargs: dict[str, Any] = dict(model="tiny", prompt=text, max_tokens=5, temperature=0.8, logprobs=0, seed=11)
    pair = client.completions.create(n=2, **kwargs).model_dump()
    second = client.completions.create(**{**kwargs, "seed": 12}).model_dump()
    prompt = tok.encode(text)
    # Choice i is sampled with seed + i, so the second choice equals a single request with seed 12.
    assert pair["choices"][1]["token_ids"] == second["choices"][0]["token_ids"]
    for choice in pair["choices"]:
        assert choice["prompt_token_ids"] == prompt
        ids = choice["token_ids"]
        _check_text(tok, choice["text"], ids)
        expected = logprob_reference(reference, prompt, ids, 0.8)
        assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=ATOL)


def test_chat_multi_turn_with_tools(client, reference, tok):
    messages = [
        {"role": "system", "content": "what is the answer"},
        {"role": "user", "content": "3 + 4 = ?"},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "tool", "content": "7"},
    ]
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,  # pyright: ignore[reportArgumentType]
        tools=TOOLS,  # pyright: ignore[reportArgumentType]
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
    ).model_dump()
    rendered = "<|im_start|>system calc <|im_end|> " + "".join(
        f"<|im_start|>{m['role']} {m['content']}<|im_end|> " for m in messages
    )
    prompt = tok.encode(rendered + "<|im_start|>assistant ", add_special_tokens=False)
    assert resp["prompt_token_ids"] == prompt
    choice = resp["choices"][0]
    expected = greedy_reference(reference, prompt, 5, stop={EOS})
    assert choice["token_ids"] == expected
    assert choice["message"]["role"] == "assistant"
    _check_text(tok, choice["message"]["content"], expected)
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"] and len(content) == len(expected)
    ref = logprob_reference(reference, prompt, expected, 1.0)
    assert torch.allclose(torch.tensor([c["logprob"] for c in content]), ref, atol=ATOL)
    assert resp["object"] == "chat.completion" and resp["weight_version"] == "default"
    assert resp["usage"]["prompt_tokens"] == len(prompt)


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": [1, 128]}, "/v1/completions: prompt[1] = 128 is outside the vocabulary [0, 128)"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt[1] = -1 is outside the vocabulary"),
    ("/v1/completions", {"prompt": [1], "stop_token_ids": [500]}, ": stop_token_ids[0] = 500 is outside the vocab"),
    ("/v1/completions", {"prompt": [1], "temperature": -0.5}, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": [1], "top_p": 0}, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": [1], "top_p": 1.5}, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": [1], "max_tokens": -1}, "max_tokens must be a non-negative integer"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 64}, "lower max_tokens to at most 63"),
    ("/v1/completions", {"prompt": [1], "n": 0}, "n must be an integer >= 1"),
    ("/v1/completions", {"prompt": [1], "logprobs": 3}, "logprobs = 3 is not supported; send 0"),
    ("/v1/completions", {"prompt": [1], "seed": 2**70}, "seed must be an integer below 2**63"),
    ("/v1/completions", {"prompt": [1], "temperature": "hot"}, "temperature must be a finite number"),
    ("/v1/completions", {"prompt": [1], "stream": True}, "stream = True is not supported"),
    ("/v1/completions", {"prompt": [1], "logit_bias": {"5": 1}}, "logit_bias = {'5': 1} is not supported"),
    ("/v1/completions", {"prompt": [1], "bogus": 1}, "unknown field 'bogus'"),
    ("/v1/completions", {"prompt": [[1], [2]]}, "send one prompt per request"),
    ("/v1/completions", {"prompt": True}, "prompt must be a string or a non-empty list of token ids"),
    ("/v1/completions", {"prompt": [1] * 65, "max_tokens": 0}, "is longer than the context length 64"),
    ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role = 'robot' must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}, "tools[0] must"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}, "top_logprobs = 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "top_p": -1}, "top_p must be in"),
    ("/generate", {"input_ids": [1, 200]}, "input_ids[1] = 200 is outside the vocabulary"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "stop_token_ids": [128]}}, "= 128 is"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 10**400}}, "temperature must be a finite"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 100}}, "exceeds the context length 64"),
    ("/init_weights_update_group", {**dict(master_address="127.0.0.1", master_port=1), "backend": "mpi"}, "'mpi'"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_REQUESTS, ids=[f"{p}:{m[:30]}" for p, _, m in BAD_REQUESTS])
def test_bad_request_answers_400_then_serves(served, path, body, message):
    if path.startswith("/v1"):
        body = {"model": "tiny", **body}
    if path == "/init_weights_update_group":
        body = {**body, "rank_offset": 1, "world_size": 2}
    status, answer = _post(served.url, path, body)
    assert status == 400, answer
    text = answer["message"] if "success" in answer else answer["error"]["message"]
    assert message in text and text.count(". ") == 0, text  # one sentence
    status, good = _post(served.url, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
    assert status == 200 and len(good["choices"][0]["token_ids"]) == 1


def test_deep_nesting_answers_400(served):
    for body in (b"[" * 100_000 + b"]" * 100_000, json.dumps({"prompt": [0], "x": _nest(40)}).encode()):
        for path in ("/v1/completions", "/generate"):
            status, answer = _post(served.url, path, body)
            assert status == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in answer["error"]["message"]


def _nest(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def test_models_lists_the_served_folder(client, folder):
    assert [m.id for m in client.models.list()] == [str(folder)]


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[999], max_tokens=1)


def test_text_needs_a_tokenizer_and_bodies_are_capped(folder):
    gen = Generator(models.load_hf_model(folder), random_seed=0, context_length=64)
    server = serve_in_thread(gen, model_path=str(folder), max_request_mb=0.01)  # no tokenizer: token ids only
    try:
        status, answer = _post(server.url, "/v1/completions", {"model": "m", "prompt": [1] * 5000})
        assert status == 413 and "more than the server's limit" in answer["error"]["message"]
        status, answer = _post(server.url, "/v1/completions", {"model": "m", "prompt": "what is", "max_tokens": 1})
        assert status == 400 and "a text prompt needs a tokenizer" in answer["error"]["message"]
        chat = {"model": "m", "messages": [{"role": "user", "content": "1"}]}
        status, answer = _post(server.url, "/v1/chat/completions", chat)
        assert status == 400 and "needs a tokenizer with a chat template" in answer["error"]["message"]
        status, good = _post(server.url, "/v1/completions", {"model": "m", "prompt": [5], "max_tokens": 2})
        assert status == 200 and good["choices"][0]["text"] == "" and len(good["choices"][0]["token_ids"]) == 2
    finally:
        server.stop()


def test_unreachable_weight_group_answers_400_at_once(served):
    closed = find_free_port()  # nothing listens there
    for address, port, why in [("127.0.0.1", closed, "nothing accepts connections"), ("no-such-host.invalid", 80, "")]:
        body = dict(master_address=address, master_port=port, rank_offset=1, world_size=2, backend="gloo")
        start = time.monotonic()
        status, answer = _post(served.url, "/init_weights_update_group", body)
        # Without the probe the rendezvous dials for the group timeout (600 s).
        assert status == 400 and time.monotonic() - start < 30, answer
        assert answer["success"] is False and why in answer["message"] and address in answer["message"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port 70000 is not a TCP port"),
        (["--port", "-1"], "--port -1 is not a TCP port"),
        (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
        (["--context-length", "-5"], "--context-length must be >= 1"),
        (["--max-request-mb", "-1"], "--max-request-mb must be a positive"),
        (["--port", "abc"], "invalid int value: 'abc'"),
    ],
)
def test_bad_cli_args_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_command_line_server_loads_the_tokenizer(folder, tok):
    """``python -m archon.server.app`` serves text with the folder's tokenizer; only ids with --skip-tokenizer-init."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "what is 3"}], "max_tokens": 2, "temperature": 0}
    for extra, status in [((), 200), (("--skip-tokenizer-init",), 400)]:
        server = start_server(folder, "--context-length", "64", *extra)
        try:
            got, answer = _post(server.url, "/v1/chat/completions", chat)
            assert got == status, answer
            if status == 200:
                ids = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
                assert answer["prompt_token_ids"] == tok.encode(ids, add_special_tokens=False)
        finally:
            server.stop()


def test_bad_cli_arg_in_a_real_process():
    cmd = [sys.executable, "-m", "archon.server.app", "--model-path", "m", "--port", "99999"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
