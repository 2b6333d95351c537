"""Qwen3 model arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from models.common.args import DecoderArgs
from models.model_args import HFConfigError


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    """Qwen3: RMSNorm over head_dim on queries and keys; ``attention_bias`` on all four projections."""

    hf_model_type: ClassVar[str] = "qwen3"
    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"

    qk_norm: bool = True
    """RMSNorm over head_dim on queries and keys (always on in Qwen3)."""

    @classmethod
    def _model_fields_from_hf(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def _update_hf_config(self, cfg: dict[str, Any]) -> None:
        if self.qkv_bias != self.o_bias or not self.qk_norm:
            raise HFConfigError(
                f"a {self.hf_model_type} config.json needs qkv_bias == o_bias (attention_bias) and qk_norm=True."
            )
        cfg["attention_bias"] = self.qkv_bias
