"""Training curves of a run: ``python -m archon.tools.plot OUTPUT_DIR [--out file.png]``.

Reads ``OUTPUT_DIR/metrics.jsonl`` (one JSON object per step, as RL and SFT runs write it)
and draws one panel per group of metrics it finds: reward (mean with a +-std band), response
length, agent episodes (turns, truncation and what the workflows report), actor loss, KL,
train/inference logprob mismatch (with the weight check's figure and the
run's warn and stop bounds, log scale), entropy, gradient norm, the
staleness of asynchronous runs (mean/max and histogram), the behaviour/proximal importance
ratio and the clipped fractions of decoupled PPO, the SFT loss, and for MoE runs the router
statistics (load imbalance of the worst and the mean layer and of every layer, the fraction of
experts that got no token, the auxiliary loss or the largest routing bias).  A panel whose
metrics are absent or null in every step is left out, so the same
command plots RL and SFT runs.  The figure goes to ``OUTPUT_DIR/curves.png`` unless ``--out``
says otherwise; it is drawn with the Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon.errors import DataError

METRICS_FILE = "metrics.jsonl"
DEFAULT_IMAGE = "curves.png"


@dataclass(frozen=True)
class Panel:
    """One subplot and the metrics it draws."""

    title: str
    """Subplot title."""
    keys: tuple[str, ...]
    """Metrics drawn as lines, one per key present in the run; ``prefix*`` stands for every key
    that starts with ``prefix`` (e.g. the buckets of a histogram)."""
    band: tuple[str, str] | None = None
    """``(mean key, std key)``: shade mean - std .. mean + std where both are logged."""
    ylabel: str = ""
    """y-axis label."""
    prefixes: tuple[str, ...] = ()
    """Also draw every metric whose name starts with one of these (per-layer series)."""
    dashed: tuple[str, ...] = ()
    """Keys among ``keys`` drawn dashed: bounds the other lines are held to."""
    log_y: bool = False
    """Logarithmic y axis (values that span orders of magnitude)."""
    skip: tuple[str, ...] = ()
    """Prefixed keys not to draw (another panel has them)."""

    def keys_in(self, records: Sequence[dict[str, Any]]) -> list[str]:
        """The panel's keys, then the prefixed keys found in ``records`` (in natural order)."""
        found = {k for r in records for k in r if any(k.startswith(p) for p in self.prefixes) and k not in self.skip}
        return list(self.keys) + sorted(found, key=_natural)


def _natural(key: str) -> tuple:
    # layer_10 after layer_9, hist/10 after hist/9
    m = re.fullmatch(r"(.*?)(\d+)", key)
    return (m.group(1), int(m.group(2))) if m else (key, -1)


PANELS: tuple[Panel, ...] = (
    Panel("reward", ("reward_mean",), band=("reward_mean", "reward_std"), ylabel="mean reward (+-std)"),
    Panel("response length", ("response_len_mean",), ylabel="tokens"),
    Panel("agent turns", ("agent/turns_mean", "agent/turns_max"), ylabel="requests per episode"),
    Panel(
        "agent episodes",
        ("agent/truncated_frac",),
        prefixes=("agent/",),
        skip=("agent/turns_mean", "agent/turns_max", "agent/truncated_frac"),
        ylabel="mean per episode (what workflows report)",
    ),
    Panel("actor loss", ("actor/loss",)),
    Panel("KL", ("actor/approx_kl", "kl_ref", "kl_teacher")),
    Panel(
        "train/inference mismatch",
        (
            "behav_prox_logprob_diff",
            "mismatch/logprob_diff",
            "weight_check/logprob_diff",
            "mismatch/warn_bound",
            "mismatch/stop_bound",
        ),
        ylabel="mean |logprob diff|",
        dashed=("mismatch/warn_bound", "mismatch/stop_bound"),
        log_y=True,
    ),
    Panel("entropy", ("actor/entropy", "entropy"), ylabel="nats / token"),
    Panel("grad norm", ("actor/grad_norm", "grad_norm")),
    Panel(
        "staleness",
        ("async/staleness_mean", "async/staleness_max", "async/token_staleness_mean"),
        ylabel="policy versions behind",
    ),
    Panel("staleness histogram", (), prefixes=("async/staleness_hist/",), ylabel="fraction of trajectories"),
    Panel(
        "behaviour / proximal ratio",
        ("behav_ratio/mean", "behav_ratio/min", "behav_ratio/max", "actor/behav_imp_weight"),
        ylabel="pi_prox / pi_behav",
    ),
    Panel("clipped", ("actor/clip_frac", "actor/behav_filtered_frac"), ylabel="fraction of tokens"),
    Panel("loss", ("loss",), ylabel="NLL / token"),
    Panel(
        "MoE load imbalance",
        (
            "actor/moe/load_imbalance_max",
            "actor/moe/load_imbalance_mean",
            "moe/load_imbalance_max",
            "moe/load_imbalance_mean",
        ),
        ylabel="max / mean tokens per expert",
    ),
    Panel(
        "MoE load imbalance per layer",
        (),
        prefixes=("actor/moe/load_imbalance/", "moe/load_imbalance/"),
        ylabel="max / mean tokens per expert",
    ),
    Panel(
        "MoE idle experts",
        ("actor/moe/zero_load_expert_frac", "moe/zero_load_expert_frac"),
        ylabel="fraction with no token",
    ),
    Panel(
        "MoE balancing",
        ("actor/moe/aux_loss", "moe/aux_loss", "actor/moe/expert_bias_abs_max", "moe/expert_bias_abs_max"),
        ylabel="aux loss (1 = even) / max |bias|",
    ),
)


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None for missing, null, non-numeric and non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def metrics_path(run: str | Path) -> Path:
    """The metrics file of ``run``: a run directory, or the jsonl file itself."""
    run = Path(run)
    if run.is_file():
        return run
    if not run.exists():
        raise FileNotFoundError(f"run directory '{run}' does not exist; pass the output_dir of a training run")
    path = run / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"'{path}' does not exist; a run writes it after its first step, so check that "
            f"'{run}' is the run's output_dir and that the run has started"
        )
    return path


