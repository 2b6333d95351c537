"""Reading a dataset a user has into rows (dicts): jsonl, json, parquet, or a Hugging Face dataset folder.

``datasets`` is imported by the functions that use it: it takes about a second to import (pyarrow, pandas), which
jsonl data and the other importers of ``archon.data`` need not pay.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archon.data.jsonl import load_jsonl
from archon.errors import DataError

logger = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Data files ``load_rows`` reads (a folder may hold any format the ``datasets`` library reads)."""

_WHAT_IT_TAKES = (
    "a .jsonl, .json or .parquet file, a folder written by datasets' save_to_disk, or a downloaded Hugging Face "
    "dataset folder (e.g. `hf download --repo-type dataset openai/gsm8k --local-dir data/gsm8k`)"
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (state.json) or ``DatasetDict.save_to_disk`` (dataset_dict.json)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _load_saved(folder: Path, split: str) -> Any:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"dataset folder '{folder}' has no split '{split}' (it has: {', '.join(map(str, loaded))}); set "
                "train_dataset.split to one of them"
            )
        return loaded[split]
    return loaded  # a single saved Dataset has no splits: it is the data whatever `split` says


def _load_with_builder(path: Path, split: str, subset: str | None) -> Any:
    import datasets
    from datasets.exceptions import DatasetGenerationError

    try:
        if path.is_dir():
            # A hub dataset's files (README.md configs, data/*.parquet, ...) laid out in a local folder.
            return datasets.load_dataset(str(path), subset or None, split=split)
        builder = "parquet" if path.suffix == ".parquet" else "json"
        # A single data file is one split named 'train' to the builder, whatever `split` says.
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except (ValueError, FileNotFoundError, DatasetGenerationError) as exc:
        # datasets' messages (missing config name, unknown split, unreadable file) run over several lines.
        raise DataError(
            f"cannot read dataset '{path}' (split '{split}'{f', subset {subset!r}' if subset else ''}): "
            f"{_first_line(exc)}; check train_dataset.split and train_dataset.subset"
        ) from None


def load_rows(path: str | Path, *, split: str = "train", subset: str | None = None) -> list[dict[str, Any]]:
    """Every row of the dataset at ``path`` as a dict, in file order.

    ``.jsonl`` files are read line by line as they always were (each row exactly as written, errors with
    line numbers); ``.json`` and ``.parquet`` files, ``save_to_disk`` folders and hub dataset folders go
    through the ``datasets`` library, whose columns give every row every field (None where a row had none).
    ``split`` picks the split of a folder with several; ``subset`` the configuration of a hub dataset
    (GSM8K's 'main' or 'socratic').
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset path '{path}' does not exist; set train_dataset.path to {_WHAT_IT_TAKES}")
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise DataError(
                f"dataset file '{path}' is not {', '.join(FILE_SUFFIXES)}; convert it or point train_dataset.path "
                f"at {_WHAT_IT_TAKES}"
            )
        if path.suffix == ".jsonl":
            return load_jsonl(path)
    if path.is_dir() and _is_saved_dataset(path):
        dataset = _load_saved(path, split)
    else:
        dataset = _load_with_builder(path, split, subset)
    rows = dataset.to_list()
    logger.debug("read %d rows from %s", len(rows), path)
    return rows
