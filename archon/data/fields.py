"""Finding a row's prompt, answer, completion and messages by (possibly dotted) field names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from archon.errors import DataError

PROMPT_KEYS = ("prompt", "question")
"""Where a prompt is looked for when ``prompt_key`` is unset: ours, then GSM8K's."""
ANSWER_KEYS = ("answer", "reward_model.ground_truth")
"""Where a reference answer is looked for when ``answer_key`` is unset: ours (AReaL's, GSM8K's), then verl's RL
layout (DAPO-Math-17k's)."""
COMPLETION_KEYS = ("completion",)
"""Where an SFT completion is looked for when ``completion_key`` is unset."""
MESSAGES_KEYS = ("messages",)
"""Where chat messages are looked for when ``messages_key`` is unset."""


def field_names(row: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every field of ``row``, nested ones dotted (``reward_model.ground_truth``), sorted."""
    names: list[str] = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            names.extend(field_names(value, f"{name}."))
        else:
            names.append(name)
    return sorted(names)


def get_field(row: Mapping[str, Any], key: str) -> Any:
    """The value of field ``key`` (a dotted key walks into nested objects), or ``None`` if the row has none.

    A column whose own name has a dot is found before a nested field; columnar files give absent fields
    the value None, so None counts as absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def find_field(row: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
    """The first of ``keys`` the row has a (non-None) value for, and that value."""
    for key in keys:
        value = get_field(row, key)
        if value is not None:
            return key, value
    return None


def keys_for(configured: str, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The configured field name alone, or the usual names when it is unset (empty)."""
    return (configured,) if configured else defaults


def missing_field(where: str, missing: str, row: Mapping[str, Any], config_key: str, why: str = "") -> DataError:
    """The error for a row without a field: ``{where} has {missing}``, why it is needed, the fields the row does
    have, and the config key that names the field."""
    return DataError(
        f"{where} has {missing} (its fields: {', '.join(field_names(row)) or 'none'}){why}; name the field that "
        f"holds it with train_dataset.{config_key} (a dotted name reaches into nested objects)"
    )
