"""A model whose forward takes longer, so that a test can hold requests in flight."""

from __future__ import annotations

import time

import torch.nn as nn


def _slow_down(model: nn.Module, seconds: float) -> None:
    """Make every forward take ``seconds`` longer, so control requests land mid-generation."""
    cls = type(model)

    def forward(self, *args, **kwargs):
        time.sleep(seconds)
        return cls.forward(self, *args, **kwargs)

    # A subclass, so the model registry still recognises the model (weight updates need it).
    model.__class__ = type(f"Slow{cls.__name__}", (cls,), {"forward": forward})
