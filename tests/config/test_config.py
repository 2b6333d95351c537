import dataclasses
import functools
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from paths import REPO

from archon.config import Config, ConfigError, describe_section, field_docs, load_config, parse_override, to_toml
from archon.config.preflight import preflight
from archon.config.show import main as show_main

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg.actor.backend == "archon:d1"
    assert cfg.ref.backend == "archon:d1"  # empty means inherit actor.backend
    assert cfg.actor.archon.enable_compile is (cfg.actor.dtype == "bfloat16")  # both follow the device's defaults
    assert load_config(None, ["device=cuda"]).actor.archon.enable_compile is True  # the seeds' default on CUDA
    assert cfg.actor.archon.pp_schedule == "Interleaved1F1B"
    assert cfg.actor.archon.ac_mode == "selective"
    assert cfg.actor.archon.reshard_after_forward_policy == "default"
    assert cfg.run_dir == Path("outputs/archon/trial0")


def test_precedence_override_beats_toml_beats_default(tmp_path):
    path = write(
        tmp_path,
        """
seed = 7
[actor.optimizer]
lr = 0.5
weight_decay = 0.25
""",
    )
    cfg = load_config(path, ["actor.optimizer.lr=1e-3"])
    assert cfg.actor.optimizer.lr == 1e-3  # override
    assert cfg.actor.optimizer.weight_decay == 0.25  # toml
    assert cfg.actor.optimizer.eps == 1e-8  # default
    assert cfg.seed == 7


@pytest.mark.parametrize(
    "arg, key, value",
    [
        ("+actor.archon.enable_compile=False", "actor.archon.enable_compile", False),
        ("actor.archon.enable_compile=true", "actor.archon.enable_compile", True),
        ("actor.optimizer.lr=1e-3", "actor.optimizer.lr", 1e-3),
        ('actor.backend="archon:d4"', "actor.backend", "archon:d4"),
        ("actor.backend=archon:(attn:d1p2t2|ffn:d1p2t1e4)", "actor.backend", "archon:(attn:d1p2t2|ffn:d1p2t1e4)"),
        ("actor.optimizer.betas=[0.9, 0.95]", "actor.optimizer.betas", [0.9, 0.95]),
        ("seed = 3", "seed", 3),
    ],
)
def test_parse_override(arg, key, value):
    assert parse_override(arg) == (key, value)


def test_overrides_apply_typed_values():
    cfg = load_config(
        None,
        [
            "+actor.archon.enable_compile=False",
            "actor.optimizer.betas=[0.9, 0.95]",
            "actor.backend=archon:d2",
            "cluster.n_gpus_per_node=8",
            "actor.optimizer.lr=1",
        ],
    )
    assert cfg.actor.archon.enable_compile is False
    assert cfg.actor.optimizer.betas == (0.9, 0.95)
    assert cfg.actor.optimizer.lr == 1.0 and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.actor.backend == "archon:d2"


