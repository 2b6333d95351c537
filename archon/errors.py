"""The base class of every error a user can cause, and the ones no other module owns.

An ``ArchonError`` says in one sentence what was wrong, where, and how to fix it; the entry
points (``archon.cli.run_job``) print that sentence once and exit non-zero, without a
traceback.  Anything else that escapes is a bug and keeps its traceback.  Subclasses also
derive from the builtin they refine (``ConfigError`` is a ``ValueError``, ``RolloutError`` a
``RuntimeError``), so existing ``except ValueError`` code keeps working.

The lower layers (``parallel/``, ``pipeline/``, ``models/``) cannot import ``archon``; their user errors
(``HFConfigError``, ``HFCheckpointError``, ``ParallelConfigError``, ...) are listed by
``user_error_types()``.
"""

from __future__ import annotations


class ArchonError(Exception):
    """A problem the user can fix (config, allocation, data, model folder, cluster, request)."""


class DataError(ArchonError, ValueError):
    """A data file is missing, empty or malformed; the message names the file, the line and the fix."""


class ClusterError(ArchonError, ValueError):
    """The cluster or its launcher cannot run the plan (too few nodes, unreachable, run directory not shared)."""


class JobError(ArchonError, RuntimeError):
    """A job failed for a reason every rank knows and can state in one line (no traceback needed)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """``ArchonError`` and the user-error classes of the layers below ``archon/`` (which cannot import it)."""
    import models
    from parallel.errors import ParallelConfigError
    from pipeline.split import PipelineConfigError

    return (
        ArchonError,
        models.HFConfigError,
        models.ModelRegistryError,
        models.HFCheckpointError,
        PipelineConfigError,
        ParallelConfigError,
    )
