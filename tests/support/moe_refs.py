"""MoE references of the routing replay tests: the experts a plain forward routes each token through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch
from hf_fixtures import decoder

if TYPE_CHECKING:
    from models.common.decoder import TransformerBlock


@torch.no_grad()
def routing_of(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), n_layers, top_k]`` experts of one plain forward (dense layers 0)."""
    layers = cast("Mapping[str, TransformerBlock]", decoder(model).layers)
    moes = {int(i): block.moe for i, block in layers.items() if block.moe_enabled}
    for moe in moes.values():
        moe.record_routing = True
    model(torch.tensor([tokens]))
    k = next(iter(moes.values())).top_k
    out = torch.zeros(len(tokens), decoder(model).args.n_layers, k, dtype=torch.int32)
    for i, moe in moes.items():
        assert moe.selected_experts is not None
        out[:, i] = moe.selected_experts[0].int()
    return out
