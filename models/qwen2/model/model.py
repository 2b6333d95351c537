"""Qwen2 causal LM (or critic): the shared Qwen decoder with qkv bias and no q/k norm."""

from __future__ import annotations

from models.common.decoder import Decoder
from models.qwen2.model.args import Qwen2ModelArgs


class Qwen2Model(Decoder):
    """Qwen2 / Qwen2.5 dense decoder; see ``models.common.decoder.Decoder`` for the interface."""

    def __init__(self, args: Qwen2ModelArgs) -> None:
        super().__init__(args)
