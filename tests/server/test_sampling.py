"""Pure sampling functions of the rollout server, checked against direct computations.

Each filter is compared with its definition computed independently here (a Python loop over
sorted probabilities), and the sampler's empirical distribution with the filtered one.
"""

from __future__ import annotations

import math

import pytest
import torch

from archon.server.sampling import SamplingParams, sample_tokens, suppress_tokens, token_logprobs

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def _sample(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0):
    b = logits.shape[0]
    full = lambda v, dt: torch.full((b,), v, dtype=dt)  # noqa: E731
    uniforms = torch.rand(b, generator=torch.Generator().manual_seed(seed))
    return sample_tokens(
        logits,
        full(temperature, torch.float32),
        full(top_k, torch.long),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
        uniforms,
    )


def _allowed(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """The filtered, renormalised distribution by SGLang's definitions, one token at a time.

    Top-k and top-p are joint on the unfiltered distribution (SGLang 0.5.23's PyTorch sampler
    zeroes ranks >= k and tokens whose preceding mass of the *full* softmax exceeds top_p;
    FlashInfer's ``filter_apply_order="joint"`` keeps the same support).
    """
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    order = sorted(range(V), key=lambda t: -probs[t])
    kept, before = [], 0.0
    for rank, t in enumerate(order):
        if (top_k > 0 and rank >= top_k) or (before >= top_p and top_p < 1.0):
            break
        kept.append(t)
        before += probs[t]
    best = max(probs[t] for t in kept)
    kept = [t for t in kept if probs[t] >= min_p * best]
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.5),
    ],
)
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=3, min_new_tokens=4).validate()


def test_greedy_and_top_k_one_are_argmax():
    logits = _logits(64, seed=1)
    argmax = logits.argmax(-1)
    assert torch.equal(_sample(logits, temperature=0.0), argmax)
    for seed in range(3):
        assert torch.equal(_sample(logits, temperature=0.8, top_k=1, seed=seed), argmax)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=1.0, top_k=8, top_p=0.7),
        dict(temperature=0.9, min_p=0.2),
        dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.1),
    ],
)
def test_sampling_matches_the_filtered_distribution(kw):
    n = 20000
    logits = _logits(1, seed=2).expand(n, V).contiguous()
    tokens = _sample(logits, seed=3, **{"top_k": -1, "top_p": 1.0, "min_p": 0.0, **kw})
    expected = _allowed(logits[0], kw["temperature"], kw.get("top_k", -1), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    counts = torch.bincount(tokens, minlength=V).double() / n
    support = set(torch.nonzero(counts).squeeze(1).tolist())
    assert support <= set(expected), f"sampled outside the allowed set: {support - set(expected)}"
    for t in range(V):
        p = expected.get(t, 0.0)
        # 5 standard deviations of a binomial frequency: fails only on a real mismatch.
        assert abs(counts[t].item() - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (t, counts[t].item(), p)


def test_top_k_and_top_p_filter_jointly_not_one_after_the_other():
    # Masses 0.4, 0.3, 0.2, 0.1: top_k=2 then top_p=0.5 on the renormalised pair (0.57, 0.43) would
    # keep one token; SGLang filters jointly on the full distribution (mass before the second
    # token is 0.4 < 0.5), so both stay and each is drawn in proportion 4:3.
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))[None].expand(20000, 4).contiguous()
    b = logits.shape[0]
    uniforms = torch.rand(b, generator=torch.Generator().manual_seed(11))
    tokens = sample_tokens(logits, torch.ones(b), torch.full((b,), 2), torch.full((b,), 0.5), torch.zeros(b), uniforms)
    counts = torch.bincount(tokens, minlength=4).double() / b
    assert counts[0] == counts[2] == 0
    assert abs(counts[1].item() - 4 / 7) < 0.02 and abs(counts[3].item() - 3 / 7) < 0.02


def test_a_row_does_not_depend_on_the_other_rows():
    logits = _logits(4, seed=4)
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(5))
    temps = torch.tensor([1.0, 0.5, 0.0, 1.2])
    top_k = torch.tensor([-1, 3, -1, 20])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05])
    together = sample_tokens(logits, temps, top_k, top_p, min_p, uniforms)
    for i in range(4):
        alone = sample_tokens(
            logits[i : i + 1],
            temps[i : i + 1],
            top_k[i : i + 1],
            top_p[i : i + 1],
            min_p[i : i + 1],
            uniforms[i : i + 1],
        )
        assert alone.item() == together[i].item()


def test_logprobs_are_pre_filter_with_greedy_at_temperature_one():
    logits = _logits(3, seed=6)
    tokens = torch.tensor([4, 9, 30])
    temps = torch.tensor([0.7, 0.0, 1.0])
    got = token_logprobs(logits, temps, tokens)
    for i, t in enumerate([0.7, 1.0, 1.0]):
        ref = logits[i].double() / t
        ref = ref[tokens[i]] - torch.logsumexp(ref, 0)
        assert abs(got[i].item() - ref.item()) < 1e-5


def test_suppressed_tokens_are_never_sampled():
    logits = _logits(1, seed=7).expand(2000, V).contiguous()
    mask = torch.zeros(2000, V, dtype=torch.bool)
    banned = logits[0].topk(3).indices
    mask[:, banned] = True
    tokens = _sample(suppress_tokens(logits, mask), temperature=1.0, seed=8)
    assert not torch.isin(tokens, banned).any()
    greedy = _sample(suppress_tokens(logits[:1], mask[:1]), temperature=0.0)
    assert greedy.item() == logits[0].topk(4).indices[3].item()
