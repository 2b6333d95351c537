"""Training engines behind one interface, ``TrainEngine``: ``ArchonEngine`` (Archon's models, ``archon:``)
and ``FSDPEngine`` (any transformers causal LM, ``fsdp:``), siblings; ``build_engine(config)`` picks by backend."""

from archon.engine.engine import ArchonEngine
from archon.engine.errors import EngineError
from archon.engine.factory import build_engine, engine_class
from archon.engine.fsdp_engine import FSDPEngine
from archon.engine.interface import TrainEngine

__all__ = ["ArchonEngine", "EngineError", "FSDPEngine", "TrainEngine", "build_engine", "engine_class"]
