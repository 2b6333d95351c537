"""One evaluation: prompts through a rollout client, each completion scored by the run's reward function.

Greedy completions (temperature 0, one per prompt) give the accuracy; ``n_samples`` completions per prompt at the
evaluator's temperature give pass@k (``archon.eval.pass_at_k``).  Sampling seeds depend on the run's seed, the
prompt and the sample only, never on the step: two evaluations of one run differ by their weights, not by their
random numbers.  Everything here runs on one process (trainer rank 0, or ``python -m archon.eval``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archon.config.evaluator import EvaluatorConfig
from archon.data.rl_dataset import PromptSample
from archon.eval.pass_at_k import mean_pass_at_k, reported_ks
from archon.rl.rollout_batch import Completion
from archon.rl.scoring import ScoreFn
from archon.rollout.client import RolloutClient

GREEDY = "greedy"
SAMPLED = "sampled"
_SEED_MOD = 2**31 - 1


def eval_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` of prompt ``prompt_index`` (a row index) in every evaluation of a run."""
    return (seed * 1_000_033 + prompt_index * 104_729 + sample * 7_927 + 54_321) % _SEED_MOD


@dataclass
class EvalSample:
    """One scored completion: a line of an evaluation's jsonl file."""

    prompt_id: int
    """Row of the evaluation data (0-based, counting dropped rows)."""
    mode: str
    """'greedy' or 'sampled'."""
    sample: int
    """Index of the completion among its prompt's completions of this mode."""
    prompt: str
    """Prompt text (after the prompt template, before the chat template)."""
    answer: str
    """Reference answer."""
    completion: str
    """Generated text, special tokens left out (what the reward function got)."""
    reward: float
    """The reward function's value."""
    correct: bool
    """Whether ``reward >= evaluator.correct_threshold``."""
    n_tokens: int
    """Generated tokens (a final stop token included)."""
    finish_reason: str
    """'stop', 'length' or 'abort'."""


class Evaluation:
    """Evaluates the policy a rollout client's servers hold on a fixed list of prompts."""

    def __init__(
        self,
        prompts: Sequence[PromptSample],
        cfg: EvaluatorConfig,
        *,
        sampling: dict[str, Any],
        max_new_tokens: int,
        seed: int,
        batch_size: int,
        tokenizer: Any,
        max_concurrency: int = 0,
    ):
        """``sampling``: the run's sampling parameters (gconfig's, with the stop tokens), which an evaluation
        overrides with its temperature and ``max_new_tokens``; ``batch_size``: prompts per round of requests."""
        if not cfg.greedy and cfg.n_samples <= 0:
            raise ValueError(
                "evaluator.greedy = false and evaluator.n_samples = 0 leave nothing to evaluate; turn one of them on "
                "or leave valid_dataset.path empty"
            )
        if cfg.n_samples < 0:
            raise ValueError(f"evaluator.n_samples = {cfg.n_samples} must be 0 (no sampled evaluation) or more")
        if not prompts:
            raise ValueError("the evaluation data has no prompts (all dropped as too long?); check valid_dataset")
        self.prompts = list(prompts)
        self.cfg = cfg
        self.seed = seed
        self.batch_size = max(1, batch_size)
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        base = {**sampling, "max_new_tokens": max_new_tokens}
        self.greedy_params = {**base, "temperature": 0.0}
        self.sampled_params = {**base, "temperature": cfg.temperature}

    def _requests(self, batch: Sequence[PromptSample]) -> list[tuple[PromptSample, str, int, dict[str, Any]]]:
        """(prompt, mode, sample index, sampling parameters) of every completion a round asks for."""
        requests = []
        for p in batch:
            if self.cfg.greedy:
                requests.append((p, GREEDY, 0, self.greedy_params))
            for j in range(self.cfg.n_samples):
                params = {**self.sampled_params, "sampling_seed": eval_seed(self.seed, p.index, j)}
                requests.append((p, SAMPLED, j, params))
        return requests

    def run(self, client: RolloutClient, score: ScoreFn) -> tuple[list[EvalSample], dict[str, float]]:
        """Generate and score every completion; the per-completion results and the ``eval/*`` metrics."""
        t0 = time.perf_counter()
        samples: list[EvalSample] = []
        for start in range(0, len(self.prompts), self.batch_size):
            requests = self._requests(self.prompts[start : start + self.batch_size])
            results = client.generate_many(
                [p.input_ids for p, *_ in requests],
                [params for *_, params in requests],
                max_concurrency=self.max_concurrency,
                return_logprob=False,
            )
            completions = [
                Completion(list(p.input_ids), r.output_ids, [], r.finish_reason)
                for (p, *_), r in zip(requests, results)
            ]
            rewards = score([p for p, *_ in requests], completions)
            for (p, mode, j, _), c, reward in zip(requests, completions, rewards):
                samples.append(
                    EvalSample(
                        prompt_id=p.index,
                        mode=mode,
                        sample=j,
                        prompt=p.prompt,
                        answer=p.answer,
                        completion=self.tokenizer.decode(c.output_ids, skip_special_tokens=True),
                        reward=float(reward),
                        correct=float(reward) >= self.cfg.correct_threshold,
                        n_tokens=len(c.output_ids),
                        finish_reason=c.finish_reason,
                    )
                )
        metrics = summarize(samples, n_samples=self.cfg.n_samples)
        metrics["eval/time_s"] = time.perf_counter() - t0
        return samples, metrics


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize(samples: Sequence[EvalSample], *, n_samples: int) -> dict[str, float]:
    """The ``eval/*`` metrics of scored completions (greedy ones, and ``n_samples`` sampled ones per prompt)."""
    greedy = [s for s in samples if s.mode == GREEDY]
    sampled = [s for s in samples if s.mode == SAMPLED]
    metrics: dict[str, float] = {"eval/n_prompts": float(len({s.prompt_id for s in samples}))}
    if greedy:
        metrics["eval/greedy_acc"] = _mean([float(s.correct) for s in greedy])
        metrics["eval/greedy_reward"] = _mean([s.reward for s in greedy])
        metrics["eval/greedy_len"] = _mean([float(s.n_tokens) for s in greedy])
    if sampled:
        correct: dict[int, int] = {}
        for s in sampled:
            correct[s.prompt_id] = correct.get(s.prompt_id, 0) + int(s.correct)
        for k in reported_ks(n_samples):
            metrics[f"eval/pass@{k}"] = mean_pass_at_k(n_samples, list(correct.values()), k)
        metrics["eval/mean_reward"] = _mean([s.reward for s in sampled])
        metrics["eval/mean_len"] = _mean([float(s.n_tokens) for s in sampled])
    metrics["eval/truncated_frac"] = _mean([float(s.finish_reason != "stop") for s in samples])
    return metrics


def write_results(folder: Path, name: str, samples: Sequence[EvalSample], metrics: dict[str, float]) -> Path:
    """``<folder>/<name>.jsonl`` (one line per completion) and ``<folder>/<name>.metrics.json``; the jsonl's path.

    Each file is written beside and renamed into place, so a kill never leaves a half-written one.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    for target, text in (
        (path, "".join(json.dumps(asdict(s)) + "\n" for s in samples)),
        (folder / f"{name}.metrics.json", json.dumps(metrics, indent=1) + "\n"),
    ):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(target)
    return path
