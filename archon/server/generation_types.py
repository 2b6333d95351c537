"""Requests, results and the per-request state of the built-in server's generation engine.

``GenerationRequest`` and ``GenerationResult`` are the engine's public contract (the HTTP layer
in ``archon.server.protocol`` translates SGLang's JSON to and from them); ``ActiveSequence`` is
what the engine (``archon.server.generator``) keeps for each request it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from archon.server.sampling import SamplingParams

# ---- requests and results -----------------------------------------------------------------


PAUSE_MODES = ("abort", "retract")
"""``pause`` modes (SGLang's names; SGLang's 'in_place' keeps a KV cache of the old weights, which this server never
does)."""


@dataclass
class GenerationRequest:
    """One prompt to complete."""

    input_ids: list[int]
    """Prompt token ids."""
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    """How to sample and when to stop."""
    return_logprob: bool = False
    """Report the logprob of every generated token."""
    rid: str | None = None
    """Request id (for ``abort``); a random one is assigned when None."""
    return_routed_experts: bool = False
    """Report the experts every token was routed to in every MoE layer (SGLang's name)."""
    routed_experts_start_len: int = 0
    """First position reported by ``return_routed_experts`` (SGLang's; 0 = the whole sequence)."""
    priority: int = 0
    """Admission order (SGLang's field, larger first): a request above 0 is admitted before the queued ones of lower
    priority, e.g. the trainer's weight probe ahead of a rollout round."""

    def check(self, vocab_size: int, context_length: int) -> None:
        """Raise ``ValueError`` (one sentence: what and how to fix) if a model of this vocabulary and context cannot
        serve the request."""
        ids = self.input_ids
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids.")
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise ValueError(f"input_ids[{i}] is {t!r}; token ids must be integers.")
            if not 0 <= t < vocab_size:
                raise ValueError(f"input_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size}).")
        params = self.sampling_params
        params.validate()
        for i, t in enumerate(params.stop_token_ids):
            if type(t) is not int or not 0 <= t < vocab_size:
                raise ValueError(
                    f"sampling_params.stop_token_ids[{i}] = {t!r} is outside the vocabulary [0, {vocab_size}); "
                    "send ids of this model's tokenizer."
                )
        if len(ids) + params.max_new_tokens > context_length:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context length {context_length}; shorten the prompt or lower max_new_tokens."
            )


@dataclass
class GenerationResult:
    """A finished (or aborted) request."""

    rid: str
    """Request id."""
    output_ids: list[int]
    """Generated token ids (a matched EOS or stop token included)."""
    output_logprobs: list[float] | None
    """Logprob of every generated token (see the module docstring), or None if not requested."""
    finish_reason: dict[str, Any]
    """SGLang's form: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``
    or ``{"type": "abort", "message": str}``."""
    prompt_tokens: int
    """Prompt length."""
    weight_version: str
    """Version of the weights the last generated token was produced with (at admission if none was)."""
    e2e_latency: float
    """Seconds from submission to finish."""
    routed_experts: torch.Tensor | None = None
    """int32 ``[tokens, n_layers, top_k]``: the experts each token the model ran was routed to (the
    prompt, then every generated token but the last, which is never fed back; from
    ``routed_experts_start_len`` on; dense layers 0), as SGLang returns them; None if not requested."""
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    """SGLang's spans ``(version, start, end)``: generated tokens ``start:end`` came from weight
    ``version``; in order, covering every token (one span per version change)."""

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.output_ids)


@dataclass
class ActiveSequence:
    """A request being served: its future, random generator and tokens so far."""

    request: GenerationRequest
    """The request as submitted (rid filled in)."""
    future: Future
    """Resolved with a ``GenerationResult``."""
    rng: torch.Generator
    """The request's own generator (one uniform draw per sampled token)."""
    stop_ids: frozenset[int]
    """Tokens that finish the request: EOS and stop_token_ids (none with ignore_eos)."""
    submitted: float
    """``time.perf_counter()`` at submission."""
    output_ids: list[int] = field(default_factory=list)
    """Generated tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Their logprobs (only filled when requested)."""
    weight_version: str | None = None
    """Version of the weights at admission."""
    routed: list[torch.Tensor] = field(default_factory=list)
    """Routed experts of the tokens run so far, one ``[n, n_layers, top_k]`` chunk per forward (when requested)."""
    version_spans: list[list] = field(default_factory=list)
    """``[version, start, end]`` of the generated tokens, a new span whenever the version changed."""

    def note_token_version(self, version: str) -> None:
        """Record that the last appended token came from weights ``version``."""
        n = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = n
        else:
            self.version_spans.append([version, n - 1, n])

    def routed_result(self, n_layers: int, moe: dict[int, Any]) -> torch.Tensor:
        """int32 ``[tokens, n_layers, top_k]``: the routing kept so far, from ``routed_experts_start_len`` on."""
        top_k = next(iter(moe.values())).top_k if moe else 0
        routed = torch.cat(self.routed) if self.routed else torch.zeros(0, n_layers, top_k, dtype=torch.int32)
        return routed[self.request.routed_experts_start_len :]


@dataclass
class ExclusiveOp:
    """A function to run on the engine thread with no request running (a weight update)."""

    fn: Callable[[nn.Module], Any]
    """Called with the model."""
    future: Future
    """Resolved with ``fn``'s return value."""
    weight_version: str | None
    """New ``weight_version`` once ``fn`` succeeded (None keeps the current one)."""
    abort_running: bool
    """Abort running requests instead of waiting for them."""


def keep_routing(
    seqs: list[ActiveSequence], rows: list[int], lengths: list[int], moe: dict[int, Any], n_layers: int
) -> None:
    """Append the routing of the forward just run (its MoE blocks ``moe``, by layer id), row
    ``rows[i]``'s first ``lengths[i]`` positions, to each sequence that asked for it (a prompt
    prefilled once serves all its copies)."""
    wanted = [i for i, s in enumerate(seqs) if s.request.return_routed_experts]
    if not wanted or not moe:
        return
    top_k = next(iter(moe.values())).top_k
    b, t = max(rows) + 1, max(lengths)
    routed = torch.zeros(b, t, n_layers, top_k, dtype=torch.int32)
    for layer_id, block in moe.items():
        routed[:, :, layer_id] = block.selected_experts.view(b, -1, top_k)[:, :t].to("cpu", torch.int32)
    for i in wanted:
        seqs[i].routed.append(routed[rows[i], : lengths[i]])


def resolve_future(future: Future, value: Any) -> None:
    """Set ``future``'s result unless its caller cancelled it meanwhile."""
    try:
        future.set_result(value)
    except InvalidStateError:
        pass


def fail_future(future: Future, error: BaseException) -> None:
    """Set ``future``'s exception unless its caller cancelled it meanwhile."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass
