"""Run a Makefile target's recipe as a user would, in a scratch folder (for the tests of `make run-*` demos)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from paths import REPO


def recipe(target: str) -> list[str]:
    """The command lines of ``target`` in the Makefile, with make's ``$(PY)`` spelled as this interpreter."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        commands.append(line.strip().replace("$(PY)", sys.executable))
    return commands


def run_recipe(target: str, cwd: Path, extra: dict[str, list[str]] | None = None) -> None:
    """Run ``target``'s commands in ``cwd`` (its relative outputs/ paths land there; scripts and configs come from
    the repository); ``extra`` appends overrides to the command naming each of its keys (e.g. ``train_rl.py``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command in recipe(target):
        command = command.replace("scripts/", f"{REPO}/scripts/").replace("configs/", f"{REPO}/configs/")
        for key, overrides in (extra or {}).items():
            if key in command:
                command += " " + " ".join(overrides)
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
