"""Archon against SGLang 0.5.23's behaviour, as the fake SGLang (``fake_sglang.py``) reproduces it.

Each test names the SGLang behaviour and checks the launcher, the config check, the client or
the built-in server against it: min_new_tokens, context length, stop vs length, sampling seeds,
top_k = 1 and joint top-k/top-p, the health check.  Weight versions per bucket are checked in
``test_weight_sync.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from fake_sglang import VOCAB, FakeSGLang, as_fake, fake_completion, fake_logits, fetch_state, sglang_sample

from archon.config import ConfigError, load_config
from archon.launch.servers import RolloutLauncher, RolloutLaunchError, build_launch_specs
from archon.rl.trainer import policy_temperature
from archon.rollout.client import RolloutClient, RolloutRequestError
from archon.server.sampling import sample_tokens, token_logprobs

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang_model")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 256}))
    return path


@pytest.fixture
def serve():
    started: list[FakeSGLang] = []

    def start(**kwargs) -> FakeSGLang:
        server = FakeSGLang(**kwargs).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def _client(server: FakeSGLang) -> RolloutClient:
    return RolloutClient([server.addr], setup_timeout=10, retries=0)


# ---------------------------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_is_refused_for_sglang_rollouts_at_config_check():
    with pytest.raises(
        ConfigError,
        match=r"gconfig.min_new_tokens = 2 cannot be used with rollout.backend = "
        r"'sglang:d1t1'.*HTTP 400.*renormalises.*set gconfig.min_new_tokens = 0",
    ):
        load_config(
            None,
            [
                "rollout.backend=sglang:d1t1",
                "actor.backend=archon:d1",
                "cluster.n_gpus_per_node=2",
                "gconfig.min_new_tokens=2",
            ],
        )
    # The built-in server reports unrenormalised logprobs (test_rollout_generator), so local rollouts keep it.
    assert load_config(None, ["gconfig.min_new_tokens=2"]).gconfig.min_new_tokens == 2


def test_sglang_answers_min_new_tokens_with_400_or_biased_logprobs(serve):
    params = {"max_new_tokens": 6, "temperature": 0.0, "min_new_tokens": 3}
    with _client(serve()) as client:  # started with --skip-tokenizer-init, as Archon starts SGLang
        with pytest.raises(
            RolloutRequestError, match="HTTP 400.*min_new_tokens=3 is unavailable when skip_tokenizer_init=True"
        ):
            client.generate([1, 2, 3], params)
    prompt = [1, 2, 3]
    stop = fake_completion(prompt, GREEDY)[0][1]  # greedy would stop at the second token
    with _client(serve(skip_tokenizer_init=False)) as client:
        res = client.generate(prompt, {**params, "stop_token_ids": [stop]})
    assert stop not in res.output_ids[:3]
    # With a tokenizer, the stop token is masked before the logprobs: they exceed the trainer's.
    trainer = [
        float(torch.log_softmax(fake_logits(prompt + res.output_ids[:i]), -1)[t]) for i, t in enumerate(res.output_ids)
    ]
    assert res.output_logprobs[1] > trainer[1] + 1e-3
    assert res.output_logprobs[3:] == pytest.approx(trainer[3:], abs=1e-5)


# ---------------------------------------------------------------------------------- context length


def test_context_length_is_passed_only_when_set_and_clamped_to_the_models(model_dir, tmp_path, caplog):
    base = [
        "rollout.backend=sglang:d1t1",
        "actor.backend=archon:d1",
        "cluster.n_gpus_per_node=2",
        f"actor.path='{model_dir}'",
        f"output_dir='{tmp_path}'",
    ]
    (default,) = build_launch_specs(load_config(None, base))
    assert "--context-length" not in default.cmd
    (small,) = build_launch_specs(load_config(None, [*base, "sglang.context_length=128"]))
    assert _flag(small.cmd, "--context-length") == "128"
    with caplog.at_level("WARNING"):
        (big,) = build_launch_specs(load_config(None, [*base, "sglang.context_length=32768"]))
    assert _flag(big.cmd, "--context-length") == "256"
    assert "sglang.context_length = 32768 exceeds the context" in caplog.text
    # The launched commands, run by the fake with SGLang's startup rule.
    for spec, context in ((default, 256), (big, 256)):
        spec.cmd = as_fake(spec.cmd, "--health-delay-s", "0")
        with RolloutLauncher([spec], setup_timeout=60) as launcher:
            with RolloutClient(launcher.addrs, setup_timeout=10, retries=0) as client:
                client.generate([1] * 200, {"max_new_tokens": 56, "temperature": 0})
                with pytest.raises(RolloutRequestError, match=f"maximum context length of {context} tokens"):
                    client.generate([1] * 200, {"max_new_tokens": 57, "temperature": 0})
    unclamped = list(big.cmd)
    unclamped[unclamped.index("--context-length") + 1] = "32768"
    big.cmd = unclamped
    with pytest.raises(
        RolloutLaunchError,
        match=r"exited with code 1 during startup(.|\n)*User-specified "
        r"context_length \(32768\) is greater than the derived",
    ):
        RolloutLauncher([big], setup_timeout=60).start()


# ---------------------------------------------------------------------------------- stop vs length


def test_eos_as_the_last_allowed_token_is_stop(serve):
    prompt = [5, 9, 2]
    free = fake_completion(prompt, GREEDY)[0]
    eos = free[3]
    first = free.index(eos)
    with _client(serve(eos_token_ids=[eos])) as client:
        res = client.generate(prompt, {**GREEDY, "max_new_tokens": first + 1})
    assert res.output_ids == free[: first + 1] and res.finish_reason == "stop" and res.matched_stop == eos


# ---------------------------------------------------------------------------------- sampling seeds


def test_sampling_seed_counts_only_with_deterministic_inference(serve):
    params = {"max_new_tokens": 12, "temperature": 1.0}
    prompt = [3, 3, 7]
    with _client(serve(random_seed=1)) as client:
        plain = [client.generate(prompt, {**params, "sampling_seed": 5}).output_ids for _ in range(2)]
    with _client(serve(deterministic=True)) as client:
        seeded = [client.generate(prompt, {**params, "sampling_seed": s}).output_ids for s in (5, 5, 6)]
        default = [client.generate(prompt, params).output_ids for _ in range(2)]
    assert plain[0] != plain[1]  # the seed is ignored: a rollout cannot be replayed
    assert seeded[0] == seeded[1] == fake_completion(prompt, params, seed=5)[0] != seeded[2]
    assert default[0] == default[1]  # no seed: SGLang's fixed default seed


def test_deterministic_inference_option_reaches_the_server(tmp_path):
    base = [
        "rollout.backend=sglang:d1t1",
        "actor.backend=archon:d1",
        "cluster.n_gpus_per_node=2",
        "actor.path=/models/tiny",
        f"output_dir='{tmp_path}'",
    ]
    (spec,) = build_launch_specs(load_config(None, [*base, "sglang.enable_deterministic_inference=true"]))
    assert "--enable-deterministic-inference" in spec.cmd
    spec.cmd = as_fake(spec.cmd, "--health-delay-s", "0")
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11}
    with RolloutLauncher([spec], setup_timeout=60) as launcher:
        with RolloutClient(launcher.addrs, setup_timeout=10) as client:
            assert client.generate([1, 2], params).output_ids == fake_completion([1, 2], params, seed=11)[0]
    # SGLang's seeded (PyTorch) sampler asserts on min-p: refused before anything starts.
    with pytest.raises(ConfigError, match="gconfig.min_p = 0.1 with sglang.enable_deterministic_inference"):
        load_config(None, [*base, "sglang.enable_deterministic_inference=true", "gconfig.min_p=0.1"])


# ---------------------------------------------------------------------------------- top_k = 1, joint filters


def test_top_k_one_is_greedy_with_unscaled_logprobs(serve):
    prompt = [6, 1, 8]
    params = {"max_new_tokens": 8, "temperature": 0.6, "top_k": 1}
    with _client(serve()) as client:
        res = client.generate(prompt, params)
    assert res.output_ids == fake_completion(prompt, GREEDY)[0]
    unscaled = [
        float(torch.log_softmax(fake_logits(prompt + res.output_ids[:i]), -1)[t]) for i, t in enumerate(res.output_ids)
    ]
    assert res.output_logprobs == pytest.approx(unscaled, abs=1e-5)
    # ... which is what the trainer recomputes for top_k = 1, at T = 1.
    assert policy_temperature(load_config(None, ["gconfig.temperature=0.6", "gconfig.top_k=1"])) == 1.0


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=20, top_p=0.5),
        dict(temperature=0.7, top_k=5, top_p=0.9),
        dict(temperature=1.3, top_p=0.3),
        dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.05),
    ],
)
def test_built_in_sampling_draws_what_sglang_draws(params):
    # Both invert the CDF of the kept, sorted distribution: with the same uniform and the same
    # support (joint top-k/top-p on the unfiltered distribution) they pick the same token.
    n = 400
    logits = torch.stack([fake_logits([i, 17]) for i in range(n)])
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(3))
    full = lambda key, default, dtype: torch.full((n,), params.get(key, default), dtype=dtype)  # noqa: E731
    ours = sample_tokens(
        logits,
        full("temperature", 1.0, torch.float32),
        full("top_k", -1, torch.long),
        full("top_p", 1.0, torch.float32),
        full("min_p", 0.0, torch.float32),
        uniforms,
    )
    ours_lp = token_logprobs(logits, full("temperature", 1.0, torch.float32), ours)
    theirs = [sglang_sample(logits[i], params, float(uniforms[i])) for i in range(n)]
    assert ours.tolist() == [t for t, _ in theirs]
    assert ours_lp.tolist() == pytest.approx([lp for _, lp in theirs], abs=1e-5)
    assert len(set(ours.tolist())) > n // 10 and logits.shape[-1] == VOCAB  # it samples, over many tokens


# ---------------------------------------------------------------------------------- /health


def test_a_slow_health_check_is_not_a_dead_server(tmp_path):
    # SGLang's /health runs a one-token generation: a second when idle, longer on a busy server.
    base = [
        "rollout.backend=sglang:d1t1",
        "actor.backend=archon:d1",
        "cluster.n_gpus_per_node=2",
        "actor.path=/models/tiny",
        f"output_dir='{tmp_path}'",
    ]
    (spec,) = build_launch_specs(load_config(None, base))
    spec.cmd = as_fake(spec.cmd, "--health-delay-s", "2.5")
    with RolloutLauncher([spec], setup_timeout=30) as launcher:
        with RolloutClient(launcher.addrs, setup_timeout=30) as client:
            client.wait_healthy()
            assert fetch_state(launcher.addrs[0])["generate_count"] == 0
    assert sys.executable in spec.cmd[0]
