"""The ``scheduler`` config section (AReaL's ``scheduler.type``): which launcher a run is meant to be started by.

Archon's trainer never starts a cluster itself: a Ray or Slurm run is started by ``python -m archon.launch ray``
or ``slurm``, which start every rollout server and training rank where the cluster plan puts them.  A config that
says ``scheduler.type = 'ray'`` therefore loads everywhere (the launcher, ``python -m archon.plan``), and the
trainer refuses to start outside that launcher with the command that starts it (``check_launched``).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from archon.errors import ArchonError


class LaunchError(ArchonError, ValueError):
    """A run whose config asks for a cluster launcher was started without it."""


@dataclass
class SchedulerConfig:
    type: Literal["local", "ray", "slurm"] = "local"
    """How the run is started (AReaL's scheduler.type; null is 'local'): 'local' by torchrun on this node, 'ray' or
    'slurm' by `python -m archon.launch ray|slurm --config ...`; the trainer refuses to start outside that launcher."""


def launch_command(kind: str, config_path: str | None, overrides: Sequence[str]) -> str:
    """The ``python -m archon.launch`` command line that starts a run of ``config_path`` on ``kind`` (ray, slurm)."""
    words = ["python", "-m", "archon.launch", kind]
    if config_path:
        words += ["--config", str(config_path)]
    if kind == "slurm":
        words.append("--submit")
    return shlex.join([*words, *overrides])


def check_launched(
    scheduler: SchedulerConfig, config_path: str | None, overrides: Sequence[str], launched: bool
) -> None:
    """Refuse a trainer start that ``scheduler.type`` says belongs to a cluster launcher, unless ``launched``
    (the process was started by ``python -m archon.launch``)."""
    if scheduler.type == "local" or launched:
        return
    raise LaunchError(
        f"scheduler.type = '{scheduler.type}' says this run is started by Archon's {scheduler.type.capitalize()} "
        f"launcher, which starts the rollout servers and every training rank where the cluster plan puts them; run "
        f"`{launch_command(scheduler.type, config_path, overrides)}` (or set scheduler.type=local to train on this "
        "node with torchrun)"
    )
