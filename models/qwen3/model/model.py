"""Qwen3 dense causal LM (or critic): the shared Qwen decoder with q/k RMSNorm."""

from __future__ import annotations

from models.common.decoder import Decoder
from models.qwen3.model.args import Qwen3ModelArgs


class Qwen3Model(Decoder):
    """Qwen3 dense decoder; see ``models.common.decoder.Decoder`` for the interface."""

    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__(args)
