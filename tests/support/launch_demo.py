"""The CPU demo as the launch tests run it: its folder, config overrides and a subprocess environment."""

from __future__ import annotations

import os
from pathlib import Path

from paths import REPO, helpers_pythonpath

DEMO = REPO / "configs" / "cpu_demo.toml"


def _demo_overrides(assets, out: Path, steps: int) -> list[str]:
    return [
        f"actor.path={assets.model}",
        f"train_dataset.path={assets.train}",
        f"output_dir={out}",
        f"total_train_steps={steps}",
        "saver.export_hf=false",
        "reward.n_workers=0",
    ]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": helpers_pythonpath(), **extra}
