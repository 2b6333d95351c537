"""Where a new model comes from: a transformers ``model_type`` or an HF folder, and its tiny probe config.

The tiny config is the source's own (the folder's config.json, or the model type's defaults)
with only the sizes shrunk and every optional feature the shared blocks lack switched to its
"off" value (``OPTIONAL_SETTINGS``): those are refused by the generated ``from_hf_config`` when
on.  Every other value of the source is kept, multipliers and scalings included
(``SCALING_SETTINGS``): the probes compare the architecture as the source configures it, and
report what those values change as differences.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from models.model_args import RefusedSetting

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ScaffoldError(ValueError):
    """A model cannot be scaffolded as asked; the message says why and what to do."""


OPTIONAL_SETTINGS: tuple[RefusedSetting, ...] = (
    RefusedSetting("sliding_window", None, "sliding-window attention"),
    RefusedSetting("attn_logit_softcapping", None, "soft-capping of attention logits"),
    RefusedSetting("final_logit_softcapping", None, "soft-capping of the final logits"),
    RefusedSetting(
        "query_pre_attn_scalar",
        None,
        "attention scaled by 1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim)",
        off_key="head_dim",
    ),
    RefusedSetting("mlp_bias", False, "biases in the MLP projections"),
    RefusedSetting("partial_rotary_factor", 1.0, "RoPE on only part of each head"),
)
"""Config values that switch on features ``models/common`` lacks, with the value that switches them off."""

SCALING_SETTINGS: tuple[RefusedSetting, ...] = (
    RefusedSetting("embedding_multiplier", 1.0, "a scaled embedding output"),
    RefusedSetting("residual_multiplier", 1.0, "scaled residual branches"),
    RefusedSetting("attention_multiplier", None, "a custom attention scale"),
    RefusedSetting("logits_scaling", 1.0, "scaled logits"),
    RefusedSetting("logit_scale", 1.0, "scaled logits"),
)
"""Multipliers and scalings the shared blocks lack.  The probe keeps the source's value (some config classes
accept no "off" value, granite's ``attention_multiplier`` for one): on, it is a difference the report names;
off, the generated ``from_hf_config`` refuses other values."""

BOOKKEEPING_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "model_type",
        "quantization_config",
        "_attn_implementation_autoset",
    }
)
"""Config keys that describe the checkpoint file, not the architecture (left out of the probe config)."""

TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")
ROPE_KEPT_KEYS = ("rope_theta", "partial_rotary_factor")
"""Entries of ``rope_parameters`` that describe plain RoPE (the probe drops the scaling ones)."""

SHARED_REFUSALS: dict[str, str] = {
    "use_sliding_window": "sliding-window attention (use_sliding_window)",
    "layer_types": "sliding-window layers (layer_types with 'sliding_attention')",
    "rope_parameters": "RoPE scaling (a rope_type other than 'default')",
    "rope_scaling": "RoPE scaling (a rope_type other than 'default')",
    "attention_dropout": "attention dropout (a non-zero attention_dropout)",
}
"""Config keys whose unsupported values the shared reader (``DecoderArgs``) already refuses."""

TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TINY_HEAD_DIM = 24
"""Deliberately not hidden_size / num_attention_heads, where the config has a head_dim field."""


@dataclass
class Source:
    """The model type to scaffold and the config it is read from."""

    model_type: str
    config: Any
    """The folder's config, or the model type's default config (a transformers config object)."""
    folder: Path | None
    causal_lm_class: type[PreTrainedModel]
    """transformers' ``*ForCausalLM`` class for this config."""

    @property
    def config_dict(self) -> dict[str, Any]:
        return self.config.to_dict()


