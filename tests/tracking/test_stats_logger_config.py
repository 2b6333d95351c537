"""The stats_logger section loads from TOML and dotted overrides, with AReaL's names."""

from __future__ import annotations

import pytest

from archon.config import ConfigError, load_config


def test_stats_logger_loads_from_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[stats_logger.wandb]\nmode = "offline"\nproject = "p"\ntags = ["a", "b"]\n'
        '[stats_logger.mlflow]\ntracking_uri = "file:///tmp/mlruns"\n'
    )
    cfg = load_config(
        path,
        [
            "stats_logger.tensorboard.path=outputs/tb",
            "stats_logger.wandb.name=run7",
            "stats_logger.mlflow.tags.team=rl",
        ],
        validate=False,
    )
    wandb = cfg.stats_logger.wandb
    assert (wandb.mode, wandb.project, wandb.name, wandb.tags) == ("offline", "p", "run7", ["a", "b"])
    assert cfg.stats_logger.tensorboard.path == "outputs/tb"
    assert cfg.stats_logger.mlflow.tracking_uri == "file:///tmp/mlruns"
    assert cfg.stats_logger.mlflow.tags == {"team": "rl"}


def test_defaults_turn_every_tracker_off():
    cfg = load_config(validate=False)
    assert cfg.stats_logger.wandb.mode == "disabled"
    assert cfg.stats_logger.tensorboard.path == "" and cfg.stats_logger.mlflow.tracking_uri == ""


def test_bad_wandb_mode_is_one_clear_sentence():
    with pytest.raises(ConfigError, match=r"stats_logger\.wandb\.mode.*'offline'"):
        load_config(overrides=["stats_logger.wandb.mode=ofline"], validate=False)
