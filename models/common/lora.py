"""``LoRALinear``: a frozen linear layer plus a trainable low-rank update, ``W x + (alpha / r) B A x``.

It subclasses ``Linear`` and keeps the base layer's ``weight`` and ``bias`` under their own names,
so checkpoints, HF name maps and parallel plans that name the layer still find them; the adapter is
two more parameters of the same module, ``lora_a [r, in]`` and ``lora_b [out, r]`` (PEFT's ``lora_A``
and ``lora_B`` weights).  Tensor parallel places them by the base layer's split (see
``parallel/tensor_parallel.py``): a column-parallel layer splits ``lora_b`` on its output dim and
replicates ``lora_a``; a row-parallel layer splits ``lora_a`` on its input dim and replicates ``lora_b``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.linear import Linear, linear


class LoRALinear(Linear):
    """``Linear`` whose ``weight``/``bias`` are frozen and whose output adds ``scale * lora_b @ lora_a @ x``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = rank
        self.scale = alpha / rank
        # Adapters are trained in float32 whatever the base's dtype (their master weights).  Zeros here: drawing
        # from the global generator would shift what a seeded init of the rest of the model draws.
        self.lora_a = nn.Parameter(torch.zeros(rank, in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=torch.float32))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else None
        # False: the layer is its frozen base alone (the RL reference, see ``models.lora.adapters_disabled``).  A
        # plain Python bool: the same on every rank under FSDP/TP/PP; torch.compile guards on it (one recompile).
        self.adapter_enabled = True

    @classmethod
    def from_linear(cls, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
        """A ``LoRALinear`` that takes over ``base``'s weight and bias tensors (any device, meta included)."""
        # Built on meta (no draws from the global generator), then given the base's tensors.
        lora = cls(
            base.in_features,
            base.out_features,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            bias=base.bias is not None,
            device="meta",
            dtype=base.weight.dtype,
        )
        lora.weight = nn.Parameter(base.weight.data, requires_grad=False)
        if base.bias is not None:
            lora.bias = nn.Parameter(base.bias.data, requires_grad=False)
        device = base.weight.device
        lora.lora_a = nn.Parameter(torch.zeros(rank, base.in_features, device=device, dtype=torch.float32))
        lora.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=torch.float32))
        return lora

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = linear(input, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        x = self.lora_dropout(input) if self.lora_dropout is not None else input
        # The adapter's two products run in the input's dtype (autocast picks it under mixed precision).
        update = F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        return out + update * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def init_lora_tensors(
    in_features: int, out_features: int, rank: int, generator: torch.Generator, zero_b: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's init of full adapter tensors: ``A [r, in]`` Kaiming-uniform (a = sqrt(5), as ``nn.Linear``'s
    weight), ``B [out, r]`` zero, or with ``zero_b=False`` drawn as ``nn.Linear`` draws a weight (PEFT's
    init_lora_weights=False)."""
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on a weight with in_features columns
    a = torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)
    b = torch.zeros(out_features, rank)
    if not zero_b:
        b_bound = 1.0 / math.sqrt(rank)  # nn.Linear's default init of a weight with rank columns
        b.uniform_(-b_bound, b_bound, generator=generator)
    return a, b


def merge_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * lora_b @ lora_a`` computed in float32, returned in ``weight``'s dtype (full tensors)."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scale).to(weight.dtype)
