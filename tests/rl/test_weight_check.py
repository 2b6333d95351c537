"""The weight check after updates and the train/inference mismatch bounds, against a real built-in server.

The probe's reference is transformers' own forward of the same folder (not the trainer's engine); the
end-to-end runs use the RL trainer with a built-in server started from another model than the actor's.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from hf_fixtures import save_tiny_hf
from rl_runs import _train_expecting_failure, overrides
from safetensors.torch import load_file, save_file
from server_utils import launch_server, wait_healthy
from transformers import AutoModelForCausalLM

from archon.rl.mismatch import MismatchError, MismatchMonitor
from archon.rl.offpolicy import MISMATCH, mismatch, proximal_metrics, proximal_sums
from archon.rl.rollout_batch import FRESH_MASK, Completion, build_rollout_batch
from archon.rl.weight_check import (
    ASYNC_FREQ,
    FLOAT32_TOL,
    HALF_PRECISION_TOL,
    ServerWeightCheck,
    WeightCheckError,
    default_tolerance,
    probe_sampling,
    weight_check_freq,
)


def _perturbed_copy(src: Path, dst: Path, scale: float = 0.05) -> Path:
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        gen = torch.Generator().manual_seed(7)
        save_file({k: v + scale * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, str(file))
    return dst


class HFScorer:
    """Per-token logprobs of a rollout batch from transformers (position i: token i given the tokens before it)."""

    def __init__(self, folder: Path):
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logp = torch.log_softmax(self.model(ids, attention_mask=batch["attention_mask"]).logits.float(), -1)
        out = torch.zeros(ids.shape)
        out[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("wcheck")
    save_tiny_hf(root / "model", "qwen3", seed=11, vocab_size=40)
    server = wait_healthy(launch_server(root / "model"))
    yield root, server.url.removeprefix("http://")
    server.stop()


def _check_worker(addr: str, folder: str, version: str | None, tol: float) -> str:
    from archon.rollout.client import RolloutClient

    client = RolloutClient([addr], setup_timeout=60)
    check = ServerWeightCheck(HFScorer(Path(folder)), [3, 5, 7, 11], {"temperature": 1.0}, tol=tol, n_tokens=6)
    try:
        return json.dumps(check.run(client, version))
    except WeightCheckError as exc:
        return f"WeightCheckError: {exc}"
    finally:
        client.close()


def test_a_server_with_the_trainers_weights_passes_and_one_with_others_fails(served):
    root, addr = served
    ok = json.loads(run_distributed(_check_worker, 1, addr, str(root / "model"), None, FLOAT32_TOL)[0])
    assert 0 <= ok["weight_check/logprob_diff"] < 1e-4
    other = _perturbed_copy(root / "model", root / "other")
    failed = run_distributed(_check_worker, 1, addr, str(other), None, FLOAT32_TOL)[0]
    assert failed.startswith("WeightCheckError: rollout server") and addr in failed
    assert "does not compute with the trainer's weights" in failed and "rollout.weight_check_tol" in failed
    # The server reports the version it holds, not the one the trainer just sent.
    stale = run_distributed(_check_worker, 1, addr, str(root / "model"), "7", FLOAT32_TOL)[0]
    assert "after the update to weight version '7'" in stale and addr in stale


def test_how_often_updates_are_checked():
    assert weight_check_freq(-1, asynchronous=False) == 1  # answered during the next rollout: every update
    assert weight_check_freq(-1, asynchronous=True) == ASYNC_FREQ  # a check waits for busy servers
    assert weight_check_freq(0, asynchronous=False) == 0 and weight_check_freq(3, asynchronous=True) == 3


def test_probe_sampling_and_default_tolerance():
    params = probe_sampling({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 512, "min_new_tokens": 3}, 8)
    assert params["max_new_tokens"] == 8 and params["ignore_eos"] and "min_new_tokens" not in params
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9  # the run's own: same logprob semantics
    assert default_tolerance("float32", "float32") == FLOAT32_TOL
    assert default_tolerance("bfloat16", "float32") == default_tolerance("float32", "bfloat16") == HALF_PRECISION_TOL


def test_the_mismatch_monitor_warns_once_and_stops_past_its_bound(caplog):
    monitor = MismatchMonitor(warn=0.1, stop=0.5)
    assert monitor.bounds() == {"mismatch/warn_bound": 0.1, "mismatch/stop_bound": 0.5}
    with caplog.at_level(logging.WARNING, logger="archon.rl"):
        for step, value in enumerate([1e-7, None, 0.2, 0.3, 0.05], start=1):
            monitor.observe(step, value)
    warnings = [r.message for r in caplog.records if "train/inference mismatch" in r.message]
    assert len(warnings) == 1 and "of step 3 is 0.2" in warnings[0] and "likely causes" in warnings[0]
    with pytest.raises(MismatchError, match=r"step 6 is 0.7 .* > rollout.mismatch_stop = 0.5"):
        monitor.observe(6, 0.7)
    MismatchMonitor(warn=0, stop=0).observe(1, 100.0)  # both off
    assert MismatchMonitor(0, 0).bounds() == {}


def test_the_mismatch_counts_only_tokens_of_the_version_trained():
    completions = [
        Completion([1, 2], [5, 6, 7], [-0.5, -0.25, -1.0], "stop", output_versions=[3, 3, 4]),
        Completion([1], [8, 9], [-2.0, -0.125], "length", output_versions=[4, 4]),
    ]
    batch = build_rollout_batch(completions, [1.0, 0.0], fresh_version=4)
    assert batch[FRESH_MASK].tolist() == [[0, 0, 0, 0, 1], [0, 1, 1, 0, 0]]
    prox = batch["logprobs"].clone()
    prox[0, 2:5] += torch.tensor([0.5, 0.5, 0.25])  # stale tokens differ by 0.5, fresh ones by 0.25 and 0.125
    prox[1, 1:3] += torch.tensor([0.125, -0.125])
    assert mismatch(prox, batch["logprobs"], batch["loss_mask"], batch[FRESH_MASK]) == pytest.approx(
        (0.25 + 0.125 + 0.125) / 3
    )
    assert mismatch(prox, batch["logprobs"], batch["loss_mask"], None) == pytest.approx(1.5 / 5)
    assert mismatch(prox, batch["logprobs"], batch["loss_mask"], torch.zeros_like(prox)) is None
    # Microbatch sums reduced as the engine reduces stats (weighted by each microbatch's loss weight) give the same.
    reduced: dict[str, float] = {}
    weights = [3.0, 2.0]
    for row, w in zip(range(2), weights):
        sums = proximal_sums(
            prox[row : row + 1], batch["logprobs"][row : row + 1], batch["loss_mask"][row : row + 1], w,
            batch[FRESH_MASK][row : row + 1],
        )  # fmt: skip
        for key, value in sums.items():
            if key.endswith(("/min", "/max")):
                reduced[key] = (
                    float(value) if key not in reduced else (min if "min" in key else max)(reduced[key], float(value))
                )
            else:
                reduced[key] = reduced.get(key, 0.0) + float(value) * w / sum(weights)
    assert proximal_metrics(reduced, 5)[MISMATCH] == pytest.approx((0.25 + 0.125 + 0.125) / 3)


def test_a_run_whose_server_serves_another_model_stops_before_it_trains(rl_setup):
    model, data, root = rl_setup
    other = _perturbed_copy(model, root / "other_model")
    args = overrides(model, data, root / "wrong_server", "archon:d1", **{"sglang.model_path": str(other)})
    error = run_distributed(_train_expecting_failure, 1, args, timeout=300)[0]
    assert error.startswith("WeightCheckError") and "does not compute with the trainer's weights" in error
    assert (
        not (root / "wrong_server" / "metrics.jsonl").exists()
        or not (root / "wrong_server" / "metrics.jsonl").read_text().strip()
    )


def test_a_run_past_the_mismatch_bound_stops_after_logging_the_step(rl_setup):
    model, data, root = rl_setup
    # float32 engines agree to ~1e-7: a bound of 1e-12 is crossed at step 1.
    args = overrides(model, data, root / "mismatch_stop", "archon:d1", **{"rollout.mismatch_stop": 1e-12})
    error = run_distributed(_train_expecting_failure, 1, args, timeout=300)[0]
    assert error.startswith("MismatchError: the train/inference mismatch of step 1")
    (line,) = (root / "mismatch_stop" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record[MISMATCH] == record["behav_prox_logprob_diff"] > 1e-12
    assert record["mismatch/stop_bound"] == 1e-12 and record["weight_check/logprob_diff"] < 1e-4
