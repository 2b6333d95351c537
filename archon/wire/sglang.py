"""SGLang's ``sampling_params``, as far as Archon uses them: the one place their defaults and docs live.

The trainer's ``gconfig`` (``archon.config.GenerationConfig``) sends these fields with every
request under SGLang's names, and the built-in server (``archon.server.sampling.SamplingParams``)
implements them; both extend ``SGLangSampling`` rather than declare the fields again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""What SGLang generates for a request without ``max_new_tokens``; Archon's built-in server and its vLLM adapter
follow it.  Archon's own requests never rely on it: they carry ``gconfig.max_new_tokens``."""


@dataclass
class SGLangSampling:
    """The fields of SGLang's ``sampling_params`` that Archon sends and its built-in server implements."""

    max_new_tokens: int = SGLANG_DEFAULT_MAX_NEW_TOKENS
    """Most tokens to generate; the request finishes with reason ``length`` when reached.  The default is
    SGLang's, for a request that leaves it out; the trainer's requests carry ``gconfig.max_new_tokens``."""
    min_new_tokens: int = 0
    """Minimum completion length: EOS and stop tokens cannot be sampled before this many tokens were generated."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens with mass >= top_p; 1 disables it."""
    top_k: int = -1
    """Keep the top_k most likely tokens; -1 disables it; 1 is greedy (logprobs at T = 1, as in SGLang)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times that of the most likely token; 0 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (reason ``stop``), in addition to EOS."""
    ignore_eos: bool = False
    """Generate until ``max_new_tokens``: neither EOS nor ``stop_token_ids`` stop (as in SGLang; for benchmarks)."""
