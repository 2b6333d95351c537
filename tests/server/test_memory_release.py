"""Releasing and resuming the built-in engine's memory, and loading weights from shared tensors.

Sizes come from the engine's own accounting (``Generator.stats``: the bytes of the Parameters' storages and
of the KV cache); generations after a release, resume and update are compared with a fresh generator
loaded with the new weights (the reference): token ids exactly, logprobs to float32 rounding (how requests
are batched changes the matmul kernels).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from hf_fixtures import save_tiny_hf
from safetensors.torch import load_file

import models
from archon.server.app import serve_in_thread
from archon.server.generator import GenerationRequest, Generator
from archon.server.sampling import SamplingParams
from archon.wire.tensor_ipc import deserialize_named_tensors, serialize_named_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    for name, seed in (("old", 1), ("new", 2)):
        save_tiny_hf(root / name, "qwen3", seed=seed)
    return {"old": root / "old", "new": root / "new"}


@pytest.fixture(scope="module")
def expected(folders):
    """Greedy completions of the new weights, from a generator that never released anything."""
    with Generator(models.load_hf_model(folders["new"])) as ref:
        return _outputs(ref.generate(_requests()))


def _requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(p, SamplingParams(max_new_tokens=6, temperature=0.0), return_logprob=True) for p in PROMPTS
    ]


def _outputs(results) -> list[tuple[list[int], list[float] | None]]:
    return [(r.output_ids, r.output_logprobs) for r in results]


def _assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def _hf_tensors(folder) -> list[tuple[str, torch.Tensor]]:
    """The folder's tensors under their Hugging Face names, as a trainer sends them."""
    named: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        named.update(load_file(f))
    return sorted(named.items())


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the engine did not reach the expected state"
        time.sleep(0.01)


def test_release_frees_weights_and_kv_cache_and_resume_takes_them_back(folders):
    with Generator(models.load_hf_model(folders["old"])) as gen:
        gen.generate(_requests())
        before = gen.stats()
        # Parameters of a 2-layer hidden-64 model (float32): nothing is counted twice (fused views, tied weights).
        n_params = sum(p.numel() for p in models.load_hf_model(folders["old"]).parameters())
        assert before["weight_bytes"] == 4 * n_params
        assert before["kv_cache_bytes"] > 0 and before["memory_released"] == []

        assert gen.release_memory().result() == ["weights", "kv_cache", "cuda_graph"]
        released = gen.stats()
        assert released["weight_bytes"] == 0 and released["kv_cache_bytes"] == 0
        assert released["memory_released"] == ["cuda_graph", "kv_cache", "weights"] and gen.memory_held
        assert gen.release_memory(["weights"]).result() == []  # already released: nothing more to free

        assert gen.resume_memory(["kv_cache", "weights"]).result() == ["kv_cache", "weights"]
        resumed = gen.stats()
        assert resumed["weight_bytes"] == before["weight_bytes"]
        assert resumed["kv_cache_bytes"] == before["kv_cache_bytes"]  # the idle cache's initial size
        assert resumed["memory_released"] == ["cuda_graph"] and resumed["awaiting_weights"]


def test_requests_wait_while_released_and_finish_after_resume_and_update(folders, expected):
    with Generator(models.load_hf_model(folders["old"])) as gen:  # lean forward: fused projections, packed weights
        gen.generate(_requests())  # packs the weights, so the release must drop the packed copies too
        gen.release_memory().result()
        futures = [gen.submit(r) for r in _requests()]
        _wait_for(lambda: gen.stats()["num_queued_reqs"] == len(PROMPTS))
        gen.resume_memory().result()
        # Resumed weights hold no values: still nothing admitted until an update lands.
        assert gen.stats()["num_queued_reqs"] == len(PROMPTS) and not any(f.done() for f in futures)
        gen.update_weights_from_disk(folders["new"], weight_version="v2").result()
        results = [f.result(timeout=60) for f in futures]
    _assert_same(_outputs(results), expected)
    assert {r.weight_version for r in results} == {"v2"}


