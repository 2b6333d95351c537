"""Which model a run's KL reference is: a LoRA actor's own base weights, or an engine of its own."""

from __future__ import annotations

from archon.config.schema import Config


def reference_is_actor_base(cfg: Config) -> bool:
    """Whether the KL reference is the LoRA actor's base model with the adapters off (no engine of its own): the
    actor trains adapters and ``ref`` names the actor's model as it inherits it (backend, path, model_config and
    lora section all the actor's); ``ref.lora.enabled = false`` or another path or backend keeps a separate engine."""
    actor, ref = cfg.actor, cfg.ref
    return (
        actor.lora.enabled
        and (ref.backend, ref.path, ref.model_config) == (actor.backend, actor.path, actor.model_config)
        and ref.lora == actor.lora
    )
