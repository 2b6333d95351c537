"""Qwen3-MoE HF <-> Archon state-dict adapter."""

from __future__ import annotations

from models.common.state_dict_adapter import DecoderStateDictAdapter


class Qwen3MoeStateDictAdapter(DecoderStateDictAdapter):
    """Per-expert HF keys (``mlp.experts.{e}.gate_proj.weight``) <-> grouped ``moe.experts.w1[e]``.

    Fused transformers-5 keys (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) load too.
    """
