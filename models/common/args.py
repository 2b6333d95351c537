"""``DecoderArgs``: the fields shared by the Qwen decoder family, and their HF config reading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from models.model_args import (
    BaseModelArgs,
    HFConfigError,
    RefusedSetting,
    hf_config_to_dict,
    probing_unimplemented,
    read_head_dim,
    read_rope,
    reject_sliding_window,
    reject_unsupported_activation,
    require_keys,
)


class MoEArgs(Protocol):
    """The expert fields a decoder with MoE blocks reads (declared by MoE models' args, e.g. Qwen3-MoE)."""

    moe_hidden_dim: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool


@dataclass
class DecoderArgs(BaseModelArgs):
    """A pre-norm decoder with grouped-query attention, RoPE and SwiGLU (or MoE) blocks."""

    hf_model_type: ClassVar[str] = ""
    hf_architecture: ClassVar[str] = ""
    hf_key_aliases: ClassVar[dict[str, str]] = {}
    """This model's config.json spelling -> the spelling read here (e.g. ``{"layer_norm_eps": "rms_norm_eps"}``)."""
    refused_settings: ClassVar[tuple[RefusedSetting, ...]] = ()
    """Config values that switch on features this model does not implement (checked by ``from_hf_config``)."""
    unimplemented: ClassVar[tuple[str, ...]] = ()
    """Differences from transformers' model not implemented yet (``scripts/add_model.py`` lists them); while any
    remain, ``from_hf_config`` refuses to build the model outside ``allow_unimplemented()`` (parity probes)."""

    dim: int = 4096
    """Hidden size (``hidden_size``)."""
    n_layers: int = 32
    """Number of decoder blocks (``num_hidden_layers``)."""
    n_heads: int = 32
    """Query heads (``num_attention_heads``)."""
    n_kv_heads: int = 8
    """Key/value heads (``num_key_value_heads``)."""
    head_dim: int = 128
    """Per-head size; may differ from ``dim // n_heads`` (Qwen3)."""
    vocab_size: int = 151936
    """Vocabulary size."""
    hidden_dim: int = 12288
    """Dense SwiGLU intermediate size (``intermediate_size``)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (``rms_norm_eps``)."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    max_seq_len: int = 32768
    """Longest sequence the model was trained for (``max_position_embeddings``); informational."""
    tie_word_embeddings: bool = False
    """The LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """Bias on ``wq, wk, wv``."""
    o_bias: bool = False
    """Bias on ``wo``."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys (Qwen3)."""
    initializer_range: float = 0.02
    """Standard deviation of ``init_weights``' normal initialisation."""

    def is_moe_layer(self, layer_id: int) -> bool:
        """True if block ``layer_id`` uses routed experts instead of a dense feed-forward."""
        return False

    # ---- Hugging Face config ------------------------------------------------------------
    @classmethod
    def _decoder_fields_from_hf(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        require_keys(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
        reject_sliding_window(cfg)
        if not any(point.startswith("mlp") for point in cls.unimplemented):
            # (while the MLP is a listed difference, the parity probes must still build the model)
            reject_unsupported_activation(cfg)
        for setting in cls.refused_settings:
            setting.check(cfg)
        rope_type, rope_theta, scaling = read_rope(cfg)
        if rope_type != "default":
            raise HFConfigError(
                f"config of model_type {cfg.get('model_type')!r} asks for RoPE scaling type {rope_type!r} "
                f"({scaling}); Archon implements only default RoPE. Remove rope_scaling / set "
                "rope_parameters.rope_type to 'default' if the model does not need long-context scaling."
            )
        if float(cfg.get("attention_dropout") or 0.0) != 0.0:
            raise HFConfigError(
                f"config of model_type {cfg.get('model_type')!r} has attention_dropout="
                f"{cfg['attention_dropout']}; Archon implements attention without dropout, set it to 0."
            )
        n_heads = int(cfg["num_attention_heads"])
        n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
        if n_heads % n_kv_heads:
            raise HFConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}.")
        return dict(
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=read_head_dim(cfg),
            vocab_size=int(cfg["vocab_size"]),
            hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_seq_len=int(cfg.get("max_position_embeddings") or 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            initializer_range=float(cfg.get("initializer_range") or 0.02),
        )

    @classmethod
    def _check_model_type(cls, cfg: dict[str, Any]) -> None:
        model_type = cfg.get("model_type")
        if model_type is not None and model_type != cls.hf_model_type:
            raise HFConfigError(
                f"{cls.__name__} reads configs of model_type {cls.hf_model_type!r}, got {model_type!r}."
            )

    @classmethod
    def _model_fields_from_hf(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Fields specific to one model type; subclasses override."""
        return {}

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False) -> DecoderArgs:
        cfg = hf_config_to_dict(hf_config)
        cls._check_model_type(cfg)
        if cls.unimplemented and not probing_unimplemented():
            raise HFConfigError(
                f"{cls.__name__} ({cls.hf_model_type}) does not implement yet: "
                f"{', '.join(cls.unimplemented)}; see the report at the top of its model.py and "
                "its parity test, or train this model type with an 'fsdp:' allocation meanwhile"
            )
        source = dict(cfg)
        cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in cls.hf_key_aliases.items() if theirs in cfg}}
        fields = cls._decoder_fields_from_hf(cfg)
        fields.update(cls._model_fields_from_hf(cfg))
        if is_critic:
            # A critic's value head is its own matrix even if the LM head was tied.
            fields["tie_word_embeddings"] = False
        return cls(**fields, is_critic=is_critic, hf_config=source)

    def _update_hf_config(self, cfg: dict[str, Any]) -> None:
        """Write the config.json fields specific to one model type; subclasses override."""

    def to_hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = dict(self.hf_config or {})
        for stale in ("_name_or_path", "transformers_version", "auto_map"):
            cfg.pop(stale, None)
        cfg.update(
            model_type=self.hf_model_type,
            hidden_size=self.dim,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            intermediate_size=self.hidden_dim,
            rms_norm_eps=self.norm_eps,
            max_position_embeddings=self.max_seq_len,
            hidden_act="silu",
            initializer_range=self.initializer_range,
            use_sliding_window=False,
            attention_dropout=0.0,
        )
        if "layer_types" in cfg:  # one entry per layer; sliding window is never on here
            cfg["layer_types"] = ["full_attention"] * self.n_layers
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        cfg["rope_theta"] = self.rope_theta
        cfg.pop("rope_scaling", None)
        for theirs, ours in self.hf_key_aliases.items():
            # Written in this model's own spelling (the shared spelling is what was read).
            cfg[theirs] = cfg.pop(ours, cfg.get(theirs))
        self._update_hf_config(cfg)
        if self.is_critic:
            # transformers' *ForTokenClassification with one label is the HF form of a critic.
            cfg["architectures"] = [self.hf_architecture.replace("ForCausalLM", "ForTokenClassification")]
            cfg["num_labels"] = 1
            cfg["id2label"] = {"0": "LABEL_0"}
            cfg["label2id"] = {"LABEL_0": 0}
            cfg["token_classification_bias"] = False
            cfg["tie_word_embeddings"] = False
        else:
            cfg["architectures"] = [self.hf_architecture]
            cfg["tie_word_embeddings"] = self.tie_word_embeddings
        return cfg
