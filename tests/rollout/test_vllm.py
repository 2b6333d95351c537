"""vLLM rollouts: launch command lines, config checks, generation and weight reloads against a fake vLLM.

The fake (``fake_vllm.py``) answers the requests as vLLM 0.33.0 does, over a fake model
(``fake_sglang.fake_logits``), so the logprobs the client reports are compared here with the
trainer's recomputation ``log_softmax(logits / T)`` computed independently from that model.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from fake_sglang import fake_logits
from fake_vllm import FakeVLLM, InProcess, as_fake_vllm
from safetensors.torch import save_file

from archon.config import ConfigError, GenerationConfig, load_config
from archon.config.vllm_checks import vllm_logprobs_mode
from archon.launch.servers import RolloutLauncher, RolloutLaunchError, build_launch_specs
from archon.rl.trainer import policy_temperature
from archon.rollout.client import RolloutClient, RolloutError, RolloutRequestError
from archon.rollout.vllm import VLLMAPI
from archon.rollout.weight_sync import DiskWeightSync, WeightSyncEngine, WeightSyncError
from archon.wire.weight_group import ranks_per_server

EOS = 7


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder as far as the servers look at it: config.json (context 256, EOS 7)."""
    path = tmp_path_factory.mktemp("vllm_model")
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "max_position_embeddings": 256, "eos_token_id": EOS})
    )
    return path


def _cfg(model: Path | str, *overrides: str):
    return load_config(None, [f"actor.path='{model}'", "rollout.weight_sync=disk", *overrides])


def _reference_logprobs(prompt: list[int], ids: list[int], temperature: float, n_updates: int = 0) -> list[float]:
    """What the trainer recomputes: log_softmax(logits / T) of each generated token, unfiltered."""
    out = []
    for i, tok in enumerate(ids):
        logits = fake_logits(prompt + ids[:i], n_updates)
        out.append(float(torch.log_softmax(logits / temperature, -1)[tok]))
    return out


# ---------------------------------------------------------------------------------- specs and checks


def test_vllm_d2t2p2_specs_on_one_node(model_dir, tmp_path):
    cfg = _cfg(
        model_dir,
        "rollout.backend=vllm:d2t2p2",
        "actor.backend=archon:d8",
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=8",
        "vllm.seed=9",
        "vllm.gpu_memory_utilization=0.7",
        "vllm.extra_args=['--swap-space', '4']",
    )
    specs = build_launch_specs(cfg, tmp_path, ports=[8100, 8101], node=0)  # the plan gives node 0 to rollout
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1,2,3", "4,5,6,7"]
    for i, s in enumerate(specs):
        assert s.cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        assert _flag(s.cmd, "--tensor-parallel-size") == "2" and _flag(s.cmd, "--pipeline-parallel-size") == "2"
        assert _flag(s.cmd, "--port") == str(8100 + i) and _flag(s.cmd, "--host") == "0.0.0.0"
        assert _flag(s.cmd, "--seed") == str(9 + i)
        assert _flag(s.cmd, "--dtype") == "bfloat16" and _flag(s.cmd, "--gpu-memory-utilization") == "0.7"
        assert _flag(s.cmd, "--logprobs-mode") == "raw_logprobs"  # temperature 1
        assert _flag(s.cmd, "--generation-config") == "vllm"
        assert "--max-model-len" not in s.cmd and "--enforce-eager" not in s.cmd
        assert s.cmd[-2:] == ["--swap-space", "4"]
        assert s.env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_BATCH_INVARIANT" not in s.env
    assert ranks_per_server(cfg.allocations()["rollout"]) == 4


def test_vllm_options_context_clamp_and_batch_invariance(model_dir, tmp_path, caplog):
    cfg = _cfg(
        model_dir,
        "rollout.backend=vllm:d1t1",
        "actor.backend=archon:d1",
        "vllm.max_model_len=4096",
        "vllm.enforce_eager=true",
        "vllm.max_num_seqs=32",
        "vllm.batch_invariant=true",
        "gconfig.temperature=0.7",
        "vllm.model=/elsewhere",
    )
    with caplog.at_level("WARNING"):
        (spec,) = build_launch_specs(cfg, tmp_path)
    assert spec.cmd[4] == "/elsewhere"
    # /elsewhere has no config.json here: nothing to clamp against, the user's value goes through.
    assert _flag(spec.cmd, "--max-model-len") == "4096"
    assert "--enforce-eager" in spec.cmd and _flag(spec.cmd, "--max-num-seqs") == "32"
    assert _flag(spec.cmd, "--logprobs-mode") == "processed_logprobs"
    assert spec.env["VLLM_BATCH_INVARIANT"] == "1"
    cfg = _cfg(model_dir, "rollout.backend=vllm:d1t1", "actor.backend=archon:d1", "vllm.max_model_len=4096")
    with caplog.at_level("WARNING"):
        (spec,) = build_launch_specs(cfg, tmp_path)
    assert _flag(spec.cmd, "--max-model-len") == "256"
    assert "vllm.max_model_len = 4096 exceeds the context" in caplog.text