def test_resumed_weights_wait_until_every_bucket_is_written(folders, expected):
    tensors = _hf_tensors(folders["new"])
    half = len(tensors) // 2
    with Generator(models.load_hf_model(folders["old"])) as gen:
        gen.release_memory(["weights"]).result()
        gen.resume_memory(["weights"]).result()
        futures = [gen.submit(r) for r in _requests()]
        gen.update_weights_from_tensors(tensors[:half]).result()
        assert gen.stats()["awaiting_weights"] and not any(f.done() for f in futures)  # half is still undefined
        gen.update_weights_from_tensors(tensors[half:], weight_version="v3").result()
        results = [f.result(timeout=60) for f in futures]
    _assert_same(_outputs(results), expected)


def test_kv_cache_release_keeps_the_weights(folders):
    with Generator(models.load_hf_model(folders["old"])) as gen:
        first = _outputs(gen.generate(_requests()))
        weight_bytes = gen.stats()["weight_bytes"]
        gen.release_memory(["kv_cache"]).result()
        stats = gen.stats()
        assert stats["kv_cache_bytes"] == 0 and stats["weight_bytes"] == weight_bytes
        gen.resume_memory(["kv_cache"]).result()
        assert not gen.memory_held  # the weights never left: no update needed
        _assert_same(_outputs(gen.generate(_requests())), first)


def test_updates_into_released_weights_and_releasing_shared_weights_are_refused(folders):
    with Generator(models.load_hf_model(folders["old"])) as gen:
        gen.release_memory(["weights"]).result()
        with pytest.raises(RuntimeError, match="released"):
            gen.update_weights_from_tensors(_hf_tensors(folders["new"])).result()
        with pytest.raises(ValueError, match="unknown memory tag"):
            gen.release_memory(["activations"]).result()
    with Generator(models.load_hf_model(folders["old"]), shared_weights=True) as shared:
        with pytest.raises(ValueError, match="trainer's own weights"):
            shared.release_memory().result()
        shared.release_memory(["kv_cache"]).result()
        assert shared.stats()["kv_cache_bytes"] == 0


def test_http_release_resume_and_update_from_tensor(folders, expected):
    server = serve_in_thread(Generator(models.load_hf_model(folders["old"])), model_path=str(folders["old"]))
    gen = server.server.generator
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]})
            assert r.status_code == 200 and r.json() is None  # SGLang answers an empty body
            info = http.get("/get_server_info").json()
            assert info["weight_bytes"] == 0 and info["kv_cache_bytes"] == 0
            assert http.get("/health_generate").status_code == 200  # health does not wait for the memory
            r = http.post("/resume_memory_occupation", json={"tags": ["nonsense"]})
            assert r.status_code == 400 and "unknown memory tag" in r.json()["error"]["message"]
            assert http.post("/resume_memory_occupation", json={}).status_code == 200

            tensors = _hf_tensors(folders["new"])
            wrong = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in tensors] + [("lm_bias", tensors[0][1])]
            r = http.post(
                "/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(wrong)]}
            )
            message = r.json()["message"]
            assert r.status_code == 400 and "model.norm.weight" in message and "lm_bias" in message
            assert gen.memory_held  # nothing applied: still waiting for weights

            body = {"serialized_named_tensors": [serialize_named_tensors(tensors)], "weight_version": "v7"}
            r = http.post("/update_weights_from_tensor", json=body)
            assert r.status_code == 200 and r.json()["success"], r.text
        got = _outputs(gen.generate(_requests()))
        assert gen.weight_version == "v7"
    finally:
        server.stop()
    _assert_same(got, expected)


def test_serialized_tensors_open_in_another_process_and_refuse_other_objects():
    import base64
    import pickle

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    want = float(t[1:].sum())
    data = serialize_named_tensors([("w", t[1:])])  # a view: offset and shape travel with the handle
    code = (
        "import sys; from archon.wire.tensor_ipc import deserialize_named_tensors as d; "
        "(n, x), = d(sys.stdin.read()); print(n, x.sum().item()); x.zero_()"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, text=True, timeout=120, cwd=root
    )
    assert out.stdout.split() == ["w", str(want)], out.stderr[-2000:]
    assert t[0].sum() == 6 and t[1:].abs().sum() == 0  # the other process wrote into the sender's memory
    with pytest.raises(ValueError, match="not part of a tensor"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps(print)).decode())
    with pytest.raises(ValueError, match="not base64"):
        deserialize_named_tensors("%%%")
