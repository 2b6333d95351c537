"""Rotary position embedding (the Qwen / "rotate half" variant), positions passed in."""

from __future__ import annotations

import torch
import torch.nn as nn


def compute_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of default RoPE, computed on CPU in float32 like transformers."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k [batch, seq, heads, head_dim]`` by ``cos, sin [batch, seq, head_dim]``."""
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class RotaryEmbedding(nn.Module):
    """Produces ``cos, sin`` for explicit positions, so packed sequences can restart at 0.

    ``inv_freq`` is a non-persistent buffer: it is not in checkpoints, and it is recomputed
    (float32, on CPU, then moved) by ``init_buffers`` and after every ``to``/``to_empty``,
    so it stays exact when the model runs in bfloat16; cos/sin are computed in float32 and
    cast to the activation dtype.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta), persistent=False)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        # Computed on CPU then moved, so every device gets the same bits as transformers.
        device = buffer_device if buffer_device is not None else self.inv_freq.device
        self.inv_freq = compute_inv_freq(self.head_dim, self.theta).to(device)

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(torch.bfloat16)`` would round the frequencies and ``to_empty`` would leave
        # them uninitialised; recompute them in float32 after any conversion instead.
        module = super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.init_buffers(self.inv_freq.device)
        return module

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [batch, seq]`` -> ``cos, sin [batch, seq, head_dim]`` in ``dtype``."""
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
