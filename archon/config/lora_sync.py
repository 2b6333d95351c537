"""``rollout.lora_sync``: whether a LoRA actor's weight syncs send only its adapters or the merged weights.

Adapter sync writes a PEFT folder per sync and has every server load it through its LoRA endpoint (SGLang's and
vLLM's ``load_lora_adapter``, the built-in server's), so a sync moves megabytes instead of the whole model.  It
needs an actor engine that writes PEFT folders (``archon:``, ``fsdp:``) and servers that can read the folder; 'auto'
keeps merged weights where they travel by reference (``rollout.weight_sync = 'tensor'``, colocated) or where the
rollout runs inside the trainer (``inprocess:``), and where an MoE routing bias is trained beside the adapters
(``actor.archon.moe_load_balance = 'aux_free'``).
"""

from __future__ import annotations

from typing import Literal

from archon.alloc import ModelAllocation
from archon.config.schema import Config, ConfigError

PEFT_ENGINES = ("archon", "fsdp")
"""Actor backends whose engines write PEFT adapter folders (``TrainEngine.export_peft``)."""


def resolved_lora_sync(cfg: Config) -> Literal["adapter", "merged"]:
    """What ``rollout.lora_sync`` means for ``cfg``: 'adapter' or 'merged'."""
    mode = cfg.rollout.lora_sync
    if mode != "auto":
        return mode
    if not cfg.actor.lora.enabled or cfg.rollout.weight_sync == "tensor":
        return "merged"
    if cfg.actor.archon.moe_load_balance == "aux_free":
        return "merged"  # the MoE routing bias moves during training and is no adapter: it travels merged
    actor = ModelAllocation.from_str(cfg.actor.backend).backend
    rollout = ModelAllocation.from_str(cfg.rollout.backend).backend
    return "adapter" if actor in PEFT_ENGINES and rollout != "inprocess" else "merged"


def check_lora_sync(cfg: Config, sources: dict[str, str]) -> None:
    """Refuse ``rollout.lora_sync = 'adapter'`` where there are no adapters, or nothing could load them."""
    if cfg.rollout.lora_sync != "adapter":
        return
    where = sources.get("rollout.lora_sync", "the defaults")
    if not cfg.actor.lora.enabled:
        raise ConfigError(
            f"rollout.lora_sync = 'adapter' (from {where}) sends LoRA adapters, but actor.lora.enabled is false; "
            "enable actor.lora or set rollout.lora_sync = 'auto'"
        )
    actor = ModelAllocation.from_str(cfg.actor.backend).backend
    rollout = ModelAllocation.from_str(cfg.rollout.backend).backend
    if actor not in PEFT_ENGINES or rollout == "inprocess":
        raise ConfigError(
            f"rollout.lora_sync = 'adapter' (from {where}) needs an archon: or fsdp: actor and rollout servers, "
            f"but actor.backend = '{cfg.actor.backend}' and rollout.backend = '{cfg.rollout.backend}'; set "
            "rollout.lora_sync = 'merged'"
        )
