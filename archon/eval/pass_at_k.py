"""pass@k: the chance that at least one of k completions of a prompt is correct, estimated from n >= k samples.

The unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"): with c correct
among n samples, pass@k = 1 - C(n - c, k) / C(n, k), the fraction of the k-subsets of the n samples that hold at
least one correct one.  It is computed as a product, so that large n never builds huge binomials.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one prompt with ``c`` correct among ``n`` samples (``1 <= k <= n``)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: {c} correct samples out of {n} is impossible; c must be between 0 and n")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k = {k} needs at least k samples and k >= 1; got n = {n}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    # C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(n: int, correct_counts: Sequence[int], k: int) -> float:
    """The mean over prompts of pass@k, each prompt with ``n`` samples and its count of correct ones."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k needs at least one prompt")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k an evaluation with ``n`` samples per prompt reports: 1, 2, 4, ... below n, and n."""
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []
