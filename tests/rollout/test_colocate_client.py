"""The rollout client's colocation calls: release and resume server memory, weights from shared tensors.

Against the real built-in server (``serve_in_thread``), whose engine accounting shows the memory given back,
and whose completions after the update equal a generator loaded with the new weights; the vLLM mapping is
checked against the calls it builds (vLLM's CPU build has no sleep mode and no CUDA IPC to run it against).
"""

from __future__ import annotations

import time

import pytest
import torch
from hf_fixtures import save_tiny_hf
from safetensors.torch import load_file

import models
from archon.rollout.client import RolloutClient
from archon.rollout.server_api import BuiltinServerAPI, Call, RolloutError, ServerAPI
from archon.rollout.vllm import VLLMAPI
from archon.server.app import serve_in_thread
from archon.server.generator import GenerationRequest, Generator
from archon.server.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]


def test_client_releases_resumes_and_loads_tensors_on_the_builtin_server(tmp_path):
    save_tiny_hf(tmp_path / "old", "qwen3", seed=3)
    save_tiny_hf(tmp_path / "new", "qwen3", seed=4)
    with Generator(models.load_hf_model(tmp_path / "new")) as ref:
        requests = [GenerationRequest(p, SamplingParams(**GREEDY), return_logprob=True) for p in PROMPTS]
        want = ref.generate(requests)
    tensors = sorted(kv for f in (tmp_path / "new").glob("*.safetensors") for kv in load_file(f).items())

    servers = [serve_in_thread(Generator(models.load_hf_model(tmp_path / "old"))) for _ in range(2)]
    gens = [s.server.generator for s in servers]
    try:
        with RolloutClient([s.url for s in servers], api=BuiltinServerAPI()) as client:
            client.release_memory_occupation(["kv_cache"], addrs=[servers[1].url])  # one server only
            assert gens[1].stats()["kv_cache_bytes"] == 0 and gens[0].stats()["kv_cache_bytes"] > 0
            client.release_memory_occupation()
            assert all(g.stats()["weight_bytes"] == 0 and g.stats()["kv_cache_bytes"] == 0 for g in gens)

            pending = [client.submit(client.agenerate(p, GREEDY)) for p in PROMPTS]
            deadline = time.monotonic() + 30
            while sum(g.stats()["num_queued_reqs"] for g in gens) < len(PROMPTS):  # they reached a server
                assert time.monotonic() < deadline, "the requests never reached the servers"
                time.sleep(0.01)
            client.resume_memory_occupation()
            weight_bytes = [g.stats()["weight_bytes"] for g in gens]
            assert all(b > 0 for b in weight_bytes) and not any(f.done() for f in pending)

            client.update_weights_from_tensor(tensors, 3)
            got = [f.result(timeout=60) for f in pending]
            assert all(g.weight_version == "3" for g in gens)
    finally:
        for s in servers:
            s.stop()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for r, w in zip(got, want):
        assert torch.allclose(torch.tensor(r.output_logprobs), torch.tensor(w.output_logprobs), atol=1e-5)
    assert {r.weight_version for r in got} == {"3"}


def test_sglang_calls_carry_sglangs_fields():
    api = ServerAPI()
    assert api.release_memory(None) == [Call("POST", "/release_memory_occupation", {"tags": None})]
    assert api.resume_memory(["weights"]) == [Call("POST", "/resume_memory_occupation", {"tags": ["weights"]})]
    assert api.setup_tensor_weights() == []
    (call,) = api.update_weights_from_tensor(["abc"], "7", flush_cache=True, abort_all_requests=False, first=True)
    assert call.path == "/update_weights_from_tensor"
    assert call.payload == {
        "serialized_named_tensors": ["abc"],
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "7",
    }


def test_vllm_maps_release_and_resume_onto_sleep_and_wake_up():
    api = VLLMAPI()
    for tags in (None, [], ["weights"], ["weights", "kv_cache", "cuda_graph"]):
        assert api.release_memory(tags) == [Call("POST", "/sleep?level=2&mode=wait")]
    assert api.release_memory(["kv_cache"]) == [Call("POST", "/release_kv_cache_memory")]
    with pytest.raises(RolloutError, match="CUDA graphs only with its weights"):
        api.release_memory(["cuda_graph"])
    with pytest.raises(RolloutError, match="unknown memory tag"):
        api.release_memory(["activations"])
    assert api.resume_memory(["weights"]) == [Call("POST", "/wake_up?tags=weights")]
    for tags in (None, ["kv_cache"], ["weights", "kv_cache"]):
        assert api.resume_memory(tags) == [Call("POST", "/wake_up")]


def test_vllm_client_refuses_cpu_tensors_before_sending_anything():
    with RolloutClient(["127.0.0.1:9"], api=VLLMAPI()) as client:  # nothing listens: a request would fail otherwise
        with pytest.raises(ValueError, match="maps CUDA memory only; set rollout.weight_sync = 'disk'"):
            client.update_weights_from_tensor([("w", torch.zeros(2))], 1)


def _part(gpu: str, handle: tuple) -> dict:
    """One trainer rank's part as archon.wire.vllm_ipc.share_cuda_tensors makes it (handles stand in for
    reduce_tensor's arguments, which need a GPU)."""
    return {
        "names": ["model.embed_tokens.weight", "lm_head.weight"],
        "dtype_names": ["bfloat16", "bfloat16"],
        "shapes": [[8, 4], [8, 4]],
        "ipc_handles": [{gpu: handle + ("embed",)}, {gpu: handle + ("head",)}],
    }


def test_vllm_takes_the_tensors_of_every_gpu_of_a_server_in_one_update_between_start_and_finish():
    import base64
    import pickle

    api = VLLMAPI()
    init = Call("POST", "/init_weight_transfer_engine", {"init_info": {"packed": False}})
    assert api.setup_tensor_weights() == [init]
    parts = [_part("GPU-a", (0,)), _part("GPU-b", (1,))]  # a tp=2 server over two trainer ranks' GPUs
    first = api.update_weights_from_tensor(parts, None, flush_cache=True, abort_all_requests=False, first=True)
    assert [c.path for c in first] == ["/start_weight_update", "/update_weights"]
    info = first[1].payload["update_info"]
    assert info["names"] == ["model.embed_tokens.weight", "lm_head.weight"] and info["shapes"] == [[8, 4], [8, 4]]
    assert info["dtype_names"] == ["bfloat16", "bfloat16"]
    # Each vLLM worker picks the handle of its own GPU (vllm/distributed/weight_transfer/ipc_engine.py).
    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"])) == [
        {"GPU-a": (0, "embed"), "GPU-b": (1, "embed")},
        {"GPU-a": (0, "head"), "GPU-b": (1, "head")},
    ]
    last = api.update_weights_from_tensor(parts, "7", flush_cache=True, abort_all_requests=False, first=False)
    assert [c.path for c in last] == ["/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert last[1].payload == {"weight_version": "7"}
    with pytest.raises(ValueError, match="different tensors for one vLLM server"):
        api.update_weights_from_tensor(
            [parts[0], {**parts[1], "names": ["x", "y"]}], "7", flush_cache=True, abort_all_requests=False, first=True
        )
