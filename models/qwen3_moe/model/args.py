"""Qwen3-MoE model arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from models.model_args import HFConfigError, read_num_experts, require_keys
from models.qwen3.model.args import Qwen3ModelArgs


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    """Qwen3 attention with routed-expert feed-forward blocks (no shared expert)."""

    hf_model_type: ClassVar[str] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    num_experts: int = 128
    """Routed experts per MoE layer (``num_experts`` / ``num_local_experts``)."""
    top_k: int = 8
    """Experts per token (``num_experts_per_tok``)."""
    moe_hidden_dim: int = 768
    """Intermediate size of one expert (``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th block is an MoE block."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Blocks that use a dense feed-forward (``intermediate_size``) instead of experts."""

    def is_moe_layer(self, layer_id: int) -> bool:
        # The rule of transformers' Qwen3MoeDecoderLayer.
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def _model_fields_from_hf(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        fields = super()._model_fields_from_hf(cfg)
        require_keys(cfg, "num_experts_per_tok", "moe_intermediate_size")
        if cfg.get("shared_expert_intermediate_size"):
            raise HFConfigError(
                "config of model_type 'qwen3_moe' has shared_expert_intermediate_size; "
                "Archon's Qwen3-MoE has no shared expert."
            )
        num_experts = read_num_experts(cfg)
        top_k = int(cfg["num_experts_per_tok"])
        if num_experts and not 0 < top_k <= num_experts:
            raise HFConfigError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}.")
        fields.update(
            num_experts=num_experts,
            top_k=top_k,
            moe_hidden_dim=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in (cfg.get("mlp_only_layers") or [])],
        )
        return fields

    def _update_hf_config(self, cfg: dict[str, Any]) -> None:
        super()._update_hf_config(cfg)
        # Keep whichever spelling the source config used (5.x writes num_local_experts).
        experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
        cfg[experts_key] = self.num_experts
        cfg.update(
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_hidden_dim,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
        )
