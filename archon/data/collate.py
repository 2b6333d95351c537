"""Variable-length samples to the padded batch dict every engine call takes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any

import torch

_BUILTIN_NUMBERS = frozenset({bool, int, float})


def _dtype_of(values: Sequence[Any]) -> torch.dtype:
    kinds = set(map(type, values))  # one pass; exact types are much cheaper than isinstance on ABCs
    if kinds <= {bool} or all(isinstance(v, bool) for v in values):
        return torch.bool
    if kinds <= {int, bool} or all(isinstance(v, int) for v in values):  # bools count as ints here
        return torch.long
    return torch.float32


def _as_list(value: Any) -> list[Any] | None:
    """A per-token field as a flat list, or None if ``value`` is not a sequence of numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.dim() == 1 else None
    if isinstance(value, (list, tuple)) and (
        set(map(type, value)) <= _BUILTIN_NUMBERS or all(isinstance(v, Number) for v in value)
    ):
        return list(value)
    return None


def collate(
    samples: Sequence[Mapping[str, Any]], *, pad_token_id: int = 0, pad_to_multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into ``[B, S]`` tensors plus ``attention_mask``.

    Each sample has ``input_ids`` and any other fields: a sequence of numbers is a
    per-token field and must be as long as ``input_ids`` (padded with 0; ``input_ids``
    with ``pad_token_id``); a number is a per-sequence field (stacked to ``[B]``); other
    values (strings, dicts) are left out.  Integer fields become int64, booleans bool,
    anything else float32.
    """
    if not samples:
        raise ValueError("collate() got no samples")
    lengths = []
    for i, s in enumerate(samples):
        ids = _as_list(s.get("input_ids"))
        if ids is None:
            raise ValueError(f"sample {i} has no 'input_ids' list of token ids")
        lengths.append(len(ids))
    width = math.ceil(max(lengths) / pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        firsts = _as_list(samples[0][key])
        if firsts is not None:
            rows = []
            for i, s in enumerate(samples):
                row = _as_list(s.get(key))
                if row is None or len(row) != lengths[i]:
                    raise ValueError(
                        f"sample {i}: per-token field '{key}' must be a list as long as its input_ids "
                        f"({lengths[i]}), got {None if row is None else len(row)} values"
                    )
                rows.append(row)
            dtype = _dtype_of([v for row in rows for v in row] or [0])
            fill = pad_token_id if key == "input_ids" else 0
            out = torch.full((len(samples), width), fill, dtype=dtype)
            for b, row in enumerate(rows):
                out[b, : len(row)] = torch.tensor(row, dtype=dtype)
            batch[key] = out
        elif isinstance(samples[0][key], Number) or (
            isinstance(samples[0][key], torch.Tensor) and samples[0][key].dim() == 0
        ):
            values = [s[key].item() if isinstance(s[key], torch.Tensor) else s[key] for s in samples]
            batch[key] = torch.tensor(values, dtype=_dtype_of(values))
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    batch["attention_mask"] = attention
    return batch
