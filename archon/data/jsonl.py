"""Reading jsonl files (one JSON object per line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archon.errors import DataError


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every non-blank line of ``path`` parsed as a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file '{path}' does not exist; set train_dataset.path to a jsonl file")
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({exc.msg}); each line of a jsonl file must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}:{lineno} holds a {type(row).__name__}, not a JSON object; write one "
                    'object per line, e.g. {"prompt": ..., "answer": ...}'
                )
            rows.append(row)
    return rows
