"""Qwen2 HF <-> Archon state-dict adapter."""

from __future__ import annotations

from models.common.state_dict_adapter import DecoderStateDictAdapter


class Qwen2StateDictAdapter(DecoderStateDictAdapter):
    """Qwen2 checkpoints use the shared Qwen naming (``model.layers.{i}.self_attn.q_proj.bias`` etc.)."""
