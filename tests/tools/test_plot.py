"""``python -m archon.tools.plot``: curves from metrics.jsonl, absent metrics skipped, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from archon.tools.plot import PANELS, load_metrics, main, panels_for, plot_metrics, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(run: Path, records: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rl_records(n: int = 12) -> list[dict]:
    """RL-shaped metrics; no reference model (kl_ref null) and no mismatch metric at all."""
    return [
        {
            "step": s,
            "reward_mean": s / n,
            "reward_std": 0.3 * math.sqrt(s / n * (1 - s / n)),
            "response_len_mean": 1.0,
            "actor/loss": 0.01 * (-1) ** s,
            "actor/approx_kl": 1e-3 * s,
            "kl_ref": None,
            "actor/entropy": 2.5 - 0.2 * s,
        }
        for s in range(1, n + 1)
    ]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_rl_metrics_give_a_png_without_the_absent_panels(tmp_path):
    _write(tmp_path / "run", _rl_records())
    image, shown = plot_run(tmp_path / "run")
    assert image == tmp_path / "run" / "curves.png" and _is_png(image)
    assert shown == ["reward", "response length", "actor loss", "KL", "entropy"]
    assert "train/inference mismatch" not in shown  # key absent
    assert "loss" not in shown and "grad norm" not in shown


def test_null_only_metrics_are_skipped_and_nulls_are_gaps(tmp_path):
    records = _rl_records()
    for r in records:
        r["behav_prox_logprob_diff"] = None
        r["actor/approx_kl"] = None
    records[3]["reward_mean"] = None
    records[5]["reward_std"] = float("nan")
    titles = [p.title for p in panels_for(records)]
    assert "KL" not in titles and "train/inference mismatch" not in titles and "reward" in titles
    plot_metrics(records, tmp_path / "x.png")
    assert _is_png(tmp_path / "x.png")


def test_sft_metrics_plot_loss_and_grad_norm(tmp_path):
    records = [{"step": s, "loss": 2.5 / s, "grad_norm": 1.0 + 0.1 * s, "lr": 1e-3} for s in range(1, 9)]
    _write(tmp_path / "sft", records)
    out = tmp_path / "elsewhere" / "sft.png"
    assert main([str(tmp_path / "sft"), "--out", str(out)]) == 0
    assert _is_png(out)
    assert [p.title for p in panels_for(records)] == ["grad norm", "loss"]


def test_records_without_step_use_line_numbers(tmp_path):
    path = _write(tmp_path / "run", [{"loss": 1.0}, {"loss": 0.5}])
    # A metrics file can be passed directly too.
    image, shown = plot_run(path, tmp_path / "p.png")
    assert shown == ["loss"] and _is_png(image)


def test_a_half_written_last_line_is_ignored_but_a_broken_middle_line_is_an_error(tmp_path):
    path = _write(tmp_path / "run", _rl_records(3))
    with path.open("a") as fh:
        fh.write('{"step": 4, "reward_me')
    assert [r["step"] for r in load_metrics(tmp_path / "run")] == [1, 2, 3]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
        load_metrics(tmp_path / "run")


def test_errors_are_one_sentence(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "run directory" in err and "does not exist" in err and "Traceback" not in err
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl' does not exist"):
        plot_run(tmp_path / "empty_dir")
    _write(tmp_path / "empty_file", [])
    assert main([str(tmp_path / "empty_file")]) == 2
    assert "holds no metrics yet" in capsys.readouterr().err
    _write(tmp_path / "unknown", [{"step": 1, "something_else": 1.0}])
    with pytest.raises(ValueError, match="none of the plotted keys"):
        plot_run(tmp_path / "unknown")
    assert not (tmp_path / "unknown" / "curves.png").exists()


def test_every_listed_metric_has_a_panel():
    keys = {k for p in PANELS for k in p.keys}
    for key in (
        "reward_mean",
        "response_len_mean",
        "actor/loss",
        "actor/approx_kl",
        "kl_ref",
        "behav_prox_logprob_diff",
        "actor/entropy",
        "loss",
        "grad_norm",
    ):
        assert key in keys, key


def test_moe_router_statistics_get_their_panels(tmp_path):
    records = _rl_records()
    for r in records:
        step = r["step"]
        r.update(
            {
                "actor/moe/load_imbalance_max": 3.0 / step,
                "actor/moe/load_imbalance_mean": 2.0 / step,
                "actor/moe/zero_load_expert_frac": 0.5 / step,
                "actor/moe/aux_loss": 1.0 + 1.0 / step,
            }
        )
        for layer in range(12):
            r[f"actor/moe/load_imbalance/layer_{layer}"] = 1.0 + layer / step
    image, shown = plot_run(_write(tmp_path / "moe", records).parent)
    assert _is_png(image)
    assert shown[-4:] == ["MoE load imbalance", "MoE load imbalance per layer", "MoE idle experts", "MoE balancing"]
    per_layer = next(p for p in PANELS if p.title == "MoE load imbalance per layer")
    keys = per_layer.keys_in(records)
    assert keys[:3] == [f"actor/moe/load_imbalance/layer_{i}" for i in range(3)] and len(keys) == 12
    assert keys[-1] == "actor/moe/load_imbalance/layer_11"  # natural order, not string order
    # A dense run draws none of them.
    assert not [t for t in plot_run(_write(tmp_path / "dense", _rl_records()).parent)[1] if t.startswith("MoE")]


def test_asynchronous_runs_get_staleness_histogram_and_decoupled_ratio_panels(tmp_path):
    records = _rl_records()
    for r in records:
        k = min(r["step"] - 1, 2)
        r.update(
            {
                "async/staleness_mean": k,
                "async/staleness_max": k,
                "async/token_staleness_mean": k * 0.8,
                "behav_ratio/mean": 1.0,
                "behav_ratio/min": 0.5,
                "behav_ratio/max": 3.0,
                "actor/clip_frac": 0.1,
                "actor/behav_filtered_frac": 0.01,
            }
        )
        r.update({f"async/staleness_hist/{j}": float(j == k) for j in range(11)})
    titles = [p.title for p in panels_for(records)]
    for title in ("staleness", "staleness histogram", "behaviour / proximal ratio", "clipped"):
        assert title in titles, title
    # One line per bucket, in numeric order (10 after 9).
    buckets = next(p for p in PANELS if p.title == "staleness histogram").keys_in(records)
    assert buckets == [f"async/staleness_hist/{j}" for j in range(11)]
    plot_metrics(records, tmp_path / "async.png")
    assert _is_png(tmp_path / "async.png")
    # A synchronous run has none of these panels.
    assert "staleness" not in [p.title for p in panels_for(_rl_records())]


def test_the_mismatch_panel_draws_the_mismatch_and_its_bounds_but_bounds_alone_draw_nothing(tmp_path):
    panel = next(p for p in PANELS if p.title == "train/inference mismatch")
    assert panel.log_y and set(panel.dashed) == {"mismatch/warn_bound", "mismatch/stop_bound"}
    bounds = {"mismatch/warn_bound": 0.1, "mismatch/stop_bound": 0.5}
    only_bounds = [{"step": s, "reward_mean": 0.5, **bounds} for s in (1, 2)]
    assert panel not in panels_for(only_bounds)
    records = [
        {"step": 1, "reward_mean": 0.1, "mismatch/logprob_diff": 1e-7, "weight_check/logprob_diff": 2e-7, **bounds},
        {"step": 2, "reward_mean": 0.2, "mismatch/logprob_diff": 0.3, "weight_check/logprob_diff": 0.0, **bounds},
    ]
    assert panel in panels_for(records)
    assert "train/inference mismatch" in plot_metrics(records, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_agent_runs_get_turn_and_episode_panels(tmp_path: Path):
    records = [
        {"step": s, "reward_mean": 0.1 * s, "agent/turns_mean": 2.0, "agent/turns_max": 2.0,
         "agent/truncated_frac": 0.0, "agent/tool_ok": 0.2 * s, "agent/answer_right": 0.1 * s}
        for s in range(1, 4)
    ]  # fmt: skip
    panels = {p.title: p for p in panels_for(records)}
    assert panels["agent turns"].keys_in(records) == ["agent/turns_mean", "agent/turns_max"]
    assert panels["agent episodes"].keys_in(records) == ["agent/truncated_frac", "agent/answer_right", "agent/tool_ok"]
    plot_metrics(records, tmp_path / "agent.png")
    assert (tmp_path / "agent.png").stat().st_size > 0
