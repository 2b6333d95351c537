"""The ``stats_logger`` config section: the experiment trackers a run feeds (``archon.tracking``), AReaL's names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class WandBConfig:
    mode: Literal["disabled", "online", "offline"] = "disabled"
    """Weights & Biases: 'online' streams to the server, 'offline' writes under output_dir/wandb for `wandb sync`."""
    wandb_base_url: str = ""
    """W&B server URL (a self-hosted one); empty uses WANDB_BASE_URL or the public service. The key is WANDB_API_KEY."""
    entity: str = ""
    """W&B team or user that owns the run; empty uses your default entity."""
    project: str = ""
    """W&B project; empty uses experiment_name."""
    name: str = ""
    """Run name shown in W&B; empty uses trial_name."""
    group: str = ""
    """W&B group that collects related runs; empty sets none."""
    job_type: str = ""
    """W&B job type (e.g. 'rl', 'sft'); empty sets none."""
    notes: str = ""
    """Free-text notes attached to the W&B run."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""


@dataclass
class TensorBoardConfig:
    path: str = ""
    """Folder for TensorBoard event files (e.g. outputs/x/tb); empty disables TensorBoard."""


@dataclass
class MLflowConfig:
    tracking_uri: str = ""
    """MLflow tracking URI: a server (http://host:5000) or a local store (file:///abs/mlruns); empty disables MLflow."""
    experiment_name: str = ""
    """MLflow experiment, created when missing; empty uses experiment_name."""
    run_name: str = ""
    """MLflow run name; empty uses trial_name."""
    tags: dict[str, str] = field(default_factory=dict)
    """MLflow tags of the run (key = value)."""


@dataclass
class StatsLoggerConfig:
    wandb: WandBConfig = field(default_factory=WandBConfig)
    """Weights & Biases tracking (pip extra 'track')."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard event files (pip extra 'track')."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """MLflow tracking (pip extra 'track', which brings mlflow-skinny)."""
