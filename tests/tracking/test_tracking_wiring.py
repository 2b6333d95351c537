"""The RL trainer feeds the trackers exactly what it writes to metrics.jsonl, from rank 0 only.

A 2-rank run (forked gloo ranks, tiny model, built-in rollout server) with TensorBoard and MLflow
on; both are then read back with their own readers and compared with metrics.jsonl line by line.
"""

from __future__ import annotations

import json
import math

import pytest
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from mlflow.tracking import MlflowClient
from rl_runs import _run, overrides
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.mark.slow
def test_rl_run_feeds_metrics_jsonl_to_the_trackers_from_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads MLflow's file store back
    model = tmp_path / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {a} ?", "answer": str(a)}) + "\n" for a in range(8)))
    out, tb, uri = tmp_path / "run", tmp_path / "tb", (tmp_path / "mlruns").as_uri()
    extra = {
        "total_train_steps": 2,
        "stats_logger.tensorboard.path": str(tb),
        "stats_logger.mlflow.tracking_uri": uri,
        "experiment_name": "wiring",
    }
    _run(2, overrides(model, data, out, backend="archon:d2", **extra))

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    # What a tracker can hold: every finite number of each line (bools as 0/1), at the line's step.
    expected: dict[str, dict[int, float]] = {}
    for r in lines:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                expected.setdefault(key, {})[r["step"]] = float(value)
    assert "reward_mean" in expected and "actor/loss" in expected

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        events = acc.Scalars(key)
        assert [e.step for e in events] == sorted(by_step), key  # one writer: no step twice
        assert {e.step: e.value for e in events} == pytest.approx(by_step, rel=1e-6, abs=1e-30), key

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("wiring")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # one run: rank 1 started none
    assert run.data.params["total_train_steps"] == "2"
    for key, by_step in expected.items():
        history = client.get_metric_history(run.info.run_id, key)
        assert {m.step: m.value for m in history} == by_step, key
