"""What the Slurm and Ray launchers share: the entry points they start and the run's arguments."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from archon.alloc import AllocationError
from archon.config import Config, ConfigError, load_config
from archon.errors import ArchonError, ClusterError
from archon.plan import ClusterPlan, Job, plan_for_config


class LaunchError(ArchonError, RuntimeError):
    """A process of a launched run failed; the message names it, its node and the last lines of its log."""


REPO_ROOT = Path(__file__).resolve().parents[2]

_ENTRY_POINTS = {"rl": "train_rl.py", "sft": "train_sft.py"}


def entry_point(job: Job) -> Path:
    """``scripts/train_rl.py`` (or ``train_sft.py``) of this checkout, which every training rank runs."""
    path = REPO_ROOT / "scripts" / _ENTRY_POINTS[job]
    if not path.is_file():
        raise ClusterError(
            f"{path} does not exist: the cluster launchers start the training ranks with the entry "
            "points of a source checkout; install Archon from its repository (pip install -e .)"
        )
    return path


def run_args(config: str | None, overrides: Sequence[str]) -> list[str]:
    """``--config <absolute path> [overrides]``: what every process of the run parses, from any directory."""
    args = ["--config", str(Path(config).absolute())] if config else []
    return args + list(overrides)


def load_run(config: str | None, overrides: Sequence[str], job: Job) -> tuple[Config, ClusterPlan]:
    """The config (checked) and its cluster plan; a layout that does not fit is one sentence."""
    if config and not Path(config).is_file():
        raise ConfigError(f"--config {config}: no such file")
    cfg = load_config(config, overrides, job=job)
    try:
        plan = plan_for_config(cfg, job)
    except AllocationError as exc:
        raise ClusterError(str(exc)) from None
    if not plan.train_ranks:
        raise ClusterError(f"the plan of {config or 'this config'} has no training rank; set actor.backend")
    return cfg, plan


def python_executable() -> str:
    """The interpreter the launcher runs under: the same environment is expected on every node."""
    return sys.executable


def describe_gpus(gpus: Sequence[int]) -> str:
    """'0-7' for a contiguous range, '0,2,5' otherwise."""
    gpus = list(gpus)
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))
