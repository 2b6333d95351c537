"""Qwen3 HF <-> Archon state-dict adapter."""

from __future__ import annotations

from models.common.state_dict_adapter import DecoderStateDictAdapter


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    """Qwen3 checkpoints use the shared Qwen naming plus ``self_attn.{q,k}_norm.weight``."""
