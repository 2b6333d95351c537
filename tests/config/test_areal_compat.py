"""AReaL behaviours the seeds describe: allocation_mode, scheduler.type, enable_tree_training, pad_to_maximum under
compile, and what critic/ref/teacher inherit from the actor."""

from __future__ import annotations

import dataclasses
import logging
import shlex
from pathlib import Path

import pytest

from archon.cli import run_job
from archon.config import INHERITED_ENGINE_FIELDS, Config, ConfigError, load_config
from archon.config.scheduler import LaunchError, SchedulerConfig, check_launched
from archon.engine.microbatch_loop import pads_to_maximum
from archon.field_docs import field_docs
from archon.launch.discovery import LAUNCH_ID_ENV


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# ---- allocation_mode ------------------------------------------------------------------------------------------------


def test_allocation_mode_is_split_into_the_two_backends_with_a_deprecation_note(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="archon.config"):
        cfg = load_config(None, ["allocation_mode=sglang:d4t2+archon:d2p2", "cluster.n_nodes=2"])
    assert (cfg.rollout.backend, cfg.actor.backend) == ("sglang:d4t2", "archon:d2p2")
    assert cfg.ref.backend == "archon:d2p2"  # inherits the actor's, as any empty backend
    assert "deprecated" in _warnings(caplog) and "rollout.backend = 'sglang:d4t2'" in _warnings(caplog)


def test_allocation_mode_in_a_yaml_file_with_areal_size_one_dims_and_named_components(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("allocation_mode: sglang[rollout]:d2p1t2+archon[critic]:d4t1+archon[actor]:d2t2\n")
    cfg = load_config(path)
    assert (cfg.rollout.backend, cfg.actor.backend, cfg.critic.backend) == ("sglang:d2t2", "archon:d2t2", "archon:d4")


def test_allocation_mode_that_agrees_with_the_backends_is_accepted_and_one_that_disagrees_is_not() -> None:
    cfg = load_config(None, ["allocation_mode=sglang:d2+archon:d2", "actor.backend=archon:d2t1"])
    assert cfg.actor.backend == "archon:d2"
    with pytest.raises(ConfigError, match=r"gives actor.backend = 'archon:d4'.*'archon:d2'.*the command line"):
        load_config(None, ["allocation_mode=sglang:d2+archon:d4", "actor.backend=archon:d2"])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("sglang:d2+archon[policy]:d2", "no single engine takes"),
        ("sglang.d2t2p1+d1t4p1", "allocation_mode"),  # AReaL's legacy form: the grammar's own fix
        ("sglang:d4t4+megatron:d4", "megatron"),
    ],
)
def test_bad_allocation_modes_are_one_sentence(mode: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [f"allocation_mode={mode}"])


# ---- scheduler.type -------------------------------------------------------------------------------------------------


def test_a_ray_or_slurm_run_started_outside_the_launcher_is_told_the_command() -> None:
    check_launched(SchedulerConfig("local"), "x.yaml", [], launched=False)
    check_launched(SchedulerConfig("ray"), "x.yaml", [], launched=True)  # started by python -m archon.launch
    with pytest.raises(LaunchError) as info:
        check_launched(SchedulerConfig("ray"), "x.yaml", ["actor.path=/m y"], launched=False)
    assert "`python -m archon.launch ray --config x.yaml 'actor.path=/m y'`" in str(info.value)
    with pytest.raises(LaunchError, match="`python -m archon.launch slurm --config x.yaml --submit`"):
        check_launched(SchedulerConfig("slurm"), "x.yaml", [], launched=False)


def test_the_trainer_entry_point_refuses_a_ray_config_unless_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  type: ray\n")
    ran: list[Config] = []
    monkeypatch.delenv(LAUNCH_ID_ENV, raising=False)
    assert run_job(ran.append, None, ["--config", str(path), "seed=3"]) == 2
    command = shlex.join(["python", "-m", "archon.launch", "ray", "--config", str(path), "seed=3"])
    assert ran == [] and command in capsys.readouterr().err
    monkeypatch.setenv(LAUNCH_ID_ENV, "ray-test")
    assert run_job(ran.append, None, ["--config", str(path)]) == 0
    assert [c.scheduler.type for c in ran] == ["ray"]


