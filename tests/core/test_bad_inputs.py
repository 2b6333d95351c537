"""Bad input on every surface a user touches gets one sentence naming what, where and the fix.

One table per surface: allocation strings, config keys and values, data files, model folders,
and HTTP requests to the built-in server.  Each row is an input and the words its message must
contain (the thing, its location, the fix); every message must be one line without a
traceback, of a user-error class the CLI prints as is.  For HTTP, the answer is a 4xx with
that sentence in SGLang's error shape, and after every bad request the server still answers a
good one with the model's greedy tokens (checked against an independently loaded model).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_fixtures import make_tiny_tokenizer, random_tokens, save_tiny_hf
from safetensors.torch import load_file, save_file

import models
from archon.alloc import AllocationMode, ModelAllocation
from archon.config import load_config
from archon.data.rl_dataset import RLPromptDataset
from archon.errors import user_error_types
from archon.server.app import serve_in_thread
from archon.server.generator import Generator


def assert_one_sentence(exc: BaseException, needles: tuple[str, ...]) -> None:
    msg = str(exc)
    assert isinstance(exc, user_error_types()), f"{type(exc).__name__} is not a user error: {msg}"
    assert msg and "\n" not in msg and "Traceback" not in msg and len(msg) < 700, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def _raises(fn: Callable[[], Any], needles: tuple[str, ...]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test classifies it
        assert_one_sentence(exc, needles)
    else:
        raise AssertionError(f"no error for {needles}")


# ---- allocation strings --------------------------------------------------------------------

ALLOCATIONS = [
    ("d4t2", ("'d4t2'", "no backend", "write 'archon:d4t2'")),
    ("archon:d2x2", ("'archon:d2x2'", "position 9", "'x' is not a dimension", "dims are d, t, p, c, e")),
    ("sglang:d2p2", ("'sglang:d2p2'", "'p'", "use 'vllm:'")),
    ("archon:d0", ("'archon:d0'", "size 0", "at least 1")),
    ("archon:d2d2", ("'archon:d2d2'", "appears twice", "give each dimension once")),
    ("foo:d2", ("'foo:d2'", "unknown backend 'foo'", "known backends are")),
    ("archon:(attn:d1p2t2|ffn:d1p4t1e4)", ("attn (p2) and ffn (p4)", "must be identical")),
    ("archon:", ("'archon:'", "no dims", "e.g. 'archon:d1'")),
    ("sglang:d2+archon:d4+", ("'sglang:d2+archon:d4+'", "start each component with a backend")),
]


@pytest.mark.parametrize("text, needles", ALLOCATIONS, ids=[a for a, _ in ALLOCATIONS])
def test_bad_allocation_strings(text, needles):
    _raises(lambda: AllocationMode.from_str(text) if "+" in text else ModelAllocation.from_str(text), needles)


# ---- config keys and values ----------------------------------------------------------------

CONFIGS = [
    (["actor.optimizer.lrr=1"], ("'actor.optimizer.lrr'", "command line", "did you mean 'actor.optimizer.lr'")),
    (["actr.backend=archon:d1"], ("'actr'", "did you mean 'actor'")),
    (["total_train_steps=abc"], ("'total_train_steps'", "must be an integer", "'abc'")),
    (["actor.archon.enable_compile=yes"], ("'actor.archon.enable_compile'", "true or false")),
    (["actor.adv_estimator=gpro"], ("'actor.adv_estimator'", "did you mean 'grpo'")),
    (["reward.timeout_s=0"], ("reward.timeout_s = 0.0", "command line", "greater than 0")),
    (["reward.max_failure_frac=1.5"], ("reward.max_failure_frac", "between 0 and 1")),
    (["gconfig.top_p=1.5"], ("gconfig.top_p = 1.5", "in (0, 1]")),
    (["gconfig.temperature=nan"], ("gconfig.temperature = nan", "0 (greedy) or more")),
    (["actor.optimizer.lr=-1e-5"], ("actor.optimizer.lr", "0 or more")),
    (["saver.keep_last=0"], ("saver.keep_last = 0", "at least 1")),
    (["total_train_steps=0"], ("total_train_steps = 0", "at least 1")),
    (["gconfig.min_new_tokens=9", "gconfig.max_new_tokens=8"], ("gconfig.min_new_tokens = 9", "lower")),
    (["actor.ppo_n_minibatches=100", "train_dataset.batch_size=2"], ("actor.ppo_n_minibatches = 100", "lower it")),
    (["actor.group_size=3", "gconfig.n_samples=4"], ("actor.group_size = 3", "must divide")),
    (["oops"], ("'oops'", "has no '='", "dotted.key=value")),
    (["actor.optimizer=3"], ("'actor.optimizer'", "is a section", "actor.optimizer.<field>")),
    (["actor.backend=archon:d4x"], ("actor.backend", "'archon:d4x'", "is not a dimension")),
    (["actor.backend=sglang:d2"], ("actor.backend = 'sglang:d2'", "training backend")),
]


@pytest.mark.parametrize("overrides, needles", CONFIGS, ids=[" ".join(o) for o, _ in CONFIGS])
def test_bad_config_keys_and_values(overrides, needles):
    _raises(lambda: load_config(None, overrides), needles)


def test_bad_config_files(tmp_path):
    _raises(lambda: load_config(tmp_path / "nope.toml"), ("nope.toml", "does not exist", "--config"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[actor\nlr = 1\n")
    _raises(lambda: load_config(broken), ("broken.toml", "not valid TOML"))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[actor.optimiser]\nlr = 1.0\n")
    _raises(lambda: load_config(unknown), ("'actor.optimiser'", "unknown.toml", "did you mean 'actor.optimizer'"))


# ---- data files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


DATASETS = [
    ("missing", None, ("missing.jsonl", "does not exist", "set train_dataset.path")),
    ("empty", "", ("empty.jsonl", "has no rows", "one JSON object per line")),
    ("blank_lines", "\n\n  \n", ("blank_lines.jsonl", "has no rows")),
    (
        "malformed",
        '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer"\n',
        ("malformed.jsonl:2", "not valid JSON"),
    ),
    ("not_object", '["a", "1"]\n', ("not_object.jsonl:1", "holds a list", "one object per line")),
    ("no_prompt", '{"text": "a", "answer": "1"}\n', ("no_prompt.jsonl row 1", "neither 'prompt' nor 'question'")),
    ("no_answer", '{"prompt": "a"}\n', ("no_answer.jsonl row 1", "no 'answer'")),
    ("prompt_not_text", '{"prompt": 5, "answer": "1"}\n', ("prompt_not_text.jsonl row 1", "must be a string")),
    (
        "too_long",
        '{"prompt": "a a a a a a a a a a a a", "answer": "1"}\n',
        ("too_long.jsonl", "longer than max_prompt_length=4", "raise train_dataset.max_length"),
    ),
]


@pytest.mark.parametrize("name, text, needles", DATASETS, ids=[d[0] for d in DATASETS])
def test_bad_data_files(tmp_path, tokenizer, name, text, needles):
    path = tmp_path / f"{name}.jsonl"
    if text is not None:
        path.write_text(text)
    _raises(lambda: RLPromptDataset(path, tokenizer, max_prompt_length=4), needles)


def test_some_prompts_longer_than_max_length_are_dropped_with_one_warning(tmp_path, tokenizer, caplog):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "a a a a a a a a", "answer": "2"}\n')
    short = len(RLPromptDataset([{"prompt": "a", "answer": "1"}], tokenizer)[0].input_ids)
    with caplog.at_level("WARNING", logger="archon.data"):
        data = RLPromptDataset(path, tokenizer, max_prompt_length=short)
    assert len(data) == 1 and data.n_dropped == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "dropped 1 of 2 prompts" in warnings[0] and "mixed.jsonl" in warnings[0]


# ---- model folders ---------------------------------------------------------------------------


def _edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        sd = load_file(folder / "model.safetensors")
        edit(sd)
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return apply


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return apply


def _truncate(keep: slice) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[keep])

    return apply


def _pickle_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04N.")  # a pickle; never to be loaded


FOLDERS = [
    ("no_config", lambda f: (f / "config.json").unlink(), ("config.json does not exist", "next to its safetensors")),
    (
        "unsupported_type",
        _edit_config(model_type="llama"),
        ("model_type 'llama' has no Archon model spec", "qwen3", "add_model.py", "'fsdp:'"),
    ),
    (
        "unknown_type",
        _edit_config(model_type="foobar"),
        ("model_type 'foobar' has no Archon model spec", "add_model.py"),
    ),
    (
        "missing_tensor",
        _edit_tensors(lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
        ("lacks 1 tensor", "'model.layers.1.mlp.up_proj.weight'", "check that the checkpoint is complete"),
    ),
    (
        "extra_tensor",
        _edit_tensors(lambda sd: sd.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})),
        ("does not use", "'model.layers.0.mlp.extra.weight'", "use the config.json that came with these weights"),
    ),
    (
        "misshaped_tensor",
        _edit_tensors(lambda sd: sd.update({"model.norm.weight": torch.ones(3)})),
        ("'model.norm.weight'", "has shape (3,)", "expects (64,)", "use the config.json"),
    ),
    (
        "truncated_header",
        _truncate(slice(0, 5000)),
        ("model.safetensors is not a readable safetensors file", "truncated or corrupt", "copy or export it again"),
    ),
    ("truncated_tail", _truncate(slice(0, -64)), ("model.safetensors is not a readable", "truncated")),
    ("pickle_bin_only", _pickle_only, ("no model.safetensors", "never unpickles", "convert them to safetensors")),
]


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    save_tiny_hf(folder, "qwen3", max_shard_size="10MB")  # a single model.safetensors
    return folder


@pytest.mark.parametrize("name, damage, needles", FOLDERS, ids=[f[0] for f in FOLDERS])
def test_bad_model_folders(tmp_path, good_folder, name, damage, needles):
    folder = tmp_path / name
    shutil.copytree(good_folder, folder)
    damage(folder)
    _raises(lambda: models.load_hf_model(folder), needles)


# ---- HTTP requests to the built-in server ----------------------------------------------------


def _good() -> dict:
    return {
        "input_ids": random_tokens(4, 7),
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }


def _http(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def _message(answer: Any) -> str:
    """The sentence of an error answer: SGLang's {"error": {"message"}} or a control endpoint's {"message"}."""
    assert isinstance(answer, dict), answer
    if "error" in answer:
        return answer["error"]["message"]
    assert answer.get("success") is False, answer
    return answer["message"]


G = "/generate"
REQUESTS = [
    # (method, path, body, status, words of the one sentence)
    ("POST", G, b"{not json", 400, ("not valid JSON",)),
    (
        "POST",
        G,
        b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
        400,
        ("sampling_params.temperature", "finite number", "got nan"),
    ),
    (
        "POST",
        G,
        b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}',
        400,
        ("sampling_params.top_p", "finite number"),
    ),
    ("POST", G, "just a string", 400, ("JSON object with input_ids",)),
    ("POST", G, {"input_ids": "1 2 3"}, 400, ("input_ids must be a non-empty list of token ids",)),
    ("POST", G, {"input_ids": {"a": 1}}, 400, ("input_ids must be a non-empty list",)),
    ("POST", G, {"input_ids": []}, 400, ("non-empty",)),
    ("POST", G, {"input_ids": [[3, 4], []]}, 400, ("request 1", "non-empty")),
    ("POST", G, {"input_ids": [5, 1.5]}, 400, ("input_ids[1]", "integers")),
    ("POST", G, {"input_ids": [5, 128]}, 400, ("input_ids[1] = 128", "outside the vocabulary [0, 128)")),
    ("POST", G, {"input_ids": [10**30]}, 400, ("input_ids[0]", "outside the vocabulary")),
    ("POST", G, {"input_ids": [5], "sampling_params": "greedy"}, 400, ("sampling_params must be a JSON object",)),
    (
        "POST",
        G,
        {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**30}},
        400,
        ("max_new_tokens", "below 2**63"),
    ),
    (
        "POST",
        G,
        {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**6}},
        400,
        ("max_new_tokens (1000000)", "context length 256", "lower max_new_tokens"),
    ),
    ("POST", G, {"input_ids": [5], "sampling_params": {"top_k": 10**30}}, 400, ("top_k", "below 2**63")),
    ("POST", G, {"input_ids": [5], "sampling_params": {"top_k": 0}}, 400, ("top_k must be -1 (off) or >= 1",)),
    ("POST", G, {"input_ids": [5], "sampling_params": {"temperature": -0.5}}, 400, ("temperature must be >= 0",)),
    (
        "POST",
        G,
        {"input_ids": [5], "sampling_params": {"stop_token_ids": [1, "x"]}},
        400,
        ("stop_token_ids must be a list of integers",),
    ),
    ("POST", G, {"input_ids": [5], "sampling_params": {"n": 3}}, 400, ("sampling_params.n = 3", "remove it")),
    (
        "POST",
        G,
        {"input_ids": [5], "sampling_params": {"temprature": 0}},
        400,
        ("unknown field 'temprature'", "remove it"),
    ),
    ("POST", G, {"input_ids": [5], "return_logprob": "yes"}, 400, ("return_logprob must be true or false",)),
    ("POST", G, {"input_ids": [5], "rid": 7}, 400, ("rid must be a string",)),
    ("POST", G, {"input_ids": [5] * 10000}, 413, ("/generate", "more than the server's limit", "--max-request-mb")),
    ("POST", "/update_weights_from_disk", {"model_path": 5}, 400, ("model_path must be str",)),
    ("POST", "/update_weights_from_disk", {}, 400, ("needs the field 'model_path'",)),
    (
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/no/such/folder"},
        400,
        ("/no/such/folder", "is not a directory"),
    ),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2},
        400,
        ("rank_offset 0", "rank 0 is the trainer"),
    ),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1"}, 400, ("needs the field 'master_port'",)),
    (
        "POST",
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
        400,
        ("no weight update group named 'nope'",),
    ),
    ("POST", "/abort_request", {"rid": 5}, 400, ("rid must be a string or a list of strings",)),
    ("POST", "/pause_generation", {"mode": "in_place"}, 400, ("mode 'in_place' is not supported",)),
    ("POST", "/pause_generation", b"[", 400, ("not valid JSON",)),
    ("GET", "/no_such_endpoint", None, 404, ("no endpoint /no_such_endpoint", "/generate")),
    ("GET", G, None, 405, ("/generate does not accept GET", "use POST")),
    ("DELETE", "/health", None, 405, ("/health does not accept DELETE", "use GET")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    save_tiny_hf(folder, "qwen3", seed=71)
    model = models.load_hf_model(folder)
    srv = serve_in_thread(
        Generator(models.load_hf_model(folder), random_seed=0), model_path=str(folder), max_request_mb=0.02
    )
    good = _good()
    tokens = list(good["input_ids"])
    with torch.no_grad():
        for _ in range(good["sampling_params"]["max_new_tokens"]):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    yield srv, good, tokens[len(good["input_ids"]) :]
    srv.stop()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "method, path, body, status, needles", REQUESTS, ids=[f"{r[0]} {r[1]} {i}" for i, r in enumerate(REQUESTS)]
)
def test_bad_requests_get_one_sentence_and_the_server_keeps_serving(server, method, path, body, status, needles):
    srv, good, expected = server
    got_status, answer = _http(srv.url, method, path, body)
    assert got_status == status, (got_status, answer)
    message = _message(answer)
    assert message and "\n" not in message and "Traceback" not in message and len(message) < 700, message
    for needle in needles:
        assert needle in message, (needle, message)
    status_ok, ok = _http(srv.url, "POST", G, good)
    assert status_ok == 200 and ok["output_ids"] == expected and ok["meta_info"]["weight_version"] == "default"


def _engine_error(path: str, backend: str, engine_kw: dict) -> tuple[str, str, bool]:
    from engine_utils import engine_config

    from archon.engine.engine import ArchonEngine

    try:
        ArchonEngine(engine_config(path, backend, **engine_kw)).initialize()
    except Exception as exc:  # noqa: BLE001 - classified by the test
        return type(exc).__name__, str(exc), isinstance(exc, user_error_types())
    return "no error", "", False


def test_a_layout_the_model_cannot_take_is_a_user_error(good_folder):
    """What parallel/ refuses while building an engine reaches the CLI as one sentence, not a traceback."""
    from dist_utils import run_distributed

    kw = {"gradient_checkpointing": True, "archon": {"ac_mode": "memory_budget"}}
    name, msg, user = run_distributed(_engine_error, 1, str(good_folder), "archon:d1", kw)[0]
    assert user and name == "EngineError", (name, msg)
    assert msg.startswith("actor.backend = 'archon:d1': ") and "needs torch.compile" in msg and "\n" not in msg