@pytest.mark.parametrize(
    "gconfig, mode, trainer_t",
    [
        (dict(temperature=1.0, top_p=0.8, top_k=20, min_new_tokens=3), "raw_logprobs", 1.0),
        (dict(temperature=0.0), "raw_logprobs", 1.0),
        (dict(temperature=0.6, top_k=1), "raw_logprobs", 1.0),  # greedy: unscaled, like SGLang
        (dict(temperature=0.7), "processed_logprobs", 0.7),
    ],
)
def test_logprobs_mode_matches_the_trainers_temperature(gconfig, mode, trainer_t):
    g = GenerationConfig(**gconfig)
    assert vllm_logprobs_mode(g) == mode
    overrides = [f"gconfig.{k}={v}" for k, v in gconfig.items()]
    assert policy_temperature(load_config(None, overrides)) == trainer_t


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.weight_sync=distributed"], "gets new weights from disk.*set rollout.weight_sync = 'disk'"),
        (
            ["rollout.weight_sync=tensor", "rollout.colocate=true", "actor.backend=archon:d1", "device=cpu"],
            "vLLM's CUDA IPC weight transfer, but device = 'cpu'",
        ),
        (
            ["rollout.weight_sync=disk", "gconfig.temperature=0.7", "gconfig.top_p=0.9"],
            r"gconfig.temperature = 0.7 with gconfig.top_p = 0.9 cannot be trained on with vLLM",
        ),
        (
            ["rollout.weight_sync=disk", "gconfig.temperature=0.5", "gconfig.min_new_tokens=2"],
            "gconfig.min_new_tokens = 2",
        ),
    ],
)
def test_vllm_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(
            None, ["rollout.backend=vllm:d1", "actor.backend=archon:d1", "cluster.n_gpus_per_node=2", *overrides]
        )


# ---------------------------------------------------------------------------------- client against the fake


@pytest.fixture
def fake() -> Iterator[tuple[FakeVLLM, str]]:
    server = FakeVLLM("m", max_model_len=64, logprobs_mode="raw_logprobs", dev_mode=True, eos=EOS)
    with InProcess(server) as addr:
        yield server, addr


@pytest.mark.parametrize(
    "gconfig",
    [
        dict(temperature=1.0, top_p=0.7, top_k=30),  # filtered at T = 1: raw logprobs are unfiltered
        dict(temperature=0.7),  # another temperature, no filter: processed = scaled
        dict(temperature=0.6, top_k=1),  # greedy: unscaled
        dict(temperature=0.0, min_new_tokens=4),  # min_tokens masks EOS, the raw logprobs do not see it
    ],
)
def test_reported_logprobs_equal_the_trainers_recomputation(gconfig):
    cfg = load_config(None, [f"gconfig.{k}={v}" for k, v in gconfig.items()] + ["gconfig.max_new_tokens=12"])
    server = FakeVLLM("m", max_model_len=256, logprobs_mode=vllm_logprobs_mode(cfg.gconfig), dev_mode=True, eos=EOS)
    from archon.rollout.server_api import sampling_params

    params = sampling_params(cfg.gconfig, stop_token_ids=[EOS])
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    with InProcess(server) as addr, RolloutClient([addr], api=VLLMAPI(), setup_timeout=10) as client:
        results = client.generate_many(prompts, [{**params, "sampling_seed": i} for i in range(3)])
    t = policy_temperature(cfg)
    for prompt, res in zip(prompts, results):
        assert len(res.output_ids) == len(res.output_logprobs) > 0
        ref = _reference_logprobs(prompt, res.output_ids, t)
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref)) < 1e-4
        if cfg.gconfig.min_new_tokens:
            assert EOS not in res.output_ids[: cfg.gconfig.min_new_tokens]


