"""The checks a run makes before any process starts (``archon.config.preflight``), device defaults, hub ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf

from archon.config import ConfigError, load_config
from archon.config.device_defaults import describe_device_choice
from archon.config.preflight import preflight
from archon.config.show import main
from pipeline.split import count_stages

# A RL config on a local model folder and dataset that passes every check; tests change one thing.
BASE = [
    "device=cpu",
    "cluster.n_gpus_per_node=4",
    "rollout.backend=local:d1",
    "gconfig.n_samples=4",
    "actor.backend=archon:d1",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen3 folder (context 256 tokens) with a tokenizer, and a dataset of short prompts."""
    root = tmp_path_factory.mktemp("preflight")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    data = root / "rl.jsonl"
    rows = [{"prompt": "what is 1 + 1 ?", "answer": "2"}, {"prompt": "what is the answer ?", "answer": "3"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, root


def run_args(tiny, *extra: str) -> list[str]:
    model, data, _ = tiny
    return [*BASE, f"actor.path={model}", f"train_dataset.path={data}", *extra]


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv, check=lambda cfg, job: preflight(cfg, job, download=False))
    out = capsys.readouterr()
    return code, " ".join(out.out.split()), " ".join(out.err.split())  # rich wraps lines at 80 columns


def test_a_valid_run_passes_and_the_cli_prints_what_it_checked(tiny, capsys):
    code, out, err = cli(run_args(tiny, "gconfig.max_new_tokens=8"), capsys)
    assert code == 0, err
    assert "Checked:" in out and "reward.fn = 'math' is a built-in" in out and "groups of 4 samples" in out
    assert "fit the context of 256" in out  # max_length 1024 + 8 > 256: the prompts were tokenised


def test_device_defaults_on_cpu_and_on_cuda_without_a_gpu():
    cpu = load_config(None, ["device=cpu"])
    assert cpu.actor.dtype == "float32" and cpu.actor.archon.enable_compile is False
    assert cpu.critic.dtype == cpu.ref.dtype == cpu.teacher.dtype == "float32"  # inherited from actor
    assert not cpu.ref.archon.enable_compile
    line = describe_device_choice(cpu)
    assert "actor.dtype = float32 (the cpu default)" in line and "enable_compile = false (the cpu default)" in line
    cuda = load_config(None, ["device=cuda"])  # only config resolution: no GPU needed
    assert cuda.actor.dtype == cuda.critic.dtype == "bfloat16" and cuda.actor.archon.enable_compile is True
    assert "bfloat16 (the cuda default)" in describe_device_choice(cuda)
    # What the user sets wins, and a partly set section of ref inherits the rest.
    mixed = load_config(None, ["device=cpu", "actor.dtype=bfloat16", "ref.dtype=float16", "ref.archon.ac_mode=full"])
    assert mixed.actor.dtype == "bfloat16" and mixed.ref.dtype == "float16" and not mixed.ref.archon.enable_compile
    assert "bfloat16 (set in the config)" in describe_device_choice(mixed)
    # 'auto' with an SGLang rollout is a GPU run, whichever machine loads the config (a CPU login node here).
    auto = load_config(None, ["rollout.backend=sglang:d1", "cluster.n_gpus_per_node=2"])
    assert auto.device == "auto" and auto.actor.dtype == "bfloat16" and auto.actor.archon.enable_compile


def test_the_trainer_logs_the_device_choice_at_start(tiny, caplog):
    """The start line comes from the report the trainer builds before any process group."""
    from archon.rl.trainer import RLTrainer

    cfg = load_config(None, run_args(tiny, "gconfig.max_new_tokens=8"))
    trainer = RLTrainer(cfg)
    assert "actor.dtype = float32 (the cpu default)" in trainer.preflight_report[0]
    with caplog.at_level(logging.INFO, logger="archon.rl"):
        logging.getLogger("archon.rl").info("start checks: %s", "; ".join(trainer.preflight_report))
    assert "enable_compile = false" in caplog.text


def test_group_of_one_with_group_normalisation_is_refused_by_the_cli(tiny, capsys):
    code, _, err = cli(run_args(tiny, "gconfig.n_samples=1"), capsys)
    assert code == 2 and "reward_norm normalises over groups" in err and "gconfig.n_samples > 1" in err
    code, _, err = cli(
        run_args(
            tiny,
            "gconfig.n_samples=1",
            "actor.reward_norm.mean_level=batch",
            "actor.reward_norm.std_level=batch",
            "gconfig.max_new_tokens=8",
        ),
        capsys,
    )
    assert code == 0, err  # batch normalisation needs no groups


def test_bad_reward_functions_are_refused_before_start(tiny, capsys):
    code, _, err = cli(run_args(tiny, "reward.fn=trl_reward_fns:two_args"), capsys)
    assert code == 2 and "cannot be called as fn(prompt, completion, answer" in err
    code, _, err = cli(run_args(tiny, "reward.fn=trl_reward_fns:NOT_CALLABLE"), capsys)
    assert code == 2 and "is not callable" in err
    code, out, err = cli(run_args(tiny, "reward.fn=trl_reward_fns:trl_length", "gconfig.max_new_tokens=8"), capsys)
    assert code == 0 and "TRL's fn(completions, **kwargs)" in out, err


def test_rl_from_non_zero_adapters_is_refused_before_start(tiny, capsys):
    lora = ("actor.lora.enabled=true", "gconfig.max_new_tokens=8")
    code, _, err = cli(run_args(tiny, *lora, "actor.lora.init_lora_weights=false"), capsys)
    assert code == 2 and "init_lora_weights = false starts RL from non-zero adapters" in err
    code, _, err = cli(run_args(tiny, *lora), capsys)
    assert code == 0, err


def test_prompt_plus_max_new_tokens_past_the_context_is_refused_with_the_numbers(tiny, capsys):
    model, _, root = tiny
    long_prompt = " ".join(["what is the answer ?"] * 10)  # 50 words of the tokenizer's vocabulary
    data = root / "long.jsonl"
    data.write_text(
        json.dumps({"prompt": long_prompt, "answer": "1"}) + "\n" + json.dumps({"prompt": "is", "answer": "2"}) + "\n"
    )
    args = [*BASE, f"actor.path={model}", f"train_dataset.path={data}"]
    code, _, err = cli([*args, "gconfig.max_new_tokens=230"], capsys)
    assert code == 2
    assert "the longest prompt of train_dataset.path (row 1) is 50 tokens" in err
    assert "that is 280, above the rollout servers' context of 256" in err and "max_new_tokens to 206" in err
    assert cli([*args, "gconfig.max_new_tokens=206"], capsys)[0] == 0  # exactly the context
    assert cli([*args, "gconfig.max_new_tokens=230", "train_dataset.max_length=26"], capsys)[0] == 0  # it is dropped


def test_p2_on_layers_the_default_stages_do_not_split_names_a_fix_that_works(tiny, capsys):
    _, data, root = tiny
    folder = root / "six_layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 6}))
    args = [*BASE[:-1], "actor.backend=archon:p2", f"actor.path={folder}", f"train_dataset.path={data}"]
    with pytest.raises(ConfigError, match=r"6 layers do not split evenly into 4 .*pp_layers_per_stage = 3"):
        preflight(load_config(None, args))
    assert count_stages(6, 2, None, 3) == 2  # the named fix is one the engine's split accepts
    cfg = load_config(None, [*args, "actor.archon.pp_layers_per_stage=3"])
    assert "actor: 6 layers split into 2 stages over p2" in "\n".join(preflight(cfg, download=False))
    code, _, err = cli([*args, "actor.archon.pp_schedule=ZBVZeroBubble"], capsys)  # V: exactly 2 stages per rank
    assert code == 2 and "no stage size splits 6 layers over p2" in err


def _fake_hub_cache(cache: Path, repo: str, source: Path) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_resolves_through_the_local_cache(tiny, tmp_path, monkeypatch):
    model, data, _ = tiny
    snapshot = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3", model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache is enough
    cfg = load_config(
        None,
        [
            *BASE,
            "actor.path=tiny-org/tiny-qwen3",
            f"train_dataset.path={data}",
            "gconfig.max_new_tokens=8",
            "actor.kl_ctl=0.1",
        ],
    )
    lines = preflight(cfg)
    assert Path(cfg.actor.path) == snapshot and Path(cfg.ref.path) == snapshot  # ref inherited the hub id
    assert any("resolved to" in line for line in lines)
    assert any("fit the context of 256" in line for line in lines)  # the resolved folder's config and tokenizer


def test_a_hub_id_not_cached_offline_says_where_it_looked_and_how_to_fetch(tiny, tmp_path, monkeypatch, capsys):
    _, data, _ = tiny
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [*BASE, "actor.path=no-org/no-model", f"train_dataset.path={data}"]
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, args))
    text = str(err.value)
    assert str(tmp_path / "empty") in text and "huggingface-cli download no-org/no-model" in text
    assert "HF_HUB_OFFLINE is set" in text
    code, _, cli_err = cli(args, capsys)
    assert code == 2 and "huggingface-cli download no-org/no-model" in cli_err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    code, out, _ = cli(args, capsys)  # online: the CLI reports, the run would download at start
    assert code == 0 and "the run downloads it at start" in out
