"""``build_engine``: the training engine an allocation string asks for.

``archon:`` runs Archon's own model implementations (all five parallel dims); ``fsdp:`` runs
any transformers causal LM (d, t, c).  ``megatron:`` parses, because AReaL configs use it,
but Archon does not bundle Megatron-Core.
"""

from __future__ import annotations

from typing import Any

from archon.alloc import ModelAllocation, megatron_refusal
from archon.engine.engine import ArchonEngine, EngineError


def engine_class(backend: str) -> type[ArchonEngine]:
    """The engine class for an allocation string's backend."""
    alloc = ModelAllocation.from_str(backend)
    if alloc.backend == "archon":
        return ArchonEngine
    if alloc.backend == "fsdp":
        from archon.engine.fsdp_engine import FSDPEngine

        return FSDPEngine
    if alloc.backend == "megatron":
        raise EngineError(megatron_refusal("backend", alloc))
    raise EngineError(f"backend = '{backend}' is an inference allocation; a training engine needs 'archon:' or "
                      "'fsdp:'")


def build_engine(config: Any, **kwargs: Any) -> ArchonEngine:
    """``ArchonEngine`` or ``FSDPEngine`` for ``config.backend`` (not initialized); ``kwargs`` go to the engine."""
    return engine_class(config.backend)(config, **kwargs)
