"""``actor.lora``: low-rank adapters on the training engines (base weights frozen, adapters trained).

Names follow PEFT's ``LoraConfig`` and AReaL's engine options: ``enabled`` is AReaL's ``use_lora``,
``rank`` is AReaL's ``lora_rank`` and PEFT's ``r``, ``alpha`` is ``lora_alpha`` in both, ``dropout`` is
PEFT's ``lora_dropout``, ``target_modules`` and ``init_lora_weights`` are PEFT's (and AReaL's) own names,
``peft_type`` is AReaL's.  Target modules are named as in the Hugging Face model (``q_proj``, ``down_proj``),
whichever engine runs it, so one section serves ``archon:`` and ``fsdp:`` and the exported adapter folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoRAConfig:
    enabled: bool = False
    """Train low-rank adapters instead of the full model (AReaL: use_lora); the base weights stay frozen."""
    rank: int = 8
    """Rank r of every adapter (AReaL: lora_rank; PEFT: r)."""
    alpha: int = 16
    """Adapter scale numerator: the update is (alpha / rank) * B @ A (AReaL and PEFT: lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (PEFT: lora_dropout)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """HF module names (or name suffixes) that get adapters, or ['all-linear'] (PEFT and AReaL: target_modules)."""
    init_lora_weights: bool = True
    """PEFT's init: A Kaiming-uniform and B zero (the adapter starts as a no-op); false draws B randomly too (tests)."""
    peft_type: str = "lora"
    """Adapter kind (AReaL: peft_type); only 'lora'."""

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``."""
        return self.alpha / self.rank