def test_refused_sampling_has_no_matching_vllm_mode():
    # temperature 0.7 with top-p: neither mode is what the trainer recomputes (why the config check refuses it).
    body_params = {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.5, "sampling_seed": 1}
    prompt = [4, 4, 2]
    for mode in ("raw_logprobs", "processed_logprobs"):
        server = FakeVLLM("m", max_model_len=256, logprobs_mode=mode, dev_mode=True)
        with InProcess(server) as addr, RolloutClient([addr], api=VLLMAPI(), setup_timeout=10) as client:
            res = client.generate(prompt, body_params)
        ref = _reference_logprobs(prompt, res.output_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref)) > 1e-2


def test_request_translation_finish_reasons_and_stop_tokens(fake):
    server, addr = fake
    greedy = {"max_new_tokens": 20, "temperature": 0.0}
    with RolloutClient([addr], api=VLLMAPI(), setup_timeout=10) as client:
        free = client.generate([1, 2, 3], {**greedy, "ignore_eos": True})
        stop = free.output_ids[3]
        by_stop = client.generate([1, 2, 3], {**greedy, "stop_token_ids": [stop], "ignore_eos": False})
        last = client.generate([1, 2, 3], {**greedy, "max_new_tokens": 4, "stop_token_ids": [stop]})
        ignored = client.generate([1, 2, 3], {**greedy, "stop_token_ids": [stop], "ignore_eos": True})
        seeded = [client.generate([8, 8], {"max_new_tokens": 8, "sampling_seed": s}).output_ids for s in (5, 5, 6)]
        body = server.requests[-1]
    assert free.finish_reason == "length" and len(free.output_ids) == 20 and free.prompt_tokens == 3
    assert by_stop.output_ids == free.output_ids[:4] and by_stop.finish_reason == "stop"
    assert by_stop.matched_stop == stop
    # The stop token as the last allowed token: 'stop', as SGLang reports it.
    assert last.output_ids == free.output_ids[:4] and last.finish_reason == "stop"
    # SGLang's ignore_eos ignores stop_token_ids too; the adapter keeps that meaning on vLLM.
    assert ignored.output_ids == free.output_ids
    assert seeded[0] == seeded[1] != seeded[2]
    assert body["prompt"] == [8, 8] and body["max_tokens"] == 8 and body["seed"] == 6 and body["logprobs"] == 0
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["return_weight_versions"]
    assert body["top_k"] == -1 and body["repetition_penalty"] == 1.0 and body["temperature"] == 1.0


def test_eos_finishes_with_a_null_stop_reason(fake):
    server, addr = fake
    server.eos = None
    with RolloutClient([addr], api=VLLMAPI(), setup_timeout=10) as client:
        free = client.generate([2, 7, 1], {"max_new_tokens": 10, "temperature": 0.0})
        eos = free.output_ids[2]
        server.eos = eos
        res = client.generate([2, 7, 1], {"max_new_tokens": 10, "temperature": 0.0})
    assert res.finish_reason == "stop" and res.matched_stop == eos
    assert res.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]


def test_client_errors(fake):
    server, addr = fake
    with RolloutClient([addr], api=VLLMAPI(), setup_timeout=10, retries=0) as client:
        with pytest.raises(RolloutRequestError, match="HTTP 400.*maximum context length is 64 tokens"):
            client.generate(list(range(60)), {"max_new_tokens": 10})
        with pytest.raises(ValueError, match=r"\['regex'\] have no vLLM equivalent"):
            client.generate([1], {"max_new_tokens": 2, "regex": "a+"})
        with pytest.raises(ValueError, match="max_new_tokens = None"):
            client.generate([1], {"max_new_tokens": None})
        with pytest.raises(RolloutError, match="cannot join a weight-update group; set rollout.weight_sync = 'disk'"):
            client.init_weights_update_group("127.0.0.1", 1234, "g", "nccl")
        client.pause_generation()
        assert server.paused == "abort"
        with pytest.raises(RolloutError, match="HTTP 503"):
            client.generate([1], {"max_new_tokens": 2})
        client.continue_generation()
        client.flush_cache()
    assert server.events == ["pause:abort", "resume", "reset_prefix_cache"]


