"""``EngineError``: what a user can get wrong about a training engine (config, allocation, data)."""

from __future__ import annotations

from archon.errors import ArchonError


class EngineError(ArchonError, ValueError):
    """A user-caused problem with an engine's config, allocation or data."""
