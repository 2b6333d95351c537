"""``BaseModelArgs`` and the readers of Hugging Face ``config.json`` spellings.

transformers has renamed several config fields over time (``rope_theta`` moved into
``rope_parameters``, ``num_experts`` became ``num_local_experts`` on disk, ``head_dim``
may be absent).  The helpers here accept every spelling so a model's ``from_hf_config``
reads one normalised value, and reject what a model does not implement instead of
silently computing a different function.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class HFConfigError(ValueError):
    """A Hugging Face config asks for something the Archon model does not implement."""


def hf_config_to_dict(hf_config: Any) -> dict[str, Any]:
    """Return a plain dict for a ``config.json`` dict or a ``transformers`` config object."""
    if isinstance(hf_config, Mapping):
        return copy.deepcopy(dict(hf_config))
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise TypeError(
            f"expected a config.json dict or a transformers PretrainedConfig, got {type(hf_config).__name__}"
        )
    return to_dict()


def _where(cfg: Mapping[str, Any]) -> str:
    return f"config of model_type {cfg.get('model_type', '?')!r}"


def require_keys(cfg: Mapping[str, Any], *keys: str) -> None:
    """Raise ``HFConfigError`` naming every missing key."""
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise HFConfigError(f"{_where(cfg)} is missing {', '.join(missing)}; add them to config.json.")


def read_rope(cfg: Mapping[str, Any], default_theta: float = 10000.0) -> tuple[str, float, dict[str, Any]]:
    """Return ``(rope_type, rope_theta, scaling_params)`` from either config spelling.

    transformers >= 5 writes ``rope_parameters = {"rope_type": ..., "rope_theta": ...}``;
    older configs write ``rope_theta`` next to ``rope_scaling`` (``None`` or a dict whose
    type key is ``rope_type`` or, older still, ``type``).
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        raise HFConfigError(
            f"{_where(cfg)} has per-layer-type rope_parameters {sorted(params)}; "
            "Archon's Qwen models use one RoPE for every layer."
        )
    candidates = [dict(p) for p in (params, cfg.get("rope_scaling")) if isinstance(p, Mapping) and p]
    theta = next((c["rope_theta"] for c in candidates if c.get("rope_theta") is not None), None)
    if theta is None:
        theta = cfg.get("rope_theta", default_theta)
    # If either spelling asks for scaling, that is what the checkpoint was trained with.
    rope_type, scaling = "default", {}
    for c in candidates:
        kind = c.pop("rope_type", None) or c.pop("type", None) or "default"
        c.pop("type", None)
        c.pop("rope_theta", None)
        if kind != "default":
            rope_type, scaling = kind, c
            break
    return str(rope_type), float(theta), scaling


def read_num_experts(cfg: Mapping[str, Any]) -> int:
    """``num_experts`` (transformers < 5, Qwen's own configs) or ``num_local_experts`` (5.x on disk)."""
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    raise HFConfigError(f"{_where(cfg)} has neither num_experts nor num_local_experts; add one to config.json.")


def read_head_dim(cfg: Mapping[str, Any]) -> int:
    """``head_dim`` when given, else ``hidden_size // num_attention_heads`` (what transformers does)."""
    if cfg.get("head_dim") is not None:
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def reject_sliding_window(cfg: Mapping[str, Any]) -> None:
    """Raise when any layer would use sliding-window attention (not implemented)."""
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or "sliding_attention" in layer_types:
        raise HFConfigError(
            f"{_where(cfg)} enables sliding-window attention (use_sliding_window={cfg.get('use_sliding_window')}, "
            f"sliding_window={cfg.get('sliding_window')}), which Archon does not implement; "
            "set use_sliding_window=false if the model was trained without it."
        )


def reject_unsupported_activation(cfg: Mapping[str, Any], supported: tuple[str, ...] = ("silu",)) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in supported:
        raise HFConfigError(f"{_where(cfg)} uses hidden_act={act!r}; Archon implements only {list(supported)}.")


@dataclass(frozen=True)
class RefusedSetting:
    """A config value that switches on something the model does not implement; ``from_hf_config`` refuses it."""

    key: str
    """The config.json key."""
    off: Any
    """The value that means "not used" (None, False, 1.0, ...)."""
    what: str
    """What the setting switches on, for the error message."""
    off_key: str = ""
    """When set, the setting is off if it equals this other key's value (e.g. ``head_dim``)."""

    def is_on(self, cfg: Mapping[str, Any]) -> bool:
        value = cfg.get(self.key)
        off = cfg.get(self.off_key) if self.off_key else self.off
        return not (value is None or value is False or value == off)

    def check(self, cfg: Mapping[str, Any]) -> None:
        if self.is_on(cfg):
            off = f"{self.off_key} ({cfg.get(self.off_key)})" if self.off_key else repr(self.off)
            raise HFConfigError(
                f"{_where(cfg)} sets {self.key}={cfg.get(self.key)!r} ({self.what}), which this "
                f"Archon model does not implement; set it to {off} if the checkpoint was trained "
                "without it, or implement it in the model package"
            )


_PROBING = [False]


@contextmanager
def allow_unimplemented() -> Iterator[None]:
    """Let ``from_hf_config`` build a model whose args list unimplemented differences (parity probes only)."""
    _PROBING.append(True)
    try:
        yield
    finally:
        _PROBING.pop()


def probing_unimplemented() -> bool:
    """True inside ``allow_unimplemented()``."""
    return _PROBING[-1]


@dataclass
class BaseModelArgs:
    """Arguments every Archon model is built from.

    A model package subclasses this, adds its architecture fields and implements
    ``from_hf_config`` / ``to_hf_config``.  ``hf_config`` keeps the dict the model came from so
    that ``save_hf`` writes a config.json transformers loads as the same architecture.
    """

    is_critic: bool = False
    """Replace the LM head with a scalar value head (``output`` with one output feature)."""
    hf_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """The Hugging Face config dict this model was built from (None when built from args)."""

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False) -> BaseModelArgs:
        """Build args from a ``config.json`` dict or a transformers config object."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_hf_config")

    def to_hf_config(self) -> dict[str, Any]:
        """Return a ``config.json`` dict transformers loads as this architecture."""
        raise NotImplementedError(f"{type(self).__name__} does not implement to_hf_config")
