"""The ``examples/`` folder: every config loads and validates (the cluster ones against their cluster, memory
included), and every CPU variant runs end to end as its README says, through the entry points' ``run_job``.

The CPU runs happen in a temporary working directory holding ``outputs/examples/assets`` (written by
``python -m archon.demos.gsm8k make-assets``), so the example configs run as they are, without overrides.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from paths import REPO
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from archon.cli import run_job
from archon.config import Config, load_config
from archon.data.from_config import build_rl_dataset
from archon.demos.gsm8k import make_assets
from archon.plan.fit import check_fit
from archon.rl.trainer import RLTrainer
from archon.sft import run_sft

EXAMPLES = REPO / "examples"
CLUSTER = {
    "gsm8k_grpo/cluster.yaml": "rl",
    "ppo_critic/cluster.yaml": "rl",
    "sft_then_rl/sft_cluster.yaml": "sft",
    "sft_then_rl/rl_cluster.yaml": "rl",
}
CPU = {
    "gsm8k_grpo/cpu.yaml": "rl",
    "ppo_critic/cpu.yaml": "rl",
    "sft_then_rl/sft_cpu.yaml": "sft",
    "sft_then_rl/rl_cpu.yaml": "rl",
}
FOLDERS = ("gsm8k_grpo", "ppo_critic", "sft_then_rl")


def test_every_example_config_is_checked_here_and_listed_in_the_readme() -> None:
    found = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.glob("*/*.yaml")}
    assert found == set(CLUSTER) | set(CPU)
    table = (EXAMPLES / "README.md").read_text()
    for folder in FOLDERS:
        assert f"({folder}/)" in table, folder
        readme = (EXAMPLES / folder / "README.md").read_text()
        for config in (c for c in (*CLUSTER, *CPU) if c.startswith(folder + "/")):
            assert f"examples/{config}" in readme, config


@pytest.mark.parametrize(("name", "job"), CLUSTER.items(), ids=list(CLUSTER))
def test_cluster_configs_validate_against_their_cluster_and_fit_its_gpus(
    name: str, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # actor.model_config is relative to the repository, as the README's commands run
    cfg = load_config(EXAMPLES / name, job=job)  # allocations parse and every process has a GPU of the cluster
    report = check_fit(cfg, job)  # python -m archon.plan's memory check: config.json only, no weights
    assert report.fits, [report.verdict(e) for e in report.estimates]
    assert cfg.device == "auto" and cfg.actor.gradient_checkpointing
    if job == "rl":
        _assert_gsm8k_rl(cfg, train_path="data/gsm8k")


@pytest.mark.parametrize(("name", "job"), CPU.items(), ids=list(CPU))
def test_cpu_configs_validate_as_one_cpu_node(name: str, job: str) -> None:
    cfg = load_config(EXAMPLES / name, job=job)
    assert cfg.device == "cpu" and cfg.cluster.n_nodes == 1 and cfg.total_train_steps == 2
    if job == "rl":
        _assert_gsm8k_rl(cfg, train_path="outputs/examples/assets/data/gsm8k")


def _assert_gsm8k_rl(cfg: Config, train_path: str) -> None:
    """An RL example trains on GSM8K's train split with the math reward and evaluates on its test split."""
    assert (cfg.train_dataset.path, cfg.train_dataset.subset, cfg.train_dataset.split) == (train_path, "main", "train")
    assert (cfg.valid_dataset.path, cfg.valid_dataset.subset, cfg.valid_dataset.split) == (train_path, "main", "test")
    assert cfg.reward.fn == "math" and cfg.evaluator.freq_steps > 0 and cfg.train_dataset.apply_chat_template


# ------------------------------------------------------------------------------------------- CPU runs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with the examples' assets where their configs look for them."""
    root = tmp_path_factory.mktemp("examples")
    make_assets(root / "outputs" / "examples" / "assets")
    return root


def _job_on_a_rank(config: str, kind: str) -> int:
    """What scripts/train_rl.py or train_sft.py does on a rank, but for the closing os._exit."""
    job = run_sft if kind == "sft" else (lambda cfg: RLTrainer(cfg).run())
    return run_job(job, None, ["--config", str(EXAMPLES / config)], kind=kind)


