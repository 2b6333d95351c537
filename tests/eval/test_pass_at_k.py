"""pass@k's unbiased estimator against hand-computed values and against counting k-subsets."""

from __future__ import annotations

import itertools
import math

import pytest

from archon.eval.evaluation import SAMPLED, EvalSample, summarize
from archon.eval.pass_at_k import mean_pass_at_k, pass_at_k, reported_ks


def test_pass_at_k_hand_computed():
    # 5 samples, 2 correct, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k = 1 is the fraction correct
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # 10 samples, 3 correct, k = 5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # fewer wrong samples than k: every k-subset holds a correct one
    assert mean_pass_at_k(5, [2, 0], 2) == pytest.approx(0.35)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert len(subsets) == math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="c must be between 0 and n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="needs at least k samples"):
        pass_at_k(3, 1, 4)


def test_reported_ks():
    assert reported_ks(1) == [1]
    assert reported_ks(4) == [1, 2, 4]
    assert reported_ks(6) == [1, 2, 4, 6]


def test_summarize_pass_at_k_of_scored_samples():
    # Prompt 0: 1 of 3 correct; prompt 1: 3 of 3.
    def sample(prompt_id: int, j: int, correct: bool) -> EvalSample:
        return EvalSample(prompt_id, SAMPLED, j, "p", "a", "c", float(correct), correct, 2 + j, "stop")

    samples = [sample(0, j, j == 1) for j in range(3)] + [sample(1, j, True) for j in range(3)]
    m = summarize(samples, n_samples=3)
    assert m["eval/pass@1"] == pytest.approx((1 / 3 + 1) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 3 + 1) / 2)  # C(2,2)/C(3,2) = 1/3 misses for prompt 0
    assert m["eval/pass@3"] == pytest.approx(1.0)
    assert m["eval/mean_reward"] == pytest.approx(4 / 6)
    assert m["eval/mean_len"] == pytest.approx(3.0)
    assert "eval/greedy_acc" not in m
