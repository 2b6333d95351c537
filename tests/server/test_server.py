"""The built-in rollout server over HTTP: SGLang's request/response shapes, errors, control
endpoints and weight updates (from disk and from a gloo group).

Expected tokens and logprobs always come from an independent model (loaded from the same or
the new folder) run without KV cache, never from the server itself.  The gloo weight-update
tests run the server as a real subprocess (``python -m archon.server.app``), because the
test process is the trainer's rank 0 of the same group.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import torch.nn as nn
from dist_utils import wait_until
from hf_fixtures import random_tokens, save_tiny_hf
from safetensors.torch import load_file
from server_utils import launch_server, wait_healthy
from slow_model import _slow_down

import models
from archon.server.app import RunningServer, serve_in_thread
from archon.server.generator import Generator
from archon.wire.weight_group import (
    broadcast_tensor,
    destroy_weight_update_group,
    flatten_bucket,
    init_weight_update_group,
    listen_on,
    listening_port,
)

ATOL = 1e-5
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "weight_version",
    "weight_versions",
    "e2e_latency",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    specs = {"old": ("qwen3", 31), "new": ("qwen3", 32), "moe": ("qwen3_moe", 33)}
    for name, (model_type, seed) in specs.items():
        save_tiny_hf(root / name, model_type, seed=seed)
    return {name: root / name for name in specs}


@pytest.fixture
def serve():
    running: list[RunningServer] = []

    def start(folder: Path, delay_s: float = 0.0, **kwargs: Any) -> RunningServer:
        model = models.load_hf_model(folder)
        if delay_s:
            _slow_down(model, delay_s)
        server = serve_in_thread(Generator(model, random_seed=0, **kwargs), model_path=str(folder))
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop()


def _post(url: str, path: str, body: Any, timeout: float = 60) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:  # plain-text answers (/flush_cache)
        return status, raw.decode()


def _get(url: str, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.status, r.read()


def _greedy_body(prompt: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }


@torch.no_grad()
def _reference(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by full recomputation and their logprobs (T = 1) from one full forward."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    lp = torch.log_softmax(model(torch.tensor([tokens]))[0].float(), -1)[len(prompt) - 1 : -1]
    completion = tokens[len(prompt) :]
    return completion, lp.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


def _assert_matches(response: dict[str, Any], reference: tuple[list[int], list[float]]) -> None:
    ids, logprobs = reference
    assert response["output_ids"] == ids
    got = response["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got] == ids and all(x is None for _, _, x in got)
    assert max(abs(lp - r) for (lp, _, _), r in zip(got, logprobs)) < ATOL


def _generating(gen: Generator, rid: str):
    """True once request ``rid`` is running and has produced a token: a control request sent
    now acts mid-generation.  (Merely running is not enough: the prefill may not have sampled yet.)"""
    return lambda: gen.progress().get(rid, 0) >= 1


def _engine_turn(gen: Generator) -> None:
    """Return once the engine thread has gone around its loop with everything queued so far.

    A second pause (idempotent) is answered from a loop turn that first takes in new
    requests and then admits none of them while paused.
    """
    gen.pause().result(timeout=120)


# ---- /generate ---------------------------------------------------------------------------------


def test_generate_single_and_batch_responses(folders, serve):
    srv = serve(folders["old"])
    ref_model = models.load_hf_model(folders["old"])
    p, q = random_tokens(5, 1), random_tokens(9, 2)

    status, single = _post(srv.url, "/generate", _greedy_body(p, 6, rid="one"))
    assert status == 200 and set(single) == {"text", "output_ids", "meta_info"} and single["text"] == ""
    meta = single["meta_info"]
    assert set(meta) == META_KEYS | {"output_token_logprobs"}
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default" and 0 < meta["e2e_latency"] < 60
    _assert_matches(single, _reference(ref_model, p, 6))

    body = {
        "input_ids": [p, q],
        "rid": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 4, "temperature": 0}, {"max_new_tokens": 7, "temperature": 0}],
    }
    status, batch = _post(srv.url, "/generate", body)
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b"]
    assert all(set(r["meta_info"]) == META_KEYS for r in batch)  # no logprobs unless asked
    assert [r["output_ids"] for r in batch] == [_reference(ref_model, p, 4)[0], _reference(ref_model, q, 7)[0]]
    # One sampling_params object for the whole batch; a random rid when none is given.
    status, batch = _post(srv.url, "/generate", {"input_ids": [q, p], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and [r["meta_info"]["completion_tokens"] for r in batch] == [3, 3]
    assert batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]
    # max_new_tokens null: up to the context length (SGLang's meaning).
    body = {"input_ids": p, "sampling_params": {"max_new_tokens": None, "ignore_eos": True, "stop": None}}
    status, unbounded = _post(srv.url, "/generate", body)
    assert status == 200 and unbounded["meta_info"]["completion_tokens"] == 256 - len(p)


def test_many_concurrent_requests(folders, serve):
    srv = serve(folders["old"], max_running_requests=6)
    ref_model = models.load_hf_model(folders["old"])
    prompts = [random_tokens(2 + i % 7, 100 + i) for i in range(16)]
    lengths = [3 + i % 5 for i in range(16)]

    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:

            async def one(p, n):
                async with session.post(srv.url + "/generate", json=_greedy_body(p, n)) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    responses = asyncio.run(run())
    for (status, body), p, n in zip(responses, prompts, lengths):
        assert status == 200
        _assert_matches(body, _reference(ref_model, p, n))


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"sampling_params": {}}, "input_ids is missing"),
    ({"text": "hello"}, "need a tokenizer"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [[1, 2], []]}, "request 1: input_ids must be a non-empty"),
    ({"input_ids": [1, "2"]}, "integers"),
    ({"input_ids": [1, 2.5]}, "integers"),
    ({"input_ids": [1, True]}, "integers"),
    ({"input_ids": [1, 128]}, "outside the vocabulary"),
    ({"input_ids": [-1]}, "outside the vocabulary"),
    ({"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 100}}, "context length 256"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.1}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens must be an integer"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 8}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": "x"}}, "sampling_seed"),
    ({"input_ids": [1], "sampling_params": {"n": 4}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field 'bogus'"),
    ({"input_ids": [1], "stream": True}, "not supported"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid has 1 entries"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries"),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(folders, serve):
    srv = serve(folders["old"])
    good = _greedy_body(random_tokens(3, 5), 2)
    expected = _post(srv.url, "/generate", good)[1]["output_ids"]
    for body, reason in BAD_REQUESTS:
        status, answer = _post(srv.url, "/generate", body)
        assert status == 400, (body, answer)
        assert set(answer) == {"error"} and reason in answer["error"]["message"], (body, answer)
        assert _post(srv.url, "/generate", good)[1]["output_ids"] == expected


def test_health_model_info_and_flush_cache(folders, serve):
    srv = serve(folders["old"], max_running_requests=5)
    assert _get(srv.url, "/health") == (200, b"ok")
    assert _get(srv.url, "/health_generate")[0] == 200
    status, raw = _get(srv.url, "/get_model_info")
    info = json.loads(raw)
    assert status == 200 and info["model_path"] == str(folders["old"]) == info["tokenizer_path"]
    assert info["is_generation"] is True and info["weight_version"] == "default"
    assert info["max_context_length"] == 256 and info["vocab_size"] == 128 and info["max_running_requests"] == 5
    assert _post(srv.url, "/flush_cache", {})[0] == 200


# ---- pause / continue / abort -----------------------------------------------------------------------


def test_pause_continue_and_abort(folders, serve):
    srv = serve(folders["old"], delay_s=0.01)
    gen = srv.server.generator
    ref_model = models.load_hf_model(folders["old"])
    p, q = random_tokens(4, 7), random_tokens(6, 8)
    queued = lambda n: lambda: gen.stats()["num_queued_reqs"] == n  # noqa: E731

    with ThreadPoolExecutor(4) as pool:
        # Pause aborts the running request; its partial tokens are still correct greedy tokens.
        long = pool.submit(_post, srv.url, "/generate", _greedy_body(p, 200, rid="long"))
        wait_until(_generating(gen, "long"), "request long to generate")
        assert _post(srv.url, "/pause_generation", {})[0] == 200
        status, aborted = long.result(timeout=120)
        meta = aborted["meta_info"]
        assert status == 200 and meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"]
        n = meta["completion_tokens"]
        assert 0 < n < 200 and len(meta["output_token_logprobs"]) == n
        _assert_matches(aborted, _reference(ref_model, p, n))

        # While paused, new requests wait; an aborted queued request answers with no tokens.
        waiting = pool.submit(_post, srv.url, "/generate", _greedy_body(q, 3))
        doomed = pool.submit(_post, srv.url, "/generate", _greedy_body(q, 3, rid="doomed"))
        wait_until(queued(2), "two queued requests")
        _engine_turn(gen)
        stats = gen.stats()
        assert (stats["num_running_reqs"], stats["num_queued_reqs"]) == (0, 2)
        assert not waiting.done() and not doomed.done()
        assert _post(srv.url, "/abort_request", {"rid": "doomed"})[0] == 200
        status, body = doomed.result(timeout=120)
        assert body["output_ids"] == [] and body["meta_info"]["finish_reason"]["type"] == "abort"
        assert not waiting.done()
        assert _post(srv.url, "/continue_generation", {})[0] == 200
        status, body = waiting.result(timeout=120)
        assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        _assert_matches(body, _reference(ref_model, q, 3))

        # Abort one running request by rid, then everything with abort_all.
        for abort_body in ({"rid": "victim"}, {"abort_all": True}):
            victim = pool.submit(_post, srv.url, "/generate", _greedy_body(p, 200, rid="victim"))
            wait_until(_generating(gen, "victim"), "request victim to generate")
            assert _post(srv.url, "/abort_request", abort_body)[0] == 200
            body = victim.result(timeout=120)[1]
            assert body["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < body["meta_info"]["completion_tokens"] < 200
    assert _post(srv.url, "/abort_request", {})[0] == 400


# ---- weight updates ---------------------------------------------------------------------------------


def test_update_weights_from_disk(folders, serve):
    srv = serve(folders["old"], delay_s=0.005)
    old_model = models.load_hf_model(folders["old"])
    new_model = models.load_hf_model(folders["new"])
    p, q = random_tokens(5, 9), random_tokens(3, 10)
    assert _reference(old_model, q, 8)[0] != _reference(new_model, q, 8)[0]  # the update is visible

    with ThreadPoolExecutor(2) as pool:
        # A request already running finishes on the old weights; the update waits for it.
        before = pool.submit(_post, srv.url, "/generate", _greedy_body(p, 120, rid="before"))
        wait_until(_generating(srv.server.generator, "before"), "request before to generate")
        status, answer = _post(
            srv.url, "/update_weights_from_disk", {"model_path": str(folders["new"]), "weight_version": "v1"}
        )
        assert status == 200 and answer["success"] is True, answer
        # All 120 tokens on the old weights: the update waited for the running request.
        body = before.result(timeout=120)[1]
        assert body["meta_info"]["weight_version"] == "default"
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
        _assert_matches(body, _reference(old_model, p, 120))

    status, body = _post(srv.url, "/generate", _greedy_body(q, 8))
    assert body["meta_info"]["weight_version"] == "v1"
    _assert_matches(body, _reference(new_model, q, 8))
    assert json.loads(_get(srv.url, "/get_model_info")[1])["weight_version"] == "v1"

    # abort_all_requests: the running request is cut short and keeps reporting its version.
    with ThreadPoolExecutor(1) as pool:
        victim = pool.submit(_post, srv.url, "/generate", _greedy_body(p, 240, rid="victim"))
        wait_until(_generating(srv.server.generator, "victim"), "request victim to generate")
        status, answer = _post(
            srv.url,
            "/update_weights_from_disk",
            {"model_path": str(folders["old"]), "weight_version": "v2", "abort_all_requests": True},
        )
        assert status == 200 and answer["success"] is True
        meta = victim.result(timeout=120)[1]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["weight_version"] == "v1"
    _assert_matches(_post(srv.url, "/generate", _greedy_body(q, 8))[1], _reference(old_model, q, 8))

    # A folder of another architecture is refused and leaves the served weights untouched.
    for bad in ({"model_path": str(folders["moe"])}, {"model_path": str(folders["old"] / "missing")}, {}):
        status, answer = _post(srv.url, "/update_weights_from_disk", bad)
        assert status == 400 and answer["success"] is False and answer["message"], answer
    body = _post(srv.url, "/generate", _greedy_body(q, 8))[1]
    assert body["meta_info"]["weight_version"] == "v2"
    _assert_matches(body, _reference(old_model, q, 8))


# ---- the real CLI, and weight updates over a gloo group ----------------------------------------------


@pytest.fixture(scope="module")
def cli_servers(folders, tmp_path_factory):
    """Real server subprocesses, started together: qwen3 (weight sync), qwen3_moe (weight sync), qwen2 (CLI)."""
    qwen2 = tmp_path_factory.mktemp("cli") / "qwen2"
    save_tiny_hf(qwen2, "qwen2", seed=34)
    wanted = {"qwen3": folders["old"], "qwen3_moe": folders["moe"], "qwen2": qwen2}
    launched = {
        name: launch_server(folder, "--skip-tokenizer-init", "--tp-size", "1") for name, folder in wanted.items()
    }
    try:
        for name, server in launched.items():
            launched[name] = wait_healthy(server)
        yield {name: (server.proc, server.url, server.folder) for name, server in launched.items()}
    finally:
        for server in launched.values():
            server.stop()


def test_cli_serves_generate_and_stops_on_sigterm(cli_servers):
    proc, url, folder = cli_servers["qwen2"]
    p = random_tokens(7, 11)
    status, body = _post(url, "/generate", _greedy_body(p, 5))
    assert status == 200 and set(body["meta_info"]) == META_KEYS | {"output_token_logprobs"}
    _assert_matches(body, _reference(models.load_hf_model(folder), p, 5))
    info = json.loads(_get(url, "/get_model_info")[1])
    assert info["model_path"] == str(folder) and info["weight_version"] == "default"
    proc.terminate()
    # uvicorn shuts down gracefully, then re-raises SIGTERM (the conventional exit status).
    assert proc.wait(timeout=120) in (0, -signal.SIGTERM)


@pytest.mark.parametrize("model_type,seed", [("qwen3", 41), ("qwen3_moe", 42)])
def test_update_weights_from_distributed(cli_servers, tmp_path, model_type, seed):
    proc, url, served_folder = cli_servers[model_type]
    save_tiny_hf(tmp_path / "new", model_type, seed=seed)
    new_model = models.load_hf_model(tmp_path / "new")
    p = random_tokens(6, seed)
    assert _reference(models.load_hf_model(served_folder), p, 8)[0] != _reference(new_model, p, 8)[0]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "new").glob("*.safetensors")):
        tensors.update(load_file(shard))
    names = sorted(tensors)
    if model_type == "qwen3_moe":
        assert any(".mlp.experts.3.down_proj.weight" in n for n in names)  # per-expert HF keys
    group_name = f"sync_{model_type}"
    fd = listen_on("127.0.0.1", 0)  # listening before the server is told where: no port to lose
    port = listening_port(fd)

    # Trainer rank 0 and the server (rank 1) rendezvous at the same time.
    joined: dict[str, Any] = {}
    trainer = threading.Thread(
        target=lambda: joined.update(
            pg=init_weight_update_group("127.0.0.1", port, 0, 2, group_name, "gloo", timeout_s=60, listen_fd=fd)
        )
    )
    trainer.start()
    status, answer = _post(
        url,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group_name,
            "backend": "gloo",
        },
    )
    trainer.join(timeout=300)
    assert status == 200 and answer["success"] is True, answer
    pg = joined["pg"]

    def update(names: list[str], version: str, flattened: bool = False) -> tuple[int, Any]:
        body = {
            "names": names,
            "dtypes": ["float32"] * len(names),
            "shapes": [list(tensors[n].shape) for n in names],
            "group_name": group_name,
            "weight_version": version,
            "flush_cache": True,
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_post, url, "/update_weights_from_distributed", body)
            if flattened:
                broadcast_tensor(flatten_bucket([tensors[n].contiguous() for n in names]), pg, src=0)
            else:
                for name in names:
                    broadcast_tensor(tensors[name].contiguous(), pg, src=0)
            return pending.result(timeout=300)

    try:
        before = _post(url, "/generate", _greedy_body(p, 8))[1]
        # A name the model lacks: every tensor is still received (the group stays in step),
        # none is applied, and the served weights and version stay as they were.
        tensors["model.layers.0.mlp.bogus.weight"] = torch.ones(3)
        status, answer = update([*names[:3], "model.layers.0.mlp.bogus.weight", *names[3:]], "bad")
        assert status == 400 and answer["success"] is False and "bogus" in answer["message"], answer
        after = _post(url, "/generate", _greedy_body(p, 8))[1]
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"] != "bad"

        status, answer = update(names, f"step-{seed}")
        assert status == 200 and answer["success"] is True, answer
        body = {
            "names": names,
            "dtypes": ["float32"] * len(names),
            "shapes": [list(tensors[n].shape) for n in names],
            "group_name": group_name,
        }

        status, out = _post(url, "/generate", _greedy_body(p, 8))
        assert out["meta_info"]["weight_version"] == f"step-{seed}"
        _assert_matches(out, _reference(new_model, p, 8))

        # One broadcast of the bucket's bytes (SGLang's load_format 'flattened_bucket'): a bad name
        # still takes the whole bucket off the group and applies nothing; a good bucket applies.
        status, answer = update([*names[:3], "model.layers.0.mlp.bogus.weight", *names[3:]], "bad", flattened=True)
        assert status == 400 and "bogus" in answer["message"], answer
        assert _post(url, "/generate", _greedy_body(p, 8))[1]["output_ids"] == out["output_ids"]
        save_tiny_hf(tmp_path / "third", model_type, seed=seed + 100)
        third = models.load_hf_model(tmp_path / "third")
        for shard in sorted((tmp_path / "third").glob("*.safetensors")):
            tensors.update(load_file(shard))
        status, answer = update(names, "flat", flattened=True)
        assert status == 200 and answer["success"] is True, answer
        status, out = _post(url, "/generate", _greedy_body(p, 8))
        assert out["meta_info"]["weight_version"] == "flat"
        _assert_matches(out, _reference(third, p, 8))
        other_format = _post(url, "/update_weights_from_distributed", {**body, "load_format": "safetensors"})
        assert other_format[0] == 400 and "'flattened_bucket'" in other_format[1]["message"]

        unknown = _post(url, "/update_weights_from_distributed", {**body, "group_name": "nope"})
        assert unknown[0] == 400 and "init_weights_update_group" in unknown[1]["message"]
        bad_dtype = _post(url, "/update_weights_from_distributed", {**body, "dtypes": ["float33"] * len(names)})
        assert bad_dtype[0] == 400 and "not a torch dtype" in bad_dtype[1]["message"]
        short = _post(url, "/update_weights_from_distributed", {**body, "shapes": body["shapes"][:-1]})
        assert short[0] == 400 and "one of each per tensor" in short[1]["message"]
        taken = _post(
            url,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group_name,
            },
        )
        assert taken[0] == 400 and "already exists" in taken[1]["message"]
        assert _post(url, "/generate", _greedy_body(p, 8))[1]["output_ids"] == out["output_ids"]
    finally:
        status, answer = _post(url, "/destroy_weights_update_group", {"group_name": group_name})
        destroy_weight_update_group(pg)
    assert status == 200 and answer["success"] is True
