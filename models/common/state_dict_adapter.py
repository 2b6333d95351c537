"""HF <-> Archon names for the Qwen decoder family (qwen2, qwen3, qwen3_moe), and table-driven names
for packages ``scripts/add_model.py`` generates (``TableStateDictAdapter``).

HF checkpoints of all three share one naming scheme; keys a model does not have (q_norm for
qwen2, experts for a dense model) map to Archon names the model lacks, which the loader
reports as unexpected tensors.  MoE experts are stored per expert on disk
(``mlp.experts.{e}.gate_proj.weight``); transformers >= 5 holds them fused in memory
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), and both
forms are accepted when loading.  Writing always uses the per-expert form, which every
transformers version reads.

The routing bias of aux-loss-free balancing (``moe.expert_bias``) has no field in Qwen's HF
models; it travels under DeepSeek-V3's name (``mlp.gate.e_score_correction_bias``) to
Archon's own rollout server and sync folders, and is left out of HF exports
(``is_hf_field``).  A checkpoint without it loads with a zero bias.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from models.state_dict_adapter import BaseStateDictAdapter, HFKeyTarget, UnknownKeyError

# HF key suffix after "model.layers.{i}." -> Archon suffix after "layers.{i}."
_LAYER_KEYS: dict[str, str] = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    # DeepSeek-V3's name for the routing bias; Qwen's HF models have no such field (see below).
    "mlp.gate.e_score_correction_bias": "moe.expert_bias",
}
_LAYER_KEYS_INV = {v: k for k, v in _LAYER_KEYS.items()}
_EXPERT_HF_TO_ARCHON = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_ARCHON_TO_HF = {v: k for k, v in _EXPERT_HF_TO_ARCHON.items()}

# HF keys that hold no weights Archon needs (RoPE caches in old checkpoints).
_IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_HF_FUSED_DOWN = "mlp.experts.down_proj"
_ARCHON_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_ARCHON_EXPERTS = re.compile(r"^moe\.experts\.(w1|w2|w3)$")
_EXPERT_BIAS_HF = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias$")
_EXPERT_BIAS = re.compile(r"^layers\.\d+\.moe\.expert_bias$")


class DecoderStateDictAdapter(BaseStateDictAdapter):
    """Name mapping shared by the Qwen decoder family; ``model_args`` is a ``DecoderArgs``."""

    def _unknown(self, name: str, direction: str) -> UnknownKeyError:
        return UnknownKeyError(f"{type(self).__name__} has no {direction} mapping for {name!r}")

    # ---- HF -> Archon -------------------------------------------------------------------
    def map_hf_key(self, hf_name: str) -> tuple[str, int | None] | None:
        args = self.model_args
        if _IGNORED_HF.match(hf_name):
            return None
        if hf_name == "model.embed_tokens.weight":
            return "tok_embeddings.weight", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            # A critic loaded from a causal-LM checkpoint keeps its freshly initialised value head.
            return None if args.is_critic else ("output.weight", None)
        if hf_name == "score.weight" and args.is_critic:
            return "output.weight", None
        m = _HF_LAYER.match(hf_name)
        if m:
            layer, rest = m.groups()
            if rest in _LAYER_KEYS:
                return f"layers.{layer}.{_LAYER_KEYS[rest]}", None
            e = _HF_EXPERT.match(rest)
            if e:
                expert, proj = e.groups()
                return f"layers.{layer}.moe.experts.{_EXPERT_HF_TO_ARCHON[proj]}", int(expert)
            if rest == _HF_FUSED_DOWN:
                return f"layers.{layer}.moe.experts.w2", None
        raise self._unknown(hf_name, "HF -> Archon")

    def hf_key_targets(self, hf_name: str) -> list[HFKeyTarget]:
        m = _HF_LAYER.match(hf_name)
        if m and m.group(2) == _HF_FUSED_GATE_UP:
            # transformers >= 5 in-memory layout: gate and up stacked along dim 1.
            hidden = self.model_args.moe_hidden_dim
            prefix = f"layers.{m.group(1)}.moe.experts"
            return [
                HFKeyTarget(f"{prefix}.w1", None, (1, 0, hidden)),
                HFKeyTarget(f"{prefix}.w3", None, (1, hidden, hidden)),
            ]
        return super().hf_key_targets(hf_name)

    # ---- Archon -> HF -------------------------------------------------------------------
    def to_hf_tensors(self, archon_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        args = self.model_args
        if archon_name == "tok_embeddings.weight":
            return [("model.embed_tokens.weight", tensor)]
        if archon_name == "norm.weight":
            return [("model.norm.weight", tensor)]
        if archon_name == "output.weight":
            if args.is_critic:
                return [("score.weight", tensor)]
            if args.tie_word_embeddings:
                return []  # stored once, as the embedding
            return [("lm_head.weight", tensor)]
        m = _ARCHON_LAYER.match(archon_name)
        if m:
            layer, rest = m.groups()
            if rest in _LAYER_KEYS_INV:
                return [(f"model.layers.{layer}.{_LAYER_KEYS_INV[rest]}", tensor)]
            e = _ARCHON_EXPERTS.match(rest)
            if e:
                proj = _EXPERT_ARCHON_TO_HF[e.group(1)]
                return [
                    (f"model.layers.{layer}.mlp.experts.{i}.{proj}.weight", tensor[i]) for i in range(tensor.shape[0])
                ]
        raise self._unknown(archon_name, "Archon -> HF")

    # ---- loader hints -------------------------------------------------------------------
    def num_experts_of(self, archon_name: str) -> int:
        return int(getattr(self.model_args, "num_experts", 0))

    def is_optional(self, archon_name: str) -> bool:
        # A critic built from a causal-LM checkpoint has no value head in it; HF checkpoints
        # of Qwen models have no routing bias (it stays zero).
        if _EXPERT_BIAS.match(archon_name):
            return True
        return bool(self.model_args.is_critic) and archon_name == "output.weight"

    def is_hf_field(self, hf_name: str) -> bool:
        # transformers' Qwen3-MoE routes without a bias, so an exported bias would be ignored.
        return not _EXPERT_BIAS_HF.match(hf_name)


class TableStateDictAdapter(BaseStateDictAdapter):
    """HF <-> Archon names from two tables, for decoders whose checkpoints name things their own way.

    ``scripts/add_model.py`` derives the tables by matching a transformers model's parameters
    against Archon's shared blocks.  ``top_keys`` maps whole HF keys (embedding, final norm,
    LM head); ``layer_keys`` maps what follows ``<hf_layer_prefix>.{i}.`` to what follows
    ``layers.{i}.``.  A critic reads and writes its value head as ``score.weight``.
    """

    hf_layer_prefix: ClassVar[str] = "model.layers"
    """HF path of the block list."""
    top_keys: ClassVar[dict[str, str]] = {}
    """HF key -> Archon name outside the blocks."""
    layer_keys: ClassVar[dict[str, str]] = {}
    """HF key suffix inside block i -> Archon name suffix inside ``layers.{i}``."""
    ignored: ClassVar[tuple[str, ...]] = (r".*\.rotary_emb\.inv_freq",)
    """Regular expressions of HF keys that hold nothing Archon needs."""

    def __init__(self, model_args: Any) -> None:
        super().__init__(model_args)
        self._layer = re.compile(rf"^{re.escape(self.hf_layer_prefix)}\.(\d+)\.(.+)$")
        self._top_inv = {v: k for k, v in self.top_keys.items()}
        self._layer_inv = {v: k for k, v in self.layer_keys.items()}

    def _unknown(self, name: str, direction: str) -> UnknownKeyError:
        return UnknownKeyError(f"{type(self).__name__} has no {direction} mapping for {name!r}")

    def map_hf_key(self, hf_name: str) -> tuple[str, int | None] | None:
        critic = bool(self.model_args.is_critic)
        if any(re.fullmatch(p, hf_name) for p in self.ignored):
            return None
        if hf_name in self.top_keys:
            target = self.top_keys[hf_name]
            # A critic loaded from a causal-LM checkpoint keeps its freshly initialised value head.
            return None if critic and target == "output.weight" else (target, None)
        if hf_name == "score.weight" and critic:
            return "output.weight", None
        m = self._layer.match(hf_name)
        if m and m.group(2) in self.layer_keys:
            return f"layers.{m.group(1)}.{self.layer_keys[m.group(2)]}", None
        raise self._unknown(hf_name, "HF -> Archon")

    def to_hf_tensors(self, archon_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        args = self.model_args
        if archon_name == "output.weight":
            if args.is_critic:
                return [("score.weight", tensor)]
            if args.tie_word_embeddings:
                return []  # stored once, as the embedding
        if archon_name in self._top_inv:
            return [(self._top_inv[archon_name], tensor)]
        m = _ARCHON_LAYER.match(archon_name)
        if m and m.group(2) in self._layer_inv:
            return [(f"{self.hf_layer_prefix}.{m.group(1)}.{self._layer_inv[m.group(2)]}", tensor)]
        raise self._unknown(archon_name, "Archon -> HF")

    def is_optional(self, archon_name: str) -> bool:
        return bool(self.model_args.is_critic) and archon_name == "output.weight"
