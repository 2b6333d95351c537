"""Evaluation during an RL run and ``python -m archon.eval``, end to end on the built-in CPU server.

The reference for the greedy accuracy is independent of Archon's generation: transformers' model on the run's HF
export decodes each prompt greedily, and the test scores the text with the reward function itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import REPO, helpers_pythonpath
from reward_fns import length_reward
from rl_runs import _run, overrides
from transformers import AutoModelForCausalLM, AutoTokenizer

from archon.config import load_config
from archon.data.from_config import build_rl_dataset

THRESHOLD = 17.5  # characters of a 5-token completion: some prompts' greedy completions pass, some do not
EVAL = {"evaluator.freq_steps": 1, "evaluator.n_samples": 2, "evaluator.correct_threshold": THRESHOLD}


def _args(eval_setup, out: Path, **extra) -> list[str]:
    model, train, valid, _ = eval_setup
    return overrides(model, train, out, total_train_steps=2, **{**EVAL, "valid_dataset.path": str(valid), **extra})


@pytest.fixture(scope="module")
def eval_run(eval_setup):
    """A 2-step RL run that evaluates at every step and exports its final actor."""
    out = eval_setup[3] / "run"
    args = _args(eval_setup, out, **{"saver.export_hf": True})
    return _run(1, args), out, args


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@torch.no_grad()
def _greedy_reference(hf_dir: Path, args: list[str]) -> tuple[list[str], float]:
    """transformers' greedy completions of the evaluation prompts, and their accuracy under the reward function."""
    cfg = load_config(None, args)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    prompts = build_rl_dataset(cfg.valid_dataset, tok)
    texts, correct = [], []
    for i in range(len(prompts)):
        p = prompts[i]
        ids, out = list(p.input_ids), []
        while len(out) < cfg.gconfig.max_new_tokens:
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        text = tok.decode(out, skip_special_tokens=True)
        texts.append(text)
        correct.append(length_reward(p.prompt, text, p.answer) >= THRESHOLD)
    return texts, sum(correct) / len(correct)


def test_a_run_evaluates_before_training_every_freq_steps_and_at_the_end(eval_run):
    history, out, args = eval_run
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0].keys() <= {"step"} | {k for k in records[0] if k.startswith("eval/")}  # step 0: no update
    for record in records:
        step = record["step"]
        samples = _lines(out / "eval" / f"step_{step}.jsonl")
        greedy = [s for s in samples if s["mode"] == "greedy"]
        sampled = [s for s in samples if s["mode"] == "sampled"]
        assert len(greedy) == 6 and len(sampled) == 12
        assert all(s["correct"] == (s["reward"] >= THRESHOLD) for s in samples)
        # pass@k counted from the written samples: pass@1 the correct fraction, pass@2 (n = 2) any correct.
        by_prompt = [[s["correct"] for s in sampled if s["prompt_id"] == i] for i in range(6)]
        assert record["eval/pass@1"] == pytest.approx(sum(map(sum, by_prompt)) / 12)
        assert record["eval/pass@2"] == pytest.approx(sum(any(c) for c in by_prompt) / 6)
        assert record["eval/greedy_acc"] == pytest.approx(sum(s["correct"] for s in greedy) / 6)
        written = json.loads((out / "eval" / f"step_{step}.metrics.json").read_text())
        assert written == {k: v for k, v in record.items() if k.startswith("eval/")}
    assert history[-1]["eval/greedy_acc"] == records[-1]["eval/greedy_acc"]
    # The final evaluation ran on the final weights: transformers' greedy decoding of the export agrees.
    texts, accuracy = _greedy_reference(out / "hf", args)
    final = _lines(out / "eval" / "step_2.jsonl")
    assert [s["completion"] for s in final if s["mode"] == "greedy"] == texts
    assert 0 < accuracy < 1, "the threshold must split the prompts for the comparison to mean something"
    assert records[-1]["eval/greedy_acc"] == pytest.approx(accuracy)


@pytest.mark.slow  # launches a built-in server, and loads a checkpoint, in subprocesses (~20 s)
@pytest.mark.parametrize("what", ["hf", "checkpoint"])
def test_archon_eval_of_the_saved_model_matches_the_runs_final_evaluation(eval_run, eval_setup, what, tmp_path):
    _, out, _ = eval_run
    model = out / "hf" if what == "hf" else out / "checkpoints" / "step_2"
    args = _args(eval_setup, tmp_path / "evalrun")
    env = {**os.environ, "PYTHONPATH": helpers_pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-m", "archon.eval", "--model", str(model), "--out", str(tmp_path / "res"), "--name", "x"]
        + args,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/greedy_acc" in proc.stdout  # the table
    metrics = json.loads((tmp_path / "res" / "x.metrics.json").read_text())
    final = json.loads((out / "eval" / "step_2.metrics.json").read_text())
    assert metrics["eval/greedy_acc"] == final["eval/greedy_acc"]
    ours = _lines(tmp_path / "res" / "x.jsonl")
    theirs = _lines(out / "eval" / "step_2.jsonl")
    # Same weights, prompts and sampling seeds: the same completions, greedy and sampled.
    assert [(s["mode"], s["completion"]) for s in ours] == [(s["mode"], s["completion"]) for s in theirs]
