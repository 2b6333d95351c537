"""What every experiment tracker does, and the conversions the trackers share."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from archon.errors import ArchonError

TRACK_EXTRA = "pip install 'archon[track]'"
"""How a user installs every tracker library at once (pyproject's optional dependencies)."""

RUN_IDS_FILE = "tracker_run_ids.json"
"""File in the run directory holding each tracker's run id, so that a resumed run continues the same run."""


class TrackerUnavailable(ArchonError, ImportError):
    """A configured tracker's package is not installed; the message names the pip extra that brings it."""


class Tracker(Protocol):
    """One experiment-tracking sink, fed on rank 0 with each step's numbers."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` (finite numbers, ``step`` left out) at ``step``."""
        ...

    def close(self) -> None:
        """Flush and end the run; called once."""
        ...


def import_tracker_library(module: str, section: str) -> ModuleType:
    """Import a tracker's library, which is optional: only a configured tracker needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerUnavailable(
            f"stats_logger.{section} is configured but its package cannot be imported ({exc}); "
            f"install it with {TRACK_EXTRA}, or leave stats_logger.{section} unset"
        ) from None


def tracked_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` record that a tracker can plot.

    Finite ints and floats (bools as 0/1) under their own keys; ``step`` is passed apart, and
    None (what metrics.jsonl writes for a non-finite value), strings and lists are left out.
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (bool, int, float)):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def config_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as a nested dict of JSON values (tuples as lists, paths and the rest as text)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level with dotted keys (``actor.optimizer.lr``), for trackers that take flat params."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def load_run_id(run_dir: Path, tracker: str) -> str | None:
    """The run id ``tracker`` saved in ``run_dir`` on an earlier start, if any."""
    path = run_dir / RUN_IDS_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())
    except ValueError:
        return None  # a file cut short by a kill: start a new tracker run rather than fail
    found = ids.get(tracker) if isinstance(ids, dict) else None
    return found if isinstance(found, str) and found else None


def save_run_id(run_dir: Path, tracker: str, run_id: str) -> None:
    """Keep ``tracker``'s run id in ``run_dir`` (atomically) so a resumed run continues that run."""
    path = run_dir / RUN_IDS_FILE
    ids: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text())
            ids = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            ids = {}
    ids[tracker] = run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    tmp.replace(path)
