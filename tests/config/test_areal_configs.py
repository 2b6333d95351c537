"""AReaL's YAML configs: a real AReaL GRPO file and the Archon document's examples load, every AReaL-only key gets
its sentence, ``${a.b}`` references resolve after the overrides, and the key table is consistent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from archon.config import ConfigError, load_config
from archon.config.areal_keys import AREAL_KEYS, ENGINE_SECTIONS, find_areal_key, render_markdown
from archon.config.loading import _all_keys
from archon.config.schema import Config

DATA = Path(__file__).parent / "data"
GRPO = DATA / "areal_gsm8k_grpo.yaml"
SEED_EXAMPLES = (DATA / "archon_qwen3_8b.yaml", DATA / "archon_qwen3_moe.yaml")
ARCHON_KEYS = set(_all_keys(Config))


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of a raw YAML tree, stopping at Archon's sections' leaves and at unknown keys' leaves."""
    keys = []
    for key, value in tree.items():
        dotted = prefix + key
        if isinstance(value, dict) and value:
            keys.extend(_leaves(value, dotted + "."))
        else:
            keys.append(dotted)
    return keys


def _areal_only_keys(path: Path) -> list[str]:
    raw = yaml.safe_load(path.read_text())
    return [k for k in _leaves(raw) if k not in ARCHON_KEYS]


def test_the_areal_grpo_yaml_loads_with_the_keys_archon_shares(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="archon.config"):
        cfg = load_config(GRPO)
    # Values read off the file by hand (AReaL's examples/math/gsm8k_grpo.yaml).
    assert (cfg.experiment_name, cfg.trial_name, cfg.seed) == ("gsm8k-grpo", "trial0", 1)
    assert (cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node) == (1, 8)
    assert cfg.rollout.backend == "sglang:d4t1" and cfg.actor.backend == "fsdp:d4t1"  # p1 dropped (size 1)
    assert cfg.ref.backend == cfg.actor.backend  # ${actor.backend}
    assert cfg.actor.path == cfg.ref.path == cfg.sglang.model_path == cfg.vllm.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.rollout.max_concurrent_rollouts == 256 and cfg.rollout.max_head_offpolicyness == 2
    assert (cfg.gconfig.n_samples, cfg.gconfig.max_new_tokens, cfg.gconfig.temperature) == (4, 1024, 1.0)
    opt = cfg.actor.optimizer
    assert (opt.type, opt.lr, opt.weight_decay, opt.eps) == ("adamw", 1.7e-5, 0.017, 1e-8)  # '1e-8' is a float
    assert opt.betas == (0.9, 0.999) and opt.lr_schedule == "constant" and opt.max_grad_norm == 1.0
    assert opt.warmup_steps == int(0.001 * cfg.total_train_steps)
    assert (cfg.actor.eps_clip, cfg.actor.reward_scaling, cfg.actor.reward_bias) == (0.4, 10.0, -0.5)
    assert cfg.actor.recompute_logprob and cfg.actor.use_decoupled_loss and cfg.actor.gradient_checkpointing
    assert cfg.actor.rejection_sampling.metric == "ratio" and cfg.actor.rejection_sampling.upper == 5.0
    assert cfg.actor.reward_norm.group_size == 4  # ${gconfig.n_samples}, an int
    assert (cfg.actor.adv_norm.mean_level, cfg.actor.adv_norm.std_level) == ("batch", "batch")
    assert cfg.actor.mb_spec.max_tokens_per_mb == 10240 and cfg.ref.mb_spec.max_tokens_per_mb == 10240
    assert cfg.rollout.weight_sync == "distributed"  # actor.weight_update_mode: xccl
    assert cfg.sglang.context_length == 32768 and cfg.sglang.max_running_requests == 0  # null: the default
    assert cfg.vllm.gpu_memory_utilization == 0.8 and cfg.saver.freq_steps == 0
    assert (cfg.train_dataset.batch_size, cfg.train_dataset.path, cfg.train_dataset.max_length) == (
        256,
        "openai/gsm8k",
        1024,
    )
    assert cfg.scheduler.type == "local"  # scheduler.type: null
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for key in _areal_only_keys(GRPO):
        entry = find_areal_key(key)
        assert entry is not None, f"{key} has no sentence in archon.config.areal_keys"
        if entry[0].kind != "translated":
            parts = key.split(".")  # the warning names the key, or the AReaL-only section holding it
            assert any(".".join(parts[:n]) in warned for n in range(1, len(parts) + 1)), key
            assert entry[0].note in warned, key


@pytest.mark.parametrize("path", SEED_EXAMPLES, ids=lambda p: p.stem)
def test_the_archon_documents_examples_load(path: Path) -> None:
    assert _areal_only_keys(path) == []  # every key of the document's examples is Archon's
    cfg = load_config(path)
    assert cfg.scheduler.type == "ray"
    assert cfg.actor.archon.pp_schedule == "Interleaved1F1B" and cfg.actor.archon.ac_mode == "selective"
    assert cfg.actor.gradient_checkpointing and cfg.actor.archon.enable_compile
    assert cfg.ref.backend == cfg.critic.backend == cfg.actor.backend
    if "moe" in path.stem:
        assert cfg.actor.backend == "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)" and cfg.cluster.n_nodes == 4
    else:
        assert cfg.actor.backend == "archon:d4p2t2" and cfg.rollout.backend == "sglang:d4t2"


