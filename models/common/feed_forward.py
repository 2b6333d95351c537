"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.linear import Linear


class FeedForward(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``: ``w1`` is the gate, ``w3`` the up and ``w2`` the down projection."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.w1, self.w2, self.w3):
            nn.init.normal_(linear.weight, mean=0.0, std=init_std)
