"""Model paths that name a Hugging Face hub repository (``actor.path = "Qwen/Qwen3-8B"``) as local folders.

An existing folder is used as it is.  A string shaped like ``org/name`` that is not a folder is looked up
in the local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
then downloaded into it when downloads are allowed and ``HF_HUB_OFFLINE`` is not set; otherwise a
``ConfigError`` says in one sentence where it looked and how to fetch the model.  Anything else is
returned unchanged, so a missing folder is reported where it is read, as before.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

from archon.config.schema import ConfigError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A hub repository id: ``org/name`` (letters, digits, '-', '_', '.'), nothing before or after."""

MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
"""What a download fetches: config, weights and tokenizer files (not the .bin/.pth copies some repos carry)."""


def is_hub_id(path: str) -> bool:
    """Whether ``path`` is shaped like a hub repository id and is not an existing file or folder."""
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).exists()


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment says now (tests and users may set it after import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (read now, not at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(path: str, key: str = "actor.path", *, download: bool = True) -> str:
    """A local folder for ``path`` (config key ``key``): itself, or a hub id's snapshot in the HF cache.

    ``download`` False only looks in the cache (``python -m archon.config`` checks without fetching).
    """
    if not path or not is_hub_id(path):
        return path
    cache = hub_cache_dir()
    try:
        return str(snapshot_download(path, cache_dir=cache, local_files_only=True, allow_patterns=list(MODEL_FILES)))
    except LocalEntryNotFoundError:
        pass
    fetch = f"fetch it with `huggingface-cli download {path}` (or `hf download {path}`)"
    if not download or hub_offline():
        why = "HF_HUB_OFFLINE is set" if hub_offline() else "this check does not download"
        raise ConfigError(
            f"{key} = '{path}' is not a local folder and not in the Hugging Face cache {cache} ({why}); {fetch} "
            f"on a machine with network access, set HF_HOME or HF_HUB_CACHE to the cache holding it, or point "
            f"{key} at a model folder"
        )
    try:
        return str(snapshot_download(path, cache_dir=cache, allow_patterns=list(MODEL_FILES)))
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError, ValueError) as exc:
        raise ConfigError(
            f"{key} = '{path}' is not a local folder, not in the Hugging Face cache {cache}, and downloading it "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); {fetch}, or point {key} "
            "at a model folder"
        ) from None