def _run(workdir: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Config, list[dict[str, Any]]]:
    """Run a CPU example in ``workdir`` on one forked rank; its config and its metrics.jsonl records."""
    monkeypatch.chdir(workdir)
    assert run_distributed(_job_on_a_rank, 1, name, CPU[name], timeout=600) == [0]
    cfg = load_config(EXAMPLES / name, job=CPU[name])
    out = workdir / cfg.output_dir
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        for key, value in record.items():
            assert value is None or math.isfinite(value), (record["step"], key, value)
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    return cfg, records


def _assert_rl_run(cfg: Config, records: list[dict[str, Any]]) -> None:
    # The policy is evaluated before the first update (step 0) and after the last step.
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        assert record["n_samples"] == cfg.train_dataset.batch_size * cfg.gconfig.n_samples
        assert 0.0 <= record["reward_mean"] <= 1.0 and record["actor/tokens"] > 0
        assert record["reward/calls"] > 0 and record["reward/failures"] == 0
    for record in (records[0], records[-1]):
        assert record["eval/n_prompts"] == cfg.evaluator.max_prompts
        assert 0.0 <= record["eval/greedy_acc"] <= 1.0 and 0.0 <= record["eval/pass@2"] <= 1.0


@pytest.mark.slow  # a built-in server and 2 RL steps with evaluations (~20 s on 2 busy cores)
def test_gsm8k_grpo_cpu_variant_runs(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, records = _run(workdir, "gsm8k_grpo/cpu.yaml", monkeypatch)
    _assert_rl_run(cfg, records)


@pytest.mark.slow  # a built-in server, 2 RL steps of actor and critic, evaluations (~25 s)
def test_ppo_critic_cpu_variant_trains_actor_and_critic(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, records = _run(workdir, "ppo_critic/cpu.yaml", monkeypatch)
    _assert_rl_run(cfg, records)
    assert cfg.actor.adv_estimator == "gae"
    for record in records[1:]:
        # Even at reward 0 the critic's values make non-zero GAE advantages: both models get gradients.
        assert record["critic/value_loss"] > 0 and record["critic/grad_norm"] > 0
        assert record["actor/grad_norm"] > 0


@torch.no_grad()
def _greedy(model_dir: Path, cfg: Config) -> list[str]:
    """transformers' greedy completions of the first evaluation prompts (the reference for the run's own)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = build_rl_dataset(cfg.valid_dataset, tok)
    texts = []
    for i in range(cfg.evaluator.max_prompts):
        ids, out = list(prompts[i].input_ids), []
        while len(out) < cfg.gconfig.max_new_tokens:
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        texts.append(tok.decode(out, skip_special_tokens=True))
    return texts


@pytest.mark.slow  # 2 SFT steps, then a built-in server and 2 RL steps with evaluations (~30 s)
def test_sft_then_rl_cpu_variant_starts_rl_from_the_sft_export(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sft_cfg, sft_records = _run(workdir, "sft_then_rl/sft_cpu.yaml", monkeypatch)
    assert [r["step"] for r in sft_records] == [1, 2]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in sft_records)
    export = workdir / sft_cfg.output_dir / "hf"
    base = workdir / "outputs" / "examples" / "assets" / "model"
    trained, initial = load_file(export / "model.safetensors"), load_file(base / "model.safetensors")
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # SFT moved the weights

    rl_cfg, rl_records = _run(workdir, "sft_then_rl/rl_cpu.yaml", monkeypatch)
    assert workdir / rl_cfg.actor.path == export
    _assert_rl_run(rl_cfg, rl_records)
    # The evaluation before any RL update is of the SFT export: its greedy answers are transformers' on that
    # folder, and not those of the random model SFT started from.
    step0 = [
        json.loads(line) for line in (workdir / rl_cfg.output_dir / "eval" / "step_0.jsonl").read_text().splitlines()
    ]
    greedy = [s["completion"] for s in step0 if s["mode"] == "greedy"]
    assert greedy == _greedy(export, rl_cfg)
    assert greedy != _greedy(base, rl_cfg)
