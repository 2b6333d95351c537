"""Sampling parameters and the pure functions that turn a batch of logits into next tokens.

The logprob contract (the trainer relies on it): the logprob reported for a sampled token is
``log_softmax(logits / T)[token]`` computed in float32 from the model's raw logits of that
step, i.e. *before* any filtering: before ``min_new_tokens`` suppression of stop tokens and
before top-k / top-p / min-p.  For greedy requests ``T`` is taken as 1, as SGLang does: temperature
0, and ``top_k = 1`` whatever the temperature (the generator turns those into temperature 0).
A trainer that recomputes ``log_softmax(model(prompt + completion).logits / T)`` with the same
weights therefore gets the same numbers.

Sampling applies, per row: temperature, then top-k and top-p jointly on the unfiltered
distribution (a token survives if it is among the top k and within the top-p nucleus of the
full softmax, as in SGLang), then min-p (relative to the most likely token), and draws one token by
inverting the CDF of what is left with a single uniform number from the request's own
``torch.Generator``.  One uniform per token per request means a request's tokens depend only
on its seed and its logits, not on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archon.wire.sglang import SGLangSampling


@dataclass
class SamplingParams(SGLangSampling):
    """SGLang's ``sampling_params`` fields that the built-in server implements (``archon.wire.sglang``), and
    SGLang's per-request seed."""

    sampling_seed: int | None = None
    """Seed of the request's random generator; None derives one from the server seed."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field with an invalid value."""
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}."
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"sampling_params.temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p must be in [0, 1], got {self.min_p}.")


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The temperature logprobs are computed with: the given one, or 1 for greedy rows (T = 0)."""
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)[token]`` per row, in float32; ``logits [b, V]``, ``temperature, tokens [b]``."""
    scaled = logits.float() / effective_temperature(temperature).float()[:, None]
    return torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def suppress_tokens(logits: torch.Tensor, suppressed: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``-inf`` where the boolean ``suppressed [b, V]`` is True (new tensor)."""
    return logits.masked_fill(suppressed, float("-inf"))


def _sample_from_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row the first index whose cumulative mass exceeds ``u * total``."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    # right=True returns the first index with cdf > target, which always has non-zero mass.
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _sample_sorted(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Rows that need an order over the vocabulary (top-k or top-p); all filters in sorted space."""
    vocab = scaled.shape[-1]
    # Stable sort: among equal logits the lower id ranks first, as argmax picks it, so top_k=1 is greedy.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    # Top-k and top-p are applied jointly to the unfiltered distribution, as SGLang does (FlashInfer's
    # filter_apply_order="joint", and its PyTorch sampler): the top-p mass is that of the full
    # softmax, not of the renormalised top-k.  Keep a token while the mass ranked before it is
    # below top_p (the first one always stays); rows with top_p == 1 skip this, so rounding
    # cannot drop their tail tokens.
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (ranks[None, :] >= k[:, None]) | ((mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None])
    probs = probs.masked_fill(drop, 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    return order.gather(1, _sample_from_cdf(probs, uniforms)[:, None]).squeeze(1)


def _sample_unsorted(scaled: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Rows without top-k / top-p: no sort needed (min-p only compares with the row maximum)."""
    probs = torch.softmax(scaled, dim=-1)
    probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return _sample_from_cdf(probs, uniforms)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Next token per row of ``logits [b, V]`` (already stop-token-suppressed where needed).

    ``temperature, top_p, min_p`` are float ``[b]``, ``top_k`` int64 ``[b]`` (-1 = off),
    ``uniforms`` float ``[b]`` in ``[0, 1)`` (one draw of each request's generator).  Rows with
    temperature 0 take the argmax.  Whether a row sorts the vocabulary depends only on its own
    parameters, so its token never depends on the other rows.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    tokens = torch.argmax(logits, dim=-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return tokens
    rows = sampled.nonzero().squeeze(1)
    scaled = logits[rows] / temperature[rows].float()[:, None]
    k, p, mp, u = top_k[rows], top_p[rows].float(), min_p[rows].float(), uniforms[rows].float()
    needs_sort = ((k > 0) & (k < vocab)) | (p < 1.0)
    out = torch.empty_like(rows)
    if bool(needs_sort.any()):
        out[needs_sort] = _sample_sorted(
            scaled[needs_sort], k[needs_sort], p[needs_sort], mp[needs_sort], u[needs_sort]
        )
    plain = ~needs_sort
    if bool(plain.any()):
        out[plain] = _sample_unsorted(scaled[plain], mp[plain], u[plain])
    tokens[rows] = out
    return tokens
