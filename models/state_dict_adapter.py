"""``BaseStateDictAdapter``: Hugging Face <-> Archon parameter names and layouts.

The conversion works one tensor at a time so that checkpoint loading and weight sync can
stream: ``hf_key_targets`` says, from a checkpoint key alone, which Archon tensor (and which
expert slice of a grouped expert tensor) it fills, so a loader can skip tensors a pipeline
stage does not own without reading them; ``to_hf_tensors`` turns one Archon tensor into the
HF tensors it is stored as (a grouped expert tensor becomes one tensor per expert).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch


class UnknownKeyError(KeyError):
    """A checkpoint or model key the adapter has no mapping for."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class HFKeyTarget:
    """Where (part of) one Hugging Face checkpoint tensor goes in the Archon model."""

    name: str
    """Archon parameter or buffer name (``layers.0.attention.wq.weight``)."""
    expert: int | None = None
    """Index along dim 0 of a grouped expert tensor, or None for the whole tensor."""
    narrow: tuple[int, int, int] | None = None
    """``(dim, start, length)`` of the HF tensor that belongs here (fused HF tensors), or None."""

    def take(self, hf_tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``hf_tensor`` that goes to this target."""
        if self.narrow is None:
            return hf_tensor
        dim, start, length = self.narrow
        return hf_tensor.narrow(dim, start, length)


class BaseStateDictAdapter:
    """Maps names and layouts between a Hugging Face checkpoint and an Archon model.

    Subclasses implement ``map_hf_key`` and ``to_hf_tensors``; fused HF tensors that fill
    several Archon tensors override ``hf_key_targets`` as well.
    """

    def __init__(self, model_args: Any) -> None:
        self.model_args = model_args

    # ---- HF -> Archon -------------------------------------------------------------------
    def map_hf_key(self, hf_name: str) -> tuple[str, int | None] | None:
        """Return ``(archon_name, expert_index_or_None)`` for a one-to-one HF key.

        Returns None for keys the model deliberately ignores (for example ``lm_head.weight``
        when loading a causal-LM checkpoint into a critic).  Raises ``UnknownKeyError`` for
        keys it does not know.
        """
        raise NotImplementedError

    def hf_key_targets(self, hf_name: str) -> list[HFKeyTarget]:
        """Every Archon tensor (part) that checkpoint key ``hf_name`` fills; [] if ignored."""
        mapped = self.map_hf_key(hf_name)
        if mapped is None:
            return []
        name, expert = mapped
        return [HFKeyTarget(name, expert)]

    def from_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
        """Convert one HF tensor into ``(archon_name, expert_index_or_None, tensor)`` items."""
        return [(t.name, t.expert, t.take(tensor)) for t in self.hf_key_targets(hf_name)]

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-dict HF -> Archon; per-expert tensors are stacked into grouped 3-D tensors."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        for hf_name, tensor in hf_state_dict.items():
            for name, expert, value in self.from_hf_tensor(hf_name, tensor):
                if expert is None:
                    out[name] = value
                else:
                    experts[name][expert] = value
        for name, by_index in experts.items():
            n = self.num_experts_of(name)
            absent = sorted(set(range(n)) - set(by_index))
            if absent:
                raise UnknownKeyError(f"{name}: experts {absent} are missing from the HF state dict")
            out[name] = torch.stack([by_index[e] for e in range(n)])
        return out

    # ---- Archon -> HF -------------------------------------------------------------------
    def to_hf_tensors(self, archon_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Convert one Archon tensor into the HF ``(name, tensor)`` pairs it is stored as.

        Returns [] for tensors that are not stored (a tied LM head).
        """
        raise NotImplementedError

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-dict Archon -> HF."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            for hf_name, value in self.to_hf_tensors(name, tensor):
                out[hf_name] = value
        return out

    # ---- helpers for loaders -----------------------------------------------------------
    def num_experts_of(self, archon_name: str) -> int:
        """Number of experts of a grouped expert tensor (for completeness checks)."""
        return int(self.model_args.num_experts)

    def is_optional(self, archon_name: str) -> bool:
        """True if a loader may leave this tensor at its initial value when a checkpoint lacks it."""
        return False

    def is_hf_field(self, hf_name: str) -> bool:
        """False for an HF name Archon adds beyond the HF architecture (it is kept out of HF exports
        and only travels to Archon's own servers)."""
        return True