# ---- enable_tree_training -------------------------------------------------------------------------------------------


def test_enable_tree_training_turns_on_prefix_sharing() -> None:
    cfg = load_config(None, ["actor.enable_tree_training=true"])
    assert cfg.actor.archon.prefix_sharing
    default = load_config(None).actor
    default.archon.prefix_sharing = True
    assert cfg.actor == default  # nothing else changes


# ---- pad_to_maximum under compile -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("compile_on", "bound", "own", "expected"),
    [(True, 64, None, True), (False, 64, None, False), (True, 0, None, False), (True, 64, False, True)],
)
def test_pad_to_maximum_is_set_under_compile_when_there_is_a_bound(
    caplog: pytest.LogCaptureFixture, compile_on: bool, bound: int, own: bool | None, expected: bool
) -> None:
    overrides = [f"actor.archon.enable_compile={compile_on}", f"actor.mb_spec.max_tokens_per_mb={bound}"]
    overrides += [] if own is None else [f"actor.pad_to_maximum={own}"]
    with caplog.at_level(logging.INFO, logger="archon.config"):
        cfg = load_config(None, overrides)
    for engine in ("actor", "critic", "ref", "teacher"):
        section = getattr(cfg, engine)
        assert section.pad_to_maximum is expected
        assert pads_to_maximum(section) is expected  # what the engine does with the same section
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("pad_to_maximum set to true" in said) == (expected and own is None)
    assert ("pad_to_maximum = false is overridden" in _warnings(caplog)) == (own is False)


# ---- inheritance from the actor -------------------------------------------------------------------------------------


def test_critic_ref_and_teacher_inherit_every_engine_field_they_do_not_set() -> None:
    cfg = load_config(
        None,
        [
            "actor.path=/models/policy",
            "actor.model_config=/models/policy/config.json",
            "actor.dtype=float32",
            "actor.grad_reduce_dtype=bfloat16",
            "actor.gradient_checkpointing=true",
            "actor.optimizer.lr=3e-6",
            "actor.mb_spec.n_mbs=2",
            "actor.archon.ac_mode=full",
            "actor.backend=archon:d2",
            "ref.archon.enable_compile=false",
            "teacher.path=/models/teacher",
        ],
    )
    actor = cfg.actor
    assert set(INHERITED_ENGINE_FIELDS) == {f.name for f in dataclasses.fields(cfg.ref)}
    for engine in ("critic", "ref", "teacher"):
        section = getattr(cfg, engine)
        for name in INHERITED_ENGINE_FIELDS:
            if (engine, name) in (("teacher", "path"), ("ref", "archon")):
                continue
            assert getattr(section, name) == getattr(actor, name), f"{engine}.{name}"
    assert cfg.teacher.path == "/models/teacher"
    assert cfg.ref.archon == dataclasses.replace(actor.archon, enable_compile=False)  # the rest of the section


@pytest.mark.parametrize("engine", ["critic", "ref", "teacher"])
def test_the_docs_of_critic_ref_and_teacher_name_every_inherited_field(engine: str) -> None:
    doc = field_docs(Config)[engine]
    missing = [name for name in INHERITED_ENGINE_FIELDS if name not in doc]
    assert not missing, f"Config.{engine}'s doc does not say it inherits {missing}"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["actor.adv_estimator=gae"], True),
        (["actor.adv_estimator=gae", "critic.path="], True),
        (["actor.adv_estimator=gae", "critic.path=/models/value"], False),
        ([], False),  # GRPO trains no critic
    ],
)
def test_a_critic_that_takes_the_actors_model_path_is_warned_about(
    caplog: pytest.LogCaptureFixture, overrides: list[str], warned: bool
) -> None:
    with caplog.at_level(logging.WARNING, logger="archon.config"):
        cfg = load_config(None, ["actor.path=/models/policy", *overrides])
    assert ("critic.path is not set" in _warnings(caplog)) == warned
    assert cfg.critic.path == ("/models/value" if "critic.path=/models/value" in overrides else "/models/policy")
