"""Training engines behind one interface: ``ArchonEngine`` (Archon's models, ``archon:``) and
``FSDPEngine`` (any transformers causal LM, ``fsdp:``); ``build_engine(config)`` picks by backend."""

from archon.engine.engine import ArchonEngine, EngineError
from archon.engine.factory import build_engine, engine_class

__all__ = ["ArchonEngine", "EngineError", "build_engine", "engine_class"]
