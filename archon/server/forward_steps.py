"""The model forwards of the built-in generator: prefill new requests and decode running ones over the KV cache.

Continuous batching runs one forward over every row it can.  Float reductions then depend on which requests share a
forward (a row's matmuls, its attention over keys padded to the batch's longest row), so a request's logprobs move in
the last bits (~1e-6) with the traffic around it, and an RL run's metrics with the order its requests arrived in.
``batch_invariant`` (the servers' ``--enable-deterministic-inference``, SGLang's flag) runs one row per forward
instead: slower, but a request's tokens and logprobs depend only on its own context, the weights and its seed, which
reproducible runs and exact comparisons (asynchronous against synchronous, one allocation against another) need.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from archon.server.generation_types import ActiveSequence, keep_routing
from archon.server.kv_cache import BatchedKVCache
from models.common.inference import InferenceForward


class ForwardSteps:
    """Prefill and decode forwards of one generator (its model, lean forward, KV cache and MoE blocks)."""

    def __init__(
        self,
        model: nn.Module,
        lean: InferenceForward | None,
        cache: BatchedKVCache,
        moe: dict[int, Any],
        n_layers: int,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.lean = lean
        """The lean forward of a stock Decoder; None: call the model."""
        self.cache = cache
        self.moe = moe
        """MoE blocks by layer id: their last routing is kept for the requests that ask for it."""
        self.n_layers = n_layers
        self.batch_invariant = batch_invariant
        self.device = next(model.parameters()).device

    def _row_groups(self, n: int) -> list[range]:
        """The forwards ``n`` rows are computed in: one per row when batch-invariant, else one."""
        return [range(i, i + 1) for i in range(n)] if self.batch_invariant else [range(n)]

    def prefill(self, batch: list[ActiveSequence], start: int) -> tuple[list[ActiveSequence], torch.Tensor]:
        """Prefill ``batch`` into cache rows ``start..`` (added by the caller); return it in its rows' order with
        the logits ``[b, V]`` at each one's last context token.

        Identical contexts (a GRPO group's samples) are computed once: the first of each is prefilled, the others get
        copies of its cache row and logits, so rows follow the order firsts, then copies.  A retracted request is
        prefilled with its tokens so far, under the current weights.
        """
        first_row: dict[tuple[int, ...], int] = {}
        firsts, copies, source = [], [], []
        for s in batch:
            key = tuple(s.request.input_ids + s.output_ids)
            if key in first_row:
                copies.append(s)
                source.append(first_row[key])
            else:
                first_row[key] = len(firsts)
                firsts.append(s)
        ordered = firsts + copies
        rows = list(range(len(firsts))) + source
        for s in ordered:
            s.routed.clear()  # a retracted request's whole context was routed again
        contexts = [s.request.input_ids + s.output_ids for s in firsts]
        parts = []
        for group in self._row_groups(len(firsts)):
            lengths = [len(contexts[i]) for i in group]
            tokens = torch.zeros(len(group), max(lengths), dtype=torch.long)
            for j, i in enumerate(group):
                tokens[j, : lengths[j]] = torch.tensor(contexts[i])
            self.cache.begin_forward(start + group.start, start + group.stop, max(lengths), valid=lengths)
            parts.append(self._forward(tokens, last=torch.tensor(lengths, device=self.device) - 1))
            users = [k for k, r in enumerate(rows) if r in group]
            keep_routing(
                [ordered[k] for k in users],
                [rows[k] - group.start for k in users],
                [len(contexts[rows[k]]) for k in users],
                self.moe,
                self.n_layers,
            )
        logits = torch.cat(parts)
        if copies:
            self.cache.copy_rows([start + i for i in source], start + len(firsts))
            logits = torch.cat([logits, logits[torch.tensor(source, device=logits.device)]])
        return ordered, logits

    def decode(self, running: list[ActiveSequence]) -> torch.Tensor:
        """One token's forward for every running request (cache rows ``0..``): the logits ``[b, V]``."""
        tokens = torch.tensor([s.output_ids[-1] for s in running], dtype=torch.long)[:, None]
        parts = []
        for group in self._row_groups(len(running)):
            self.cache.begin_forward(group.start, group.stop, 1)
            parts.append(self._forward(tokens[group.start : group.stop]))
            keep_routing(
                running[group.start : group.stop], list(range(len(group))), [1] * len(group), self.moe, self.n_layers
            )
        return torch.cat(parts)

    def _forward(self, tokens: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, V]`` at position ``last[i]`` of each row (default the final one) of the forward begun."""
        tokens = tokens.to(self.device)
        if self.lean is not None:
            logits = self.lean(tokens, self.cache.positions(), self.cache, last)
        else:
            logits = self.model(tokens, positions=self.cache.positions(), cache=self.cache)
            logits = logits[:, -1] if last is None else logits[torch.arange(len(logits), device=logits.device), last]
        self.cache.end_forward()
        return logits
