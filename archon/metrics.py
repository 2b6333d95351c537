"""Per-step metrics: ``metrics.jsonl`` in the run directory and a live display on rank 0."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


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


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and shows progress (rank 0 only).

    On a terminal the display is a rich progress bar with the headline metrics; elsewhere
    (CI logs, files) it prints one plain line per step.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        enabled: bool = True,
        headline: tuple[str, ...] = ("loss",),
        start_step: int = 0,
    ):
        self.enabled = enabled
        self.headline = headline
        self.total_steps = total_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self._progress = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
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
        info = "  ".join(f"{k}={record[k]:.4g}" for k in self.headline if isinstance(record.get(k), (int, float)))
        if self._progress is not None:
            self._progress.update(self._task, completed=record.get("step", 0), info=info)
        else:
            print(f"step {record.get('step')}/{self.total_steps}  {info}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
