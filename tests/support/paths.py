"""Where the repository and the test helpers are, for tests that start subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
SUPPORT = Path(__file__).resolve().parent
"""tests/support: the helpers tests import as top-level modules (dist_utils, fake_sglang, reward_fns, ...)."""


def helpers_pythonpath() -> str:
    """PYTHONPATH of a subprocess that imports Archon from this checkout and the test helpers."""
    return os.pathsep.join([str(REPO), str(SUPPORT)])