def test_weights_without_dev_mode_are_a_clear_error(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    server = FakeVLLM("m", max_model_len=64, dev_mode=False)
    with InProcess(server) as addr, RolloutClient([addr], api=VLLMAPI(), setup_timeout=10) as client:
        with pytest.raises(RolloutError, match=r"has no /pause \(HTTP 404\); .*VLLM_SERVER_DEV_MODE=1"):
            client.update_weights_from_disk(str(tmp_path), 1)


# ---------------------------------------------------------------------------------- launched fake servers


class _Engine:
    """The weight-sync side of an engine: an HF folder of the weights of a step."""

    def __init__(self) -> None:
        self.step = 0

    def weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.step)
        return {
            "model.embed_tokens.weight": torch.randn(16, 8, generator=gen),
            "lm_head.weight": torch.randn(16, 8, generator=gen),
        }

    def named_full_tensors(self, dtype=None):
        yield from self.weights().items()

    def export_hf(self, path, dtype=None) -> None:
        save_file(self.weights(), os.path.join(path, "model.safetensors"))
        Path(path, "config.json").write_text('{"model_type": "qwen3"}')


def test_launched_servers_generate_and_reload_weights_from_disk(model_dir, tmp_path):
    from fake_sglang import configure, fetch_state, fetch_weights

    cfg = _cfg(
        model_dir,
        "rollout.backend=vllm:d2t1",
        "actor.backend=archon:d2",
        "cluster.n_gpus_per_node=4",
        "gconfig.temperature=0",
        f"output_dir='{tmp_path}'",
    )
    specs = build_launch_specs(cfg)
    for s in specs:
        s.cmd = as_fake_vllm(s.cmd)
    greedy = {"max_new_tokens": 5, "temperature": 0.0, "stop_token_ids": [EOS]}
    prompts = [[1, 2], [3, 4], [5, 6, 7], [8]]
    engine = _Engine()
    with RolloutLauncher(specs, setup_timeout=60) as launcher:
        client = RolloutClient.from_config(cfg.rollout, launcher.addrs)
        assert isinstance(client.api, VLLMAPI)
        with client:
            before = client.generate_many(prompts, greedy)
            sync = DiskWeightSync(cast(WeightSyncEngine, engine), client, tmp_path / "weights")  # a duck-typed double
            sync.setup()
            sync.sync(1)
            after = client.generate_many(prompts, greedy)
            states = [fetch_state(a) for a in launcher.addrs]
            weights = [fetch_weights(a) for a in launcher.addrs]
            configure(launcher.addrs[1], fail_reload="CUDA out of memory while loading")
            engine.step = 1
            with pytest.raises(WeightSyncError, match=rf"{launcher.addrs[1]} failed /collective_rpc.*out of memory"):
                sync.sync(2)
            failed = fetch_state(launcher.addrs[1])
        logs = [s.log_path.read_text() for s in specs]
    for i, log in enumerate(logs):
        assert f"CUDA_VISIBLE_DEVICES={i})" in log  # one GPU per t1 server, as the plan says
    for prompt, b, a in zip(prompts, before, after):
        assert b.weight_version == "" and a.weight_version == "1"
        assert b.output_logprobs == pytest.approx(_reference_logprobs(prompt, b.output_ids, 1.0), abs=1e-4)
        assert a.output_logprobs == pytest.approx(_reference_logprobs(prompt, a.output_ids, 1.0, n_updates=1), abs=1e-4)
    for state, got in zip(states, weights):
        assert state["events"] == ["pause:wait", "rpc:reload_weights", "reset_prefix_cache", "version:1", "resume"]
        assert state["model"] == str(tmp_path / "weights" / "v1") and state["logprobs_mode"] == "raw_logprobs"
        for name, t in _Engine().weights().items():
            assert torch.equal(got[name], t)
    # A failed reload leaves the server paused on its old version: it never serves half-loaded weights.
    assert failed["events"][-2:] == ["pause:wait", "rpc:reload_weights"]
    assert failed["paused"] == "wait" and failed["version"] == "1"


def test_max_model_len_above_the_models_stops_vllm_so_the_launcher_clamps_it(model_dir, tmp_path):
    cfg = _cfg(model_dir, "rollout.backend=vllm:d1t1", "actor.backend=archon:d1", "vllm.max_model_len=100000")
    (spec,) = build_launch_specs(cfg, tmp_path)
    assert _flag(spec.cmd, "--max-model-len") == "256"
    spec.cmd = as_fake_vllm(spec.cmd)
    with RolloutLauncher([spec], setup_timeout=60) as launcher:
        from fake_sglang import fetch_state

        assert fetch_state(launcher.addrs[0])["max_model_len"] == 256
    unclamped = list(spec.cmd)
    unclamped[unclamped.index("--max-model-len") + 1] = "100000"
    spec.cmd = unclamped
    with pytest.raises(RolloutLaunchError, match=r"exited with code 1 during startup(.|\n)*greater than the derived"):
        RolloutLauncher([spec], setup_timeout=60).start()