def test_unknown_key_in_file_names_key_file_and_suggestion(tmp_path):
    path = write(tmp_path, "[actor.optimiser]\nlr = 1.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "actor.optimiser" in msg and str(path) in msg and "did you mean 'actor.optimizer'" in msg


def test_unknown_override_key_suggests_closest():
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'actor\.archon\.enable_compil'.*command line"
        r".*did you mean 'actor\.archon\.enable_compile'",
    ):
        load_config(None, ["actor.archon.enable_compil=false"])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("seed=abc", "config key 'seed' (from the command line) must be an integer, got 'abc'"),
        ("seed=true", "must be an integer, got True"),
        ("actor.archon.enable_compile=1", "must be true or false, got 1"),
        ("actor.archon.ac_mode=selectiv", "did you mean 'selective'"),
        ("actor.optimizer.betas=[0.9]", "must have 2 elements"),
        ("actor.optimizer=3", "is a section"),
        ("actor.optimizer.lr", "has no '='"),
    ],
)
def test_bad_values_are_one_clear_sentence(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_routing_replay_is_refused_for_a_transformers_actor():
    with pytest.raises(ConfigError, match="actor.backend = 'fsdp:d1' runs a transformers model; use an archon:"):
        load_config(None, ["actor.backend=fsdp:d1", "actor.moe_routing_replay=true"])


def test_toml_syntax_error_names_file(tmp_path):
    path = write(tmp_path, "seed = = 3\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_ref_and_critic_inherit_actor_engine_fields(tmp_path):
    path = write(
        tmp_path,
        """
[actor]
backend = "archon:d2t2"
path = "/models/x"
dtype = "float32"
[actor.archon]
ac_mode = "full"
enable_compile = false
[ref.archon]
ac_mode = "none"
[critic]
backend = "archon:d4"
[cluster]
n_gpus_per_node = 8
""",
    )
    cfg = load_config(path)
    assert cfg.ref.backend == "archon:d2t2" and cfg.ref.path == "/models/x" and cfg.ref.dtype == "float32"
    assert cfg.ref.archon.ac_mode == "none"  # set explicitly
    assert cfg.ref.archon.enable_compile is False  # inherited inside a partially set section
    assert cfg.critic.backend == "archon:d4" and cfg.critic.path == "/models/x"
    assert cfg.critic.archon.ac_mode == "full"


def test_bad_allocation_is_reported_against_its_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.backend=d4t2"])
    msg = str(info.value)
    assert msg.startswith("actor.backend (from the command line)") and "d4t2" in msg


def test_training_engine_needs_training_backend():
    with pytest.raises(ConfigError, match="actor.backend = 'sglang:d1' must use a training backend"):
        load_config(None, ["actor.backend=sglang:d1"])
    with pytest.raises(ConfigError, match="rollout.backend = 'archon:d1' must use an inference backend"):
        load_config(None, ["rollout.backend=archon:d1"])


def test_cluster_misfit_is_clear():
    with pytest.raises(ConfigError, match="cluster"):
        load_config(
            None,
            [
                "rollout.backend=sglang:d4t2",
                "actor.backend=archon:d4p2t2",
                "cluster.n_nodes=2",
                "cluster.n_gpus_per_node=8",
            ],
        )


def test_memory_budget_requires_compile():
    with pytest.raises(ConfigError, match="needs torch.compile"):
        load_config(
            None,
            [
                "actor.gradient_checkpointing=true",
                "actor.archon.ac_mode=memory_budget",
                "actor.archon.enable_compile=false",
            ],
        )


def test_moe_options_are_checked():
    cfg = load_config(
        None,
        [
            "actor.archon.moe_load_balance=aux_free",
            "actor.moe_routing_replay=true",
            "actor.archon.moe_router_dtype=float32",
        ],
    )
    assert cfg.actor.archon.moe_load_balance == "aux_free" and cfg.actor.moe_routing_replay
    assert cfg.ref.archon.moe_router_dtype == "float32"  # inherited like every engine field
    with pytest.raises(ConfigError, match="moe_load_balance"):
        load_config(None, ["actor.archon.moe_load_balance=aux"])
    with pytest.raises(ConfigError, match=r"actor\.archon\.moe_aux_loss_coef = -0\.1 must not be negative"):
        load_config(None, ["actor.archon.moe_aux_loss_coef=-0.1"])


def test_toml_round_trip(tmp_path):
    cfg = load_config(None, ["actor.optimizer.lr=3e-4", "gconfig.stop_token_ids=[5, 7]"])
    path = write(tmp_path, to_toml(cfg))
    assert load_config(path) == cfg


def _dataclasses_in(cls: type, seen: set) -> None:
    if cls in seen:
        return
    seen.add(cls)
    for tp in typing.get_type_hints(cls).values():
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            _dataclasses_in(tp, seen)


def test_every_field_has_a_doc():
    seen: set = set()
    _dataclasses_in(Config, seen)
    for cls in seen:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a doc line: {missing}"


def test_describe_section():
    text = describe_section("actor.archon")
    assert "actor.archon.pp_schedule = 'Interleaved1F1B'" in text
    with pytest.raises(ConfigError, match="did you mean 'archon'"):
        describe_section("actor.archn")


def test_ppo_with_a_critic_defaults_to_standard_ppo_normalisation():
    from archon.config import default_norms

    grpo = load_config()
    assert (grpo.actor.reward_norm.mean_level, grpo.actor.reward_norm.std_level) == ("group", "group")
    assert (grpo.actor.adv_norm.mean_level, grpo.actor.adv_norm.std_level) == ("none", "none")
    ppo = load_config(None, ["actor.adv_estimator=gae"])
    assert (ppo.actor.reward_norm.mean_level, ppo.actor.reward_norm.std_level) == ("none", "none")
    assert (ppo.actor.adv_norm.mean_level, ppo.actor.adv_norm.std_level) == ("batch", "batch")
    # The same defaults as default_norms', which load_config applies.
    reward_norm, adv_norm = default_norms("gae")
    assert reward_norm.is_identity and (adv_norm.mean_level, adv_norm.std_level) == ("batch", "batch")
    # Whatever the user sets wins, and a partly set section keeps the schema's other fields.
    own = load_config(None, ["actor.adv_estimator=gae", "actor.reward_norm.mean_level=batch"])
    assert (own.actor.reward_norm.mean_level, own.actor.reward_norm.std_level) == ("batch", "group")
    assert own.actor.adv_norm.mean_level == "batch"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("actor.behav_imp_weight_cap=5.0", "replaced by actor.rejection_sampling.upper"),
        ("actor.behave_imp_weight_mode=token_mask", "actor.rejection_sampling.level and .action"),
        ("actor.rejection_sampling.upper=1.0", "must be above 1 for metric 'ratio'"),
        ("actor.rejection_sampling.lower=0.0", "must be positive for metric 'ratio'"),
        ("actor.rejection_sampling.metric=kl_k3", "needs metric 'ratio'"),  # with action 'clamp', added below
        ("actor.kl_ctl_type=adaptive", "set an initial actor.kl_ctl > 0"),
        ("actor.ppo_epochs=0", "actor.ppo_epochs = 0"),
        ("dynamic_filter.enable=true", "gconfig.n_samples = 1"),
        ("dynamic_filter.max_num_gen_batches=-1", "must be 0 (no limit) or positive"),
    ],
)
def test_rl_option_errors(override, needle):
    overrides = [override]
    if "metric=kl_k3" in override:
        overrides.append("actor.rejection_sampling.action=clamp")
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)