def test_dotted_overrides_on_a_yaml_config_come_before_its_references() -> None:
    cfg = load_config(
        GRPO, ["actor.path=/models/mine", "+actor.optimizer.lr=2e-5", "actor.optimizer.gradient_clipping=0.5", "seed=7"]
    )
    assert cfg.actor.path == cfg.ref.path == cfg.sglang.model_path == "/models/mine"  # ${actor.path} after overrides
    assert cfg.sglang.random_seed == 7 and cfg.vllm.seed == 7
    assert cfg.actor.optimizer.lr == 2e-5 and cfg.actor.optimizer.max_grad_norm == 0.5


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_references_resolve_by_type_inside_text_and_to_archon_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "experiment_name: exp\ntrial_name: ${experiment_name}-t1\ntotal_train_steps: ${actor.ppo_n_minibatches}\n"
        "actor:\n  ppo_n_minibatches: 3\n  kl_ctl: 1e-3\nsglang:\n  random_seed: ${seed}\n",
    )
    cfg = load_config(path)
    assert cfg.trial_name == "exp-t1" and cfg.total_train_steps == 3 and cfg.actor.kl_ctl == 1e-3
    assert cfg.sglang.random_seed == 1  # seed is unset: Archon's default


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("output_dir: ${oc.env:HOME}\n", "OmegaConf form"),
        ("experiment_name: ${trial_name}\ntrial_name: ${experiment_name}\n", "refers to itself"),
        ("output_dir: ${cluster.nowhere}\n", "does not set"),
        ("- a\n- b\n", "not a mapping"),
        ("a: [1\n", "not valid YAML"),
    ],
)
def test_yaml_mistakes_are_one_sentence(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(_write(tmp_path, text))


def test_toml_keeps_dollar_braces_as_text(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, 'output_dir = "/runs/${SLURM_JOB_ID}"\n', "c.toml"))
    assert cfg.output_dir == "/runs/${SLURM_JOB_ID}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gconfig:\n  greedy: true\n", "gconfig.temperature = 0"),
        ("train_dataset:\n  batch_size: 16\nrollout:\n  consumer_batch_size: 32\n", "train_dataset.batch_size"),
        ("tokenizer_path: /elsewhere\nactor:\n  path: /model\n", "actor.path"),
        ("actor:\n  init_from_scratch: true\n", "model_config"),
        ("actor:\n  max_new_tokens: 64\n", "gconfig.max_new_tokens"),
        ("total_train_n_seqs: 1000\n", "total_train_steps"),
    ],
)
def test_areal_keys_whose_dropping_changes_the_run_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(_write(tmp_path, text))
    assert "c.yaml" in str(info.value)


def test_translated_keys_move_to_archons_names(tmp_path: Path) -> None:
    text = (
        "total_train_steps: 20\nactor:\n  ppo_n_minibatches: 2\n  rejection_sampling: null\n  optimizer:\n"
        "    beta1: 0.8\n    lr_scheduler_type: cosine\n    warmup_steps_proportion: 0.1\n"
        "  weight_update_mode: disk\n"
    )
    cfg = load_config(_write(tmp_path, text))
    opt = cfg.actor.optimizer
    assert opt.betas == (0.8, 0.999) and opt.lr_schedule == "cosine"
    assert opt.warmup_steps == 4  # int(0.1 x 20 steps x 2 minibatches), as AReaL rounds
    assert cfg.critic.optimizer.warmup_steps == 4  # inherits the actor's optimizer
    assert cfg.rollout.weight_sync == "disk"
    assert cfg.actor.rejection_sampling.level == "none"  # AReaL's null: no behaviour correction


def test_areals_lora_options_move_to_the_lora_section(tmp_path: Path) -> None:
    text = (
        "actor:\n  use_lora: true\n  lora_rank: 4\n  lora_alpha: 8\n  target_modules: [q_proj, v_proj]\n"
        "  peft_type: lora\n"
    )
    lora = load_config(_write(tmp_path, text), validate=False).actor.lora
    assert (lora.enabled, lora.rank, lora.alpha, lora.target_modules) == (True, 4, 8, ["q_proj", "v_proj"])


def test_a_translated_key_and_its_archon_name_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep one"):
        load_config(_write(tmp_path, "actor:\n  optimizer:\n    gradient_clipping: 0.5\n    max_grad_norm: 2.0\n"))
    with pytest.raises(ConfigError, match="keep one"):
        load_config(_write(tmp_path, "actor:\n  optimizer:\n    warmup_steps_proportion: 0.1\n    warmup_steps: 3\n"))


def test_a_key_in_neither_schema_still_gets_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key 'actor.eps_clp'.*did you mean 'actor.eps_clip'"):
        load_config(_write(tmp_path, "actor:\n  eps_clp: 0.2\n"))


def test_the_table_names_real_archon_keys_and_renders_one_row_per_entry() -> None:
    rows = render_markdown().splitlines()[2:]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [e.pattern for e in AREAL_KEYS]
    for entry in AREAL_KEYS:
        assert entry.note and "\n" not in entry.note
        if entry.kind == "refused" and entry.harmless is not None:
            assert entry.harmless_text, entry.pattern
        for target in filter(None, (t.strip() for t in entry.archon.split(","))):
            for section in ENGINE_SECTIONS if "<engine>" in target else ("",):
                key = target.replace("<engine>", section)
                assert key in ARCHON_KEYS, f"{entry.pattern} names {key}, which is not an Archon key"
        if entry.kind == "translated" and "," not in entry.archon:
            assert "<engine>" not in entry.pattern or "<engine>" in entry.archon


def test_the_readme_shows_the_table_as_the_module_holds_it() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert render_markdown().rstrip("\n") in readme, "paste render_markdown()'s output into README's Coming from AReaL"
