"""Asyncio helpers of the rollout client: wait for many tasks, and cancel the rest at the first failure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def cancel_on_first_error(tasks: list[asyncio.Task]) -> list[BaseException]:
    """Wait for ``tasks``; at the first failure cancel the rest. Returns the failures (empty if none)."""
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    errors = [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return errors


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``aws`` in order; at the first failure (or when the caller is cancelled) the
    others are cancelled and waited for, and the failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