def test_describe_actor_documents_the_rl_options():
    text = describe_section("actor")
    for key in (
        "kl_loss_type",
        "kl_ctl_type",
        "ppo_epochs",
        "shuffle",
        "overlong_filtering",
        "bootstrap_truncated",
        "entropy_coef",
        "importance_sampling_level",
        "mask_no_eos_with_zero",
    ):
        assert f"actor.{key} =" in text, key
    assert "KL(ref||pi)" in text and "seq-mean-token-mean" in text and "AReaL" in text
    rs = describe_section("actor.rejection_sampling")
    assert "actor.rejection_sampling.upper = 5.0" in rs and "'mask'" in rs
    assert "huber" in describe_section("critic") and "max_num_gen_batches" in describe_section("dynamic_filter")


def _job(path: Path) -> str:
    """SFT configs are checked as SFT runs (no rollout server to place)."""
    return "sft" if "sft" in path.stem else "rl"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path, job=_job(path))
    assert cfg.allocations()["actor"].world_size >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_cli_prints_allocation_table(path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = ["--config", str(path), "--job", _job(path)]
    if path == CONFIGS[0]:  # the real entry point once; the others in this process (a start costs ~3 s)
        out = subprocess.run(
            [sys.executable, "-m", "archon.config", *argv],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"COLUMNS": "200", "PATH": ""},
        )
        assert out.returncode == 0, out.stderr
        stdout = out.stdout
    else:
        assert show_main(argv, check=functools.partial(preflight, download=False)) == 0
        stdout = capsys.readouterr().out
    assert "Allocation" in stdout and "world size" in stdout
    cfg = load_config(path, job=_job(path))
    for engine, alloc in cfg.allocations().items():
        assert engine in stdout and str(alloc) in stdout


def test_cli_error_is_one_sentence_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "archon.config", "actor.backend=d4t2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"COLUMNS": "300", "PATH": ""},
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "config error" in out.stderr and "d4t2" in out.stderr


@pytest.mark.parametrize(
    ("short", "schedule"), [("I1F1B", "Interleaved1F1B"), ("IZB", "InterleavedZeroBubble"), ("ZBV", "ZBVZeroBubble")]
)
def test_pp_schedule_takes_the_archon_documents_short_names(short, schedule):
    # Seed 003 and AReaL's docs write I1F1B, IZB and ZBV; I1F1B used to be refused with "did you mean '1F1B'", another
    # schedule.
    cfg = load_config(None, [f"actor.archon.pp_schedule={short}", "critic.archon.pp_schedule=IZB"])
    assert cfg.actor.archon.pp_schedule == schedule
    assert cfg.critic.archon.pp_schedule == "InterleavedZeroBubble"
    with pytest.raises(ConfigError, match="did you mean 'ZBVZeroBubble'"):
        load_config(None, ["actor.archon.pp_schedule=ZBVZeroBubbl"])