def load_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run, in file order."""
    path = metrics_path(run)
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                break  # a running job may be halfway through writing its last line
            raise DataError(
                f"{path}:{lineno} is not valid JSON ({exc.msg}); metrics.jsonl holds one JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno} holds a {type(record).__name__}, not a JSON object of metrics")
        records.append(record)
    if not records:
        raise DataError(f"'{path}' holds no metrics yet; plot after the run has logged at least one step")
    return records


def _x(record: dict[str, Any], index: int) -> float:
    """The record's ``step``, or its 1-based position when it has none."""
    step = _number(record.get("step"))
    return step if step is not None else float(index + 1)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records where ``key`` is a finite number; x is ``step`` or the line number."""
    xs, ys = [], []
    for i, record in enumerate(records):
        y = _number(record.get(key))
        if y is None:
            continue
        xs.append(_x(record, i))
        ys.append(y)
    return xs, ys


def _band(records: Sequence[dict[str, Any]], mean_key: str, std_key: str) -> tuple[list[float], ...]:
    """(steps, mean - std, mean + std) where both are finite numbers."""
    xs, lo, hi = [], [], []
    for i, record in enumerate(records):
        mean, std = _number(record.get(mean_key)), _number(record.get(std_key))
        if mean is None or std is None:
            continue
        xs.append(_x(record, i))
        lo.append(mean - std)
        hi.append(mean + std)
    return xs, lo, hi


def panels_for(records: Sequence[dict[str, Any]], panels: Sequence[Panel] = PANELS) -> list[Panel]:
    """The panels with at least one logged value (bounds alone do not make a panel)."""
    return [p for p in panels if any(_series(records, k)[1] for k in p.keys_in(records) if k not in p.dashed)]


def plot_metrics(
    records: Sequence[dict[str, Any]], out: str | Path, title: str = "", panels: Sequence[Panel] = PANELS
) -> list[str]:
    """Draw ``records`` into the PNG ``out``; returns the titles of the panels drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = panels_for(records, panels)
    if not shown:
        keys = sorted({k for p in panels for k in p.keys})
        raise DataError(f"the metrics have none of the plotted keys ({', '.join(keys)}); nothing to draw")
    ncols = min(3, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    # A Figure with its own Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(4.6 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, shown):
        drawn = 0
        for key in panel.keys_in(records):
            xs, ys = _series(records, key)
            if not ys:
                continue
            style = {"linestyle": "--", "linewidth": 1.0} if key in panel.dashed else {"linewidth": 1.5}
            (line,) = ax.plot(xs, ys, label=key, marker="." if len(ys) < 60 else None, **style)
            drawn += 1
            if panel.band is not None and key == panel.band[0]:
                bx, lo, hi = _band(records, *panel.band)
                if bx:
                    ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        if panel.log_y and any(y > 0 for k in panel.keys_in(records) for y in _series(records, k)[1]):
            ax.set_yscale("log", nonpositive="clip")
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if 1 < drawn <= 8:
            ax.legend(fontsize="small")
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return [p.title for p in shown]


def plot_run(run: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Plot a run's metrics.jsonl; returns the image path and the panels drawn."""
    path = metrics_path(run)
    records = load_metrics(path)
    image = Path(out) if out is not None else path.parent / DEFAULT_IMAGE
    return image, plot_metrics(records, image, title=str(path.parent))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.tools.plot", description="Plot the training curves of a run's metrics.jsonl."
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", help=f"image file to write (default: OUTPUT_DIR/{DEFAULT_IMAGE})")
    args = parser.parse_args(argv)
    try:
        image, shown = plot_run(args.output_dir, args.out)
    except (OSError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {image} ({', '.join(shown)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
