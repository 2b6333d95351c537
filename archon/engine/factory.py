"""``build_engine``: the training engine an allocation string asks for.

``archon:`` runs Archon's own model implementations (``ArchonEngine``, all five parallel dims);
``fsdp:`` runs any transformers causal LM (``FSDPEngine``: d, t, c).  Both are ``TrainEngine``s.
``megatron:`` parses, because AReaL configs use it, but Archon does not bundle Megatron-Core.
"""

from __future__ import annotations

from typing import Any

from archon.alloc import ModelAllocation, megatron_refusal
from archon.config import TrainEngineConfig
from archon.engine.engine import ArchonEngine
from archon.engine.errors import EngineError
from archon.engine.fsdp_engine import FSDPEngine
from archon.engine.interface import TrainEngine


def _engine_class(alloc: ModelAllocation, backend: str) -> type[TrainEngine]:
    if alloc.backend == "archon":
        return ArchonEngine
    if alloc.backend == "fsdp":
        return FSDPEngine
    if alloc.backend == "megatron":
        raise EngineError(megatron_refusal("backend", alloc))
    raise EngineError(f"backend = '{backend}' is an inference allocation; a training engine needs 'archon:' or 'fsdp:'")


def engine_class(backend: str) -> type[TrainEngine]:
    """The engine class for an allocation string's backend."""
    return _engine_class(ModelAllocation.from_str(backend), backend)


def build_engine(config: TrainEngineConfig, allocation: ModelAllocation | None = None, **kwargs: Any) -> TrainEngine:
    """``ArchonEngine`` or ``FSDPEngine`` for ``config.backend`` (not initialized); ``kwargs`` go to the engine.

    ``allocation`` is ``config.backend`` already parsed (``Config.allocations()``); without it
    the string is parsed here, once, and the engine gets the result.
    """
    alloc = allocation if allocation is not None else ModelAllocation.from_str(config.backend)
    return _engine_class(alloc, config.backend)(config, allocation=alloc, **kwargs)
