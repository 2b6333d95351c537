"""The ``datasets`` library's cache (the arrow files of every json or parquet file it reads) goes under tmp_path."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    # datasets reads its config module's HF_DATASETS_CACHE whenever it builds a dataset.
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")
