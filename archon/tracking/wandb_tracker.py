"""Weights & Biases: one W&B run per Archon run, online or offline (under the run directory)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from archon.config.stats_logger import WandBConfig
from archon.tracking.base import import_tracker_library, load_run_id, save_run_id


class WandBTracker:
    """Logs each step's numbers to a W&B run, the run's config recorded at start.

    A resumed run (``start_step > 0``) continues the W&B run whose id the run directory keeps.
    W&B's step only moves forward, so the steps a resumed run redoes (after its checkpoint) keep
    the values first logged for them.  Offline runs are written under ``<run_dir>/wandb`` and
    uploaded later with ``wandb sync``.
    """

    def __init__(
        self,
        cfg: WandBConfig,
        run_config: dict[str, Any],
        run_dir: Path,
        default_project: str,
        default_name: str,
        start_step: int = 0,
    ):
        wandb = import_tracker_library("wandb", "wandb")
        run_id = load_run_id(run_dir, "wandb") if start_step > 0 else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            save_run_id(run_dir, "wandb", run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(base_url=cfg.wandb_base_url) if cfg.wandb_base_url else None
        self.run = wandb.init(
            project=cfg.project or default_project,
            entity=cfg.entity or None,
            name=cfg.name or default_name,
            group=cfg.group or None,
            job_type=cfg.job_type or None,
            notes=cfg.notes or None,
            tags=list(cfg.tags) or None,
            config=run_config,
            dir=str(run_dir),
            mode=cfg.mode,
            id=run_id,
            resume="allow",
            settings=settings,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
