"""Per-step metrics: ``metrics.jsonl`` in the run directory, the configured trackers and a live display on rank 0."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from archon.config.schema import Config
from archon.tracking import Trackers, build_trackers, tracked_values


def peak_memory_gb(device_type: str) -> float:
    """Peak accelerator memory (CUDA), or the process's peak resident memory on CPU."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_duration(seconds: float) -> str:
    """``seconds`` as H:MM:SS, the form rich's progress columns use."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``, feeds the trackers and shows progress (rank 0 only).

    On a terminal the display is a rich progress bar with the ETA and the headline metrics;
    elsewhere (CI logs, files) it prints one plain line per step (step/total, elapsed, ETA,
    headline metrics) without control characters.  ``run_config`` turns on the trackers its
    ``stats_logger`` section configures (``archon.tracking``), each fed every record's numbers
    at the record's step.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        enabled: bool = True,
        headline: tuple[str, ...] = ("loss",),
        start_step: int = 0,
        run_config: Config | None = None,
        stream: TextIO | None = None,
    ):
        self.enabled = enabled
        self.headline = headline
        self.total_steps = total_steps
        self.start_step = start_step
        self.path = Path(run_dir) / "metrics.jsonl"
        self.stream = stream if stream is not None else sys.stdout
        self._progress = None
        self._trackers = Trackers([])
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        if run_config is not None:
            self._trackers = build_trackers(run_config, start_step)
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()
        self._t0 = time.perf_counter()

    def _truncate_after(self, step: int) -> None:
        """Drop lines of steps a resumed run will redo (written after the checkpoint).

        A line cut short by a kill mid-write is dropped too; the file is replaced atomically, so a
        kill now loses nothing.
        """
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(self.path)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _jsonable(v) for k, v in metrics.items()}
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        step = record.get("step")
        if isinstance(step, int):
            self._trackers.log(step, tracked_values(record))
        info = "  ".join(f"{k}={record[k]:.4g}" for k in self.headline if isinstance(record.get(k), (int, float)))
        if self._progress is not None:
            self._progress.update(self._task, completed=step or 0, info=info)
        else:
            print(f"step {step}/{self.total_steps}  {self._timing(step)}  {info}", file=self.stream, flush=True)

    def _timing(self, step: Any) -> str:
        """Elapsed time and the ETA at this step's pace since the logger started (plain-line display)."""
        elapsed = time.perf_counter() - self._t0
        done = step - self.start_step if isinstance(step, int) else 0
        eta = format_duration(elapsed / done * max(self.total_steps - step, 0)) if done > 0 else "?"
        return f"elapsed {format_duration(elapsed)}  ETA {eta}"

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._trackers.close()
