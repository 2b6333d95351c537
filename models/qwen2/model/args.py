"""Qwen2 model arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from models.common.args import DecoderArgs
from models.model_args import HFConfigError


@dataclass
class Qwen2ModelArgs(DecoderArgs):
    """Qwen2: bias on the q/k/v projections, none on the output projection, no q/k norm."""

    hf_model_type: ClassVar[str] = "qwen2"
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"

    qkv_bias: bool = True
    """Bias on ``wq, wk, wv`` (always on in Qwen2)."""

    @classmethod
    def _model_fields_from_hf(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)

    def _update_hf_config(self, cfg: dict[str, Any]) -> None:
        if not self.qkv_bias or self.o_bias or self.qk_norm:
            raise HFConfigError(
                "a Qwen2 config.json cannot express qkv_bias=False, o_bias=True or qk_norm=True; "
                "use Qwen3ModelArgs for those."
            )
