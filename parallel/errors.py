"""The error a parallel layout raises when it cannot be applied as asked (a user can fix it)."""

from __future__ import annotations


class ParallelConfigError(ValueError):
    """Sizes or options of a parallel layout that cannot work for this model (a head count that
    does not divide by the TP size, an unknown AC mode); the message says what and how to fix it.

    Anything else ``parallel/`` raises is an internal error.  ``parallel/`` cannot import
    ``archon``; ``archon.errors.user_error_types()`` lists this class.
    """
