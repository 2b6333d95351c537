"""Qwen3-MoE causal LM (or critic): Qwen3 attention with routed-expert blocks."""

from __future__ import annotations

from models.common.decoder import Decoder
from models.qwen3_moe.model.args import Qwen3MoeModelArgs


class Qwen3MoeModel(Decoder):
    """Qwen3-MoE decoder.  MoE blocks have ``moe`` (``router.gate``, ``experts.w1/w2/w3``)
    instead of ``feed_forward``; ``layers[i].moe.tokens_per_expert`` holds router statistics."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__(args)
