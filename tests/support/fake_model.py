"""The fake SGLang server's model: deterministic logits from the context and SGLang's sampling.

``fake_sglang`` answers generate requests with these; tests recompute expected tokens and
logprobs from them independently of the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

VOCAB = 1000
_SAMPLING_EPS = 1e-6
DETERMINISTIC_DEFAULT_SEED = 42  # SGLang's seed for requests without sampling_seed


def fake_logits(context: Sequence[int], n_updates: int = 0) -> torch.Tensor:
    """The fake model: next-token logits ``[VOCAB]`` after ``context`` with the weights of ``n_updates``."""
    import torch  # lazily: a launched fake answers /health without paying for it

    h = (n_updates * 1_000_003 + len(context)) % (2**61 - 1)
    for t in context:
        h = (h * 31 + int(t) + 1) % (2**61 - 1)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)) * 2.0


def sglang_sample(logits: torch.Tensor, params: dict[str, Any], uniform: float) -> tuple[int, float]:
    """One token and its reported logprob by SGLang 0.5.23's rules (SamplingParams, Sampler)."""
    import torch

    temperature = float(params.get("temperature", 1.0))
    top_k = int(params.get("top_k", -1))
    top_p = float(params.get("top_p", 1.0))
    min_p = float(params.get("min_p", 0.0))
    if 0 <= temperature < _SAMPLING_EPS:
        temperature, top_k = 1.0, 1  # SamplingParams.__post_init__: greedy is top_k = 1
    if top_k == 1:  # is_all_greedy: argmax, logprobs of the unscaled logits
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, -1)[tok])
    probs = torch.softmax(logits.double() / temperature, -1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, -1) - sorted_probs
    kept = sorted_probs.clone()
    if top_k > 0:
        kept[top_k:] = 0.0
    kept[mass_before > top_p] = 0.0  # joint: the mass of the unfiltered distribution
    kept[kept < min_p * kept[0]] = 0.0
    cdf = torch.cumsum(kept, -1)
    idx = min(int(torch.searchsorted(cdf, uniform * cdf[-1], right=True)), VOCAB - 1)
    tok = int(order[idx])
    return tok, float(torch.log(probs[tok]))  # before filtering


def fake_completion(
    input_ids: list[int],
    params: dict[str, Any],
    n_updates: int = 0,
    *,
    seed: int = DETERMINISTIC_DEFAULT_SEED,
    eos_token_ids: Sequence[int] = (),
    tokenizer: bool = False,
) -> tuple[list[int], list[float], dict[str, Any]]:
    """(output ids, logprobs, finish_reason) for a prompt whose draws come from ``seed``.

    Greedy requests (temperature 0 or top_k 1) do not depend on the seed.  ``tokenizer``: a
    server started without --skip-tokenizer-init, where min_new_tokens masks stop tokens.
    """
    import torch

    n = int(params.get("max_new_tokens", 128))
    ignore_eos = bool(params.get("ignore_eos", False))
    stops = set() if ignore_eos else set(params.get("stop_token_ids") or []) | set(eos_token_ids)
    min_new = int(params.get("min_new_tokens", 0))
    draws = torch.Generator().manual_seed(int(seed) % 2**64)
    ids: list[int] = []
    logprobs: list[float] = []
    for j in range(n):
        logits = fake_logits(list(input_ids) + ids, n_updates)
        if tokenizer and j < min_new and stops:
            logits[sorted(stops)] = float("-inf")  # SGLang's min-new-tokens penalizer acts on the logits
        tok, lp = sglang_sample(logits, params, float(torch.rand(1, generator=draws)))
        ids.append(tok)
        logprobs.append(lp)
        if tok in stops:  # before the length check, as in Req.update_finish_state
            return ids, logprobs, {"type": "stop", "matched": tok}
    return ids, logprobs, {"type": "length", "length": n}