def resolve_source(arg: str) -> Source:
    """A transformers model_type (``llama``) or an HF folder (its config.json names the model_type)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(arg)
    folder = None
    if path.exists() or "/" in arg or arg.startswith("."):
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ScaffoldError(
                f"'{arg}' is not a Hugging Face model folder (no config.json in it); pass a folder "
                "with config.json, or a transformers model_type such as 'llama'"
            )
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, json.JSONDecodeError) as exc:
            raise ScaffoldError(f"'{path / 'config.json'}' is not readable JSON ({exc}); fix or replace it") from None
        if not model_type:
            raise ScaffoldError(
                f"'{path / 'config.json'}' has no model_type; a Hugging Face model folder names its architecture there"
            )
        folder = path
    else:
        model_type = arg
    if model_type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        raise ScaffoldError(
            f"unknown model type '{model_type}': this transformers has no config class for it"
            f"{hint} (upgrade transformers if the model is newer)"
        )
    config = AutoConfig.from_pretrained(folder) if folder is not None else AutoConfig.for_model(model_type)
    try:
        # (the model mapping's values are model classes; transformers annotates them as pairs)
        cls = cast("type[PreTrainedModel]", AutoModelForCausalLM._model_mapping[type(config)])
    except KeyError:
        raise ScaffoldError(
            f"model type '{model_type}' has no *ForCausalLM class in transformers; Archon's model "
            "packages are causal LMs"
        ) from None
    return Source(model_type, config, folder, cls)


def tiny_config_kwargs(source: Source) -> dict[str, Any]:
    """Keyword arguments of the tiny probe config: the source's values with small sizes and optional features off.

    Only what differs from the model type's defaults is listed (the defaults fill the rest), so a
    folder's own values (token ids, multipliers, tied embeddings, ...) survive into the probe.
    """
    from transformers import AutoConfig

    cfg = source.config_dict
    defaults = AutoConfig.for_model(source.model_type).to_dict()
    kwargs: dict[str, Any] = {
        k: v for k, v in cfg.items() if k not in BOOKKEEPING_KEYS and (k not in defaults or defaults[k] != v)
    }
    kwargs.update(TINY_SIZES)
    if "head_dim" in cfg:
        kwargs["head_dim"] = TINY_HEAD_DIM
    n_layers = kwargs["num_hidden_layers"]
    if "layer_types" in cfg:
        kwargs["layer_types"] = ["full_attention"] * n_layers
    if "use_sliding_window" in cfg:
        kwargs["use_sliding_window"] = False
    if "attention_dropout" in cfg:
        kwargs["attention_dropout"] = 0.0
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        plain = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        plain.update({k: rope[k] for k in ROPE_KEPT_KEYS if k in rope})
        kwargs["rope_parameters"] = plain
    for setting in refused_settings_of(source)[0]:
        if setting.key in cfg:
            kwargs[setting.key] = (
                kwargs.get(setting.off_key, cfg.get(setting.off_key)) if setting.off_key else setting.off
            )
    for key in TOKEN_ID_KEYS:
        value = cfg.get(key)
        # Ids from the real vocabulary do not fit the tiny one; the others are the source's and stay.
        if isinstance(value, int):
            kwargs[key] = value if value < kwargs["vocab_size"] else None
        elif isinstance(value, list):
            kwargs[key] = [v for v in value if v < kwargs["vocab_size"]] or None
    return {k: kwargs[k] for k in sorted(kwargs)}


def make_tiny_config(model_type: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


def refused_settings_of(source: Source) -> tuple[list[RefusedSetting], list[str]]:
    """The optional settings this config type has (refused when on) and the shared refusals that apply.

    A scaling (``SCALING_SETTINGS``) is refused only where the source has it off; where on, the probe
    keeps it and the report names what it changes (``kept_scalings``).
    """
    cfg = source.config_dict
    own = [s for s in OPTIONAL_SETTINGS if s.key in cfg]
    own += [s for s in SCALING_SETTINGS if s.key in cfg and not s.is_on(cfg)]
    if "use_sliding_window" in cfg or "layer_types" in cfg:
        # The window size is inert unless the flag or a layer type turns it on; the shared reader checks those.
        own = [s for s in own if s.key != "sliding_window"]
    shared = sorted({what for key, what in SHARED_REFUSALS.items() if key in cfg})
    return own, shared


def kept_scalings(source: Source) -> dict[str, Any]:
    """The multipliers and scalings the source switches on (kept in the probe config), key -> value."""
    cfg = source.config_dict
    return {s.key: cfg[s.key] for s in SCALING_SETTINGS if s.key in cfg and s.is_on(cfg)}
