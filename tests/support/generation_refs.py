"""References for generation tests: greedy decoding and logprobs computed directly from a model, and a
model that fires a callback at a chosen decode step."""

from __future__ import annotations

from collections.abc import Callable, Set

import torch
import torch.nn as nn


@torch.no_grad()
def greedy_reference(
    model: nn.Module, prompt: list[int], n: int, banned: tuple[set[int], int] = (set(), 0), stop: Set[int] = frozenset()
) -> list[int]:
    """Argmax decoding with full recomputation; ``banned = (ids, until)`` masks ids before ``until`` tokens."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < n:
        logits = model(torch.tensor([tokens]))[0, -1].clone()
        if len(out) < banned[1]:
            logits[list(banned[0])] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        tokens.append(tok)
        if tok in stop:
            break
    return out


@torch.no_grad()
def logprob_reference(model: nn.Module, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion]))[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[len(prompt) - 1 : -1].gather(1, torch.tensor(completion)[:, None]).squeeze(1)


class _Triggered(nn.Module):
    """The model, plus callbacks fired after given forward calls (to inject arrivals mid-decode)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.args = model.args
        self.calls: list[tuple[int, ...]] = []
        self.triggers: dict[int, Callable[[], None]] = {}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        out = self.inner(tokens, positions=positions, cache=cache)
        self.calls.append(tuple(tokens.shape))
        trigger = self.triggers.pop(len(self.calls), None)
        if trigger is not None:
            trigger()
        return out
