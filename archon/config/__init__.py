"""Archon's configuration: nested dataclasses, TOML files and command-line overrides.

Precedence is overrides > TOML > defaults.  Overrides are ``dotted.key=value`` where the
value is a TOML literal (``=false``, ``=1e-3``, ``='archon:d4'``); ``True``/``False`` are
accepted too, and a value that is not valid TOML is taken as a plain string, so
``actor.backend=archon:d2t2`` works without quotes.  A leading ``+`` on a key is accepted
(``+actor.archon.enable_compile=False``) for compatibility with AReaL command lines.

Section and key names follow AReaL's wherever AReaL has one.  ``critic``, ``ref`` and ``teacher`` have
the shape of ``actor``'s engine fields and inherit every one of them from ``actor`` unless
set explicitly (an empty ``backend`` or ``path`` also means "inherit").

``python -m archon.config --config x.toml [overrides]`` prints the resolved config and the
allocation table; ``--describe SECTION`` prints the documented keys of a section.

The package holds one job per module: ``schema`` (the dataclasses), ``loading`` (TOML,
overrides, inheritance, validation) and ``show`` (printing and the CLI); everything public
is importable from ``archon.config``.
"""

from archon.config.loading import load_config, parse_override, read_toml, validate_config
from archon.config.schema import (
    INHERITED_ENGINE_FIELDS,
    ActorConfig,
    ArchonEngineConfig,
    ClusterConfig,
    Config,
    ConfigError,
    CriticConfig,
    DatasetConfig,
    DynamicFilterConfig,
    GenerationConfig,
    MicroBatchSpec,
    NormConfig,
    NormLevel,
    OptimizerConfig,
    RejectionSamplingConfig,
    RewardConfig,
    RolloutConfig,
    SaverConfig,
    SGLangConfig,
    TrainEngineConfig,
    VLLMConfig,
    default_norms,
)
from archon.config.show import allocation_table, describe_section, main, to_dict, to_toml
from archon.field_docs import field_docs
from archon.wire.sglang import SGLANG_DEFAULT_MAX_NEW_TOKENS

__all__ = [
    "ActorConfig",
    "ArchonEngineConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DatasetConfig",
    "DynamicFilterConfig",
    "GenerationConfig",
    "INHERITED_ENGINE_FIELDS",
    "MicroBatchSpec",
    "NormConfig",
    "NormLevel",
    "OptimizerConfig",
    "RejectionSamplingConfig",
    "RewardConfig",
    "RolloutConfig",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "SGLangConfig",
    "SaverConfig",
    "TrainEngineConfig",
    "VLLMConfig",
    "allocation_table",
    "default_norms",
    "describe_section",
    "field_docs",
    "load_config",
    "main",
    "parse_override",
    "read_toml",
    "to_dict",
    "to_toml",
    "validate_config",
]
